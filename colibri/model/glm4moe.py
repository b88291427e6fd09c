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
- Next-token-prediction layers (``nextn_predict_layers``, the last blocks of the file) are not run.
"""

from __future__ import annotations

import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.ops import add_into, rope_frequencies
from colibri.model.kv_cache import KVCache
from colibri.model.moe import GATING_SIGMOID, load_moe_ffn, routing
from colibri.model.transformer import (
    AttnShape,
    Embedding,
    attention_then_norm,
    dense_layer,
    load_attention,
    load_ffn,
    load_vector,
)
from colibri.store.experts import ExpertStore
from colibri.store.gguf import GGUFFile


class Glm4MoeModel:
    """Weights and the forward step."""

    def __init__(self, gguf: GGUFFile, hp: HParams) -> None:
        self.hp = hp
        self.embedding = Embedding(gguf, hp.n_embd, hp.norm_eps)
        self.experts = ExpertStore(gguf, hp)
        # llama.cpp's defaults: sigmoid gating; no renormalisation unless the file asks for it.
        rule = routing(hp, GATING_SIGMOID, norm=False)
        self.attn, self.ffn_norm, self.ffn, self.moe = [], [], [], []
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            self.attn.append(load_attention(gguf, i, hp))
            self.ffn_norm.append(load_vector(gguf, p + "post_attention_norm.weight"))
            moe = i >= hp.n_dense_lead and p + "ffn_gate_inp.weight" in gguf.tensors
            self.moe.append(load_moe_ffn(gguf, i, rule, self.experts) if moe else None)
            self.ffn.append(None if moe else load_ffn(gguf, p))
        self.shape = AttnShape(hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.norm_eps, True)
        self.inv_freq = rope_frequencies(hp.head_dim, hp.rope_dim, hp.rope_base)

    def forward(
        self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
        logit_rows: np.ndarray, n_direct: int = 0,
    ) -> np.ndarray:
        """Run one step; write every row's K/V into its slot; return logits of ``logit_rows``
        (rows ``[0, n_direct)`` are decode rows: see ``LlamaModel.forward``)."""
        x = self.embedding.embed(tokens)
        h = np.empty_like(x)
        for i in range(self.hp.n_layers):
            args = (self.shape, kv.k, kv.v, i, slots, positions, self.inv_freq, n_direct)
            if self.moe[i] is None:
                dense_layer(x, self.attn[i], self.ffn_norm[i], self.ffn[i], *args)
            else:
                attention_then_norm(x, self.attn[i], self.ffn_norm[i], *args, h)
                add_into(x, self.moe[i](h, n_direct))
        return self.embedding.logits(x, logit_rows)
