"""The llama architecture as GGUF describes it: dense (SmolLM2, Llama 2/3, Mistral …) and, with
``ffn_gate_inp`` and 3-D expert tensors in its layers, mixtral-style mixture of experts.

A layer: ``x += attention(rmsnorm(x))`` (llama's adjacent-pair RoPE on every dimension), then
``x += ffn(rmsnorm(x, ffn_norm))``, the FFN being a SwiGLU (dense) or the experts of the layer
(softmax over all experts, top k, weights renormalised to sum 1). A dense layer is one compiled
call; a MoE layer is the attention call, the routing, one call per distinct expert of the step.
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


class LlamaModel:
    """Weights (views of the mmap, packed) and the forward step."""

    def __init__(self, gguf: GGUFFile, hp: HParams) -> None:
        self.hp = hp
        self.embedding = Embedding(gguf, hp.n_embd, hp.norm_eps)
        self.experts = ExpertStore(gguf, hp)
        rule = routing(hp, GATING_SOFTMAX, norm=True)
        self.attn, self.ffn_norm, self.ffn, self.moe = [], [], [], []
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            self.attn.append(load_attention(gguf, i, hp))
            self.ffn_norm.append(load_vector(gguf, p + "ffn_norm.weight"))
            if p + "ffn_gate_inp.weight" in gguf.tensors:
                self.moe.append(load_moe_ffn(gguf, i, rule, self.experts))
                self.ffn.append(None)
            else:
                self.moe.append(None)
                self.ffn.append(load_ffn(gguf, p))
        self.shape = AttnShape(hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.norm_eps, False)
        self.inv_freq = rope_frequencies(hp.head_dim, hp.rope_dim, hp.rope_base)

    def forward(
        self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
        logit_rows: np.ndarray, n_direct: int = 0,
    ) -> np.ndarray:
        """Run one step; write every row's K/V into its slot; return logits of ``logit_rows``.

        The first ``n_direct`` rows are decode rows (the direct matmul path), the rest prompt rows
        (tiled); the logits always take the direct path, one row per sequence."""
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
