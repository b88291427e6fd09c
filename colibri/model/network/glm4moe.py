"""The GLM-4.5 mixture-of-experts architecture as GGUF describes it: ``glm4moe`` (GLM-4.5,
GLM-4.5-Air).

A layer: ``x += attention(rmsnorm(x))``, then ``x += ffn(rmsnorm(x, post_attention_norm))``.

- Attention: q, k and v biases; per-head RMSNorm of q and k when the file has ``attn_q_norm`` and
  ``attn_k_norm`` (GLM-4.5, not -Air); NEOX RoPE on the first ``rope.dimension_count`` dimensions of
  each head only (partial rotary: half of them in GLM-4.5), the rest passed through.
- FFN: the first ``leading_dense_block_count`` layers are dense SwiGLUs. The others: routed experts
  plus an ungated shared expert (``ffn_*_shexp``), summed. Routing: ``s = sigmoid(router · h)``; the
  experts are chosen by ``s + exp_probs_b`` (the score-correction bias), within the
  ``expert_group_used_count`` best of ``expert_group_count`` groups when there are groups (a group
  ranked by the sum of its two best corrected scores); weighted by the uncorrected ``s``,
  renormalised to sum 1 (``expert_weights_norm``), times ``expert_weights_scale`` (the routed
  scaling factor).
- Next-token-prediction layers (``nextn_predict_layers``, the last blocks of the file): the first
  drafts tokens for speculative decoding where it is loaded (``nextn.py``); the others are not run.
"""

from __future__ import annotations

from colibri.model.hparams import HParams
from colibri.model.network.decoder import Decoder
from colibri.model.network.routing import GATING_SIGMOID
from colibri.store.gguf import GGUFFile


class Glm4MoeDecoder(Decoder):
    """glm4moe: sigmoid gating, and (llama.cpp's default) no renormalisation unless the file asks
    for it; NEOX RoPE; the FFN norm is ``post_attention_norm``; leading layers dense."""

    GATING = GATING_SIGMOID
    NORM_TOPK = False
    NEOX = True
    FFN_NORM = "post_attention_norm"
    NEXTN = True

    def is_moe(self, gguf: GGUFFile, hp: HParams, layer: int) -> bool:
        return layer >= hp.n_dense_lead and super().is_moe(gguf, hp, layer)
