"""The llama architecture as GGUF describes it: dense (SmolLM2, Llama 2/3, Mistral …) and, with
``ffn_gate_inp`` and 3-D expert tensors in its layers, mixtral-style mixture of experts.

A layer: ``x += attention(rmsnorm(x))`` (llama's adjacent-pair RoPE on every dimension), then
``x += ffn(rmsnorm(x, ffn_norm))``, the FFN being a SwiGLU (dense) or the experts of the layer
(softmax over all experts, top k, weights renormalised to sum 1). A dense layer is one compiled
call; a MoE layer is the attention call, the routing, one call per distinct expert of the step.
"""

from __future__ import annotations

from colibri.model.network.decoder import Decoder


class LlamaDecoder(Decoder):
    """llama and mixtral: adjacent-pair RoPE, softmax top-k renormalised, ``ffn_norm``."""
