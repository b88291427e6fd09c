"""The Qwen mixture-of-experts architectures as GGUF describes them: ``qwen2moe`` (Qwen1.5-MoE,
Qwen2-57B-A14B) and ``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B).

A layer: ``x += attention(rmsnorm(x))``, then ``x += moe(rmsnorm(x, ffn_norm))``.

- Attention: NEOX RoPE on the whole head. qwen2moe adds biases to q, k and v; qwen3moe has no
  biases but RMS-normalises each head of q and k (``attn_q_norm``, ``attn_k_norm``) before RoPE,
  and its head size (``attention.key_length``) need not be ``n_embd / n_heads``.
- Experts: softmax over all experts, top k. qwen2moe keeps the k probabilities as they are (no
  renormalisation) and adds a shared expert, scaled by ``sigmoid(ffn_gate_inp_shexp · h)``;
  qwen3moe renormalises the k weights to sum 1 and has no shared expert. (``expert_weights_norm``
  in the file overrides either default: Hugging Face's ``norm_topk_prob``.)
- A layer without ``ffn_gate_inp`` (Hugging Face's ``mlp_only_layers``) has a dense SwiGLU.
"""

from __future__ import annotations

from colibri.model.network.decoder import Decoder


class QwenMoeDecoder(Decoder):
    """qwen2moe and qwen3moe (the differences are in the file: which tensors a layer has, and the
    renormalisation default of each subclass)."""

    NEOX = True


class Qwen2MoeDecoder(QwenMoeDecoder):
    NORM_TOPK = False


class Qwen3MoeDecoder(QwenMoeDecoder):
    NORM_TOPK = True
