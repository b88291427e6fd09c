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

import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.ops import add_into, rope_frequencies
from colibri.model.kv_cache import KVCache
from colibri.model.moe import GATING_SOFTMAX, load_moe_ffn, routing
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


class QwenMoeModel:
    """Weights and the forward step of qwen2moe and qwen3moe (the differences are in the file:
    which tensors a layer has, and the renormalisation default of each subclass)."""

    NORM_TOPK = False

    def __init__(self, gguf: GGUFFile, hp: HParams) -> None:
        self.hp = hp
        self.embedding = Embedding(gguf, hp.n_embd, hp.norm_eps)
        self.experts = ExpertStore(gguf, hp)
        rule = routing(hp, GATING_SOFTMAX, norm=self.NORM_TOPK)
        self.attn, self.ffn_norm, self.ffn, self.moe = [], [], [], []
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            self.attn.append(load_attention(gguf, i, hp))
            self.ffn_norm.append(load_vector(gguf, p + "ffn_norm.weight"))
            moe = p + "ffn_gate_inp.weight" in gguf.tensors
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


class Qwen2MoeModel(QwenMoeModel):
    NORM_TOPK = False


class Qwen3MoeModel(QwenMoeModel):
    NORM_TOPK = True
