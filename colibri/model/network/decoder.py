"""The decoder loop that every architecture here shares; each architecture's module (``llama.py``,
``qwen_moe.py``, ``glm4moe.py``) is a subclass that says how its layers differ (class attributes,
``is_moe``), never a forward pass of its own.

A layer: ``x += attention(rmsnorm(x))``, then ``x += ffn(rmsnorm(x, <ffn norm>))``, the FFN being a
dense SwiGLU (one compiled call for the whole layer) or the layer's experts (the attention call, the
routing, one call per distinct expert of the step; ``moe.py``). A forward step is a ragged batch:
rows ``[0, n_direct)`` are decode rows, the rest prompt rows (which differ only for float and
in-place block weights: packed matrices and attention take every row alike).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba.core.dispatcher import Dispatcher

from colibri.model.hparams import HParams
from colibri.model.interface import StepTimes
from colibri.model.kernels.ops import add_into, rope_frequencies
from colibri.model.kv_cache import KVCache
from colibri.model.network.embedding import Embedding, OutputHead
from colibri.model.network.layers import AttnShape, attention_then_norm, dense_layer, load_attention, load_ffn
from colibri.model.network.moe import GATING_SOFTMAX, load_moe_ffn, routing
from colibri.model.network.weights import load_vector
from colibri.store.experts import Budget, ExpertStore
from colibri.store.gguf import GGUFFile


class Entry:
    """A compiled layer function called without numba's dispatcher, through the entry point of the
    signature its first call had. The dispatcher types every argument of every call, and a layer's
    weights are NamedTuples of arrays, which it types in Python: 7 us of a dense layer's 74 (0.2 ms
    a token on the default model, 30 layers). A layer's arguments have the same types at every
    step: ``Decoder`` checks at load that every layer's weights type alike (else it keeps the
    dispatcher) and normalizes the step's arrays, because an entry point reads whatever it is given
    as the types it was compiled for."""

    def __init__(self, fn: Dispatcher) -> None:
        self.fn = fn
        self.entry: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.entry is None:
            self.entry = self.fn.compile(tuple(self.fn.typeof_pyval(a) for a in args))
        return self.entry(*args)


def same_types(fn: Dispatcher, values: list[Any]) -> bool:
    """Whether numba types every one of ``values`` alike (one layer argument across the layers)."""
    return len({fn.typeof_pyval(v) for v in values}) <= 1


class Decoder:
    """Weights (views of the mmap, packed) and the forward step; ``experts`` is the expert store
    (no layers in a dense model)."""

    GATING = GATING_SOFTMAX  # the router's gating unless the file says (expert_gating_func)
    NORM_TOPK = True  # renormalise the top-k weights unless the file says (expert_weights_norm)
    NEOX = False  # RoPE on (i, i + d/2) pairs (NEOX) rather than adjacent ones
    FFN_NORM = "ffn_norm"  # the norm before the feed-forward

    def is_moe(self, gguf: GGUFFile, hp: HParams, layer: int) -> bool:
        return f"blk.{layer}.ffn_gate_inp.weight" in gguf.tensors

    def __init__(self, gguf: GGUFFile, hp: HParams, ram_budget: Budget = None) -> None:
        """``ram_budget``: bytes (or experts per MoE layer) the expert store's resident copies may take
        (None: no limit)."""
        self.hp = hp
        self.embedding = Embedding(gguf, hp.n_embd)
        self.head = OutputHead(gguf, hp.n_embd, hp.norm_eps)
        self.experts = ExpertStore(gguf, hp.n_layers, hp.n_expert, hp.n_expert_used, ram_budget)
        rule = routing(hp, self.GATING, norm=self.NORM_TOPK)
        self.attn, self.ffn_norm, self.ffn, self.moe = [], [], [], []
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            self.attn.append(load_attention(gguf, i, hp))
            self.ffn_norm.append(load_vector(gguf, p + self.FFN_NORM + ".weight"))
            moe = self.is_moe(gguf, hp, i)
            self.moe.append(load_moe_ffn(gguf, i, rule, self.experts) if moe else None)
            self.ffn.append(None if moe else load_ffn(gguf, p))
        self.shape = AttnShape(hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.norm_eps, self.NEOX)
        self.inv_freq = rope_frequencies(hp.head_dim, hp.rope_dim, hp.rope_base)
        alike = (same_types(dense_layer, self.attn) and same_types(dense_layer, self.ffn_norm)
                 and same_types(dense_layer, [f for f in self.ffn if f is not None]))
        self.dense_layer = Entry(dense_layer) if alike else dense_layer
        self.attention_then_norm = Entry(attention_then_norm) if alike else attention_then_norm
        self.step_times = StepTimes()

    def forward(
        self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
        logit_rows: np.ndarray, n_direct: int = 0, embeds: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one step; write every row's K/V into its slot; return logits of ``logit_rows``.

        The first ``n_direct`` rows are decode rows (the direct matmul path), the rest prompt rows
        (tiled); the logits always take the direct path, one row per sequence. ``embeds``
        ([rows, n_embd] float32): soft inputs entering at layer 0 in place of the tokens' rows."""
        start, done = time.perf_counter(), False
        slots = np.ascontiguousarray(slots, np.int64).reshape(-1)
        positions = np.ascontiguousarray(positions, np.int64).reshape(-1)
        n_direct = int(n_direct)
        try:
            x = self.embedding(tokens) if embeds is None else np.array(embeds, np.float32, order="C")
            if x.ndim != 2 or x.shape[1] != self.hp.n_embd:
                raise ValueError(f"soft input rows must be [rows, {self.hp.n_embd}], got {list(x.shape)}")
            h = np.empty_like(x)
            t_attn = 0.0
            for i in range(self.hp.n_layers):
                args = (self.shape, kv.k, kv.v, i, slots, positions, self.inv_freq, n_direct)
                if self.moe[i] is None:
                    self.dense_layer(x, self.attn[i], self.ffn_norm[i], self.ffn[i], *args)
                else:
                    t0 = time.perf_counter()
                    self.attention_then_norm(x, self.attn[i], self.ffn_norm[i], *args, h)
                    t_attn += time.perf_counter() - t0
                    add_into(x, self.moe[i](h, n_direct))
            t0 = time.perf_counter()
            logits = self.head(x, logit_rows)
            self.step_times = StepTimes(t_attn, time.perf_counter() - t0)
            done = True
            return logits
        finally:  # a step that failed is not weighed, but its counts end with it
            self.experts.step_done(time.perf_counter() - start, decode=done and n_direct == len(x))
