"""OLMoE as GGUF describes it: ``olmoe`` (OLMoE-1B-7B).

A layer: ``x += attention(rmsnorm(x))``, then ``x += moe(rmsnorm(x, ffn_norm))``.

- Attention: no biases; q and k each RMS-normalised over its whole width (``attn_q_norm`` is
  n_heads * head_dim wide, ``attn_k_norm`` n_kv_heads * head_dim: every head at once, where
  qwen3moe normalises head by head), then NEOX RoPE on the whole head.
- Experts: softmax over all experts, top k, the probabilities as they are (``norm_topk_prob`` is
  false in OLMoE-1B-7B; ``expert_weights_norm`` in the file overrides), no shared expert.
"""

from __future__ import annotations

from colibri.model.network.decoder import Decoder


class OlmoeDecoder(Decoder):
    """olmoe: the q/k norms' width is in the file (``layers.attention`` reads it from the weight)."""

    NEOX = True
    NORM_TOPK = False
