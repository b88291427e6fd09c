"""The decoder loop that every architecture here shares; each architecture's module (``llama.py``,
``dense.py``, ``gemma3.py``, ``qwen_moe.py``, ``glm4moe.py``, ``olmoe.py``) is a subclass that says
how its layers differ (class attributes, ``is_moe``, ``is_sliding``), never a forward pass of its own.

A layer: ``x += attention(rmsnorm(x))``, then ``x += ffn(rmsnorm(x, <ffn norm>))``, the FFN being a
dense SwiGLU or GeGLU (one compiled call for the whole layer) or the layer's experts (the attention
call, the routing, one call per distinct expert of the step; ``moe.py``). Where the architecture
has post-norms (gemma3), each branch's output is normed before it is added. A forward step is a ragged batch:
rows ``[0, n_direct)`` are decode rows, the rest prompt rows (which differ only for float and
in-place block weights: packed matrices and attention take every row alike).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from colibri.model.hparams import HParams
from colibri.model.interface import StepTimes
from colibri.model.kernels.ops import add_into, rope_frequencies
from colibri.model.kv_cache import KVCache
from colibri.model.network.embedding import Embedding, OutputHead
from colibri.model.network.entry import Entry, same_types
from colibri.model.network.layers import (
    FFNNorms,
    LayerShape,
    attention_then_norm,
    dense_layer,
    load_attention,
    load_ffn,
)
from colibri.model.network.moe import MoEFFN, load_moe_ffn
from colibri.model.network.nextn import NextN
from colibri.model.network.routing import GATING_SOFTMAX, Routing, routing
from colibri.model.network.weights import named_norm, optional_vector
from colibri.model.yarn import yarn_divisors, yarn_magnitude
from colibri.store.experts import Budget, ExpertStore
from colibri.store.gguf import GGUFError, GGUFFile


class Decoder:
    """Weights (views of the mmap, packed) and the forward step; ``experts`` is the expert store
    (no layers in a dense model)."""

    GATING = GATING_SOFTMAX  # the router's gating unless the file says (expert_gating_func)
    NORM_TOPK = True  # renormalise the top-k weights unless the file says (expert_weights_norm)
    NEOX = False  # RoPE on (i, i + d/2) pairs (NEOX) rather than adjacent ones
    FFN_NORM = "ffn_norm"  # the norm before the feed-forward
    ATTN_POST_NORM = ""  # the norm of attention's output before the residual add ("": none)
    FFN_POST_NORM = ""  # the norm of the feed-forward's output before the residual add
    GELU = False  # the dense FFN is a GeGLU (tanh GELU) rather than a SwiGLU
    # Sliding-window layers where the file gives no pattern: the period (its last layer global; 0:
    # every layer local). None: the architecture has none, a window in its file ignored (llama.cpp
    # ignores phi3's, and reads none for llama or qwen2).
    SWA_PERIOD: int | None = None
    SWIGLU_CLAMP = (0.0, 0.0)  # the experts' clamped SwiGLU (alpha, limit); (0, 0): the plain one
    NEXTN = False  # runs the file's next-token-prediction (MTP) layer, where it has one (``nextn.py``)
    # The attention half's compiled calls: a dense layer whole, and a MoE layer's first half (one
    # pair for every attention of ``layers.py``; ``mla.py`` has latent attention's).
    DENSE_LAYER = staticmethod(dense_layer)
    ATTENTION_THEN_NORM = staticmethod(attention_then_norm)

    def load_attention(self, gguf: GGUFFile, i: int, hp: HParams) -> Any:
        """Layer i's attention weights, as ``DENSE_LAYER`` and ``ATTENTION_THEN_NORM`` take them."""
        return load_attention(gguf, i, hp, self.ATTN_POST_NORM)

    def is_moe(self, gguf: GGUFFile, hp: HParams, layer: int) -> bool:
        return f"blk.{layer}.ffn_gate_inp.weight" in gguf.tensors

    @classmethod
    def is_sliding(cls, hp: HParams, layer: int) -> bool:
        """Whether a layer attends to a window of ``hp.sliding_window`` positions only: as the
        file's pattern says (per layer, or a period whose last layer is global), else as the
        architecture's period (llama.cpp's default)."""
        if hp.sliding_window <= 0 or cls.SWA_PERIOD is None:
            return False
        pattern = hp.swa_pattern if hp.swa_pattern is not None else cls.SWA_PERIOD
        if isinstance(pattern, tuple):
            return layer < len(pattern) and pattern[layer]
        return pattern == 0 or layer % pattern < pattern - 1

    @classmethod
    def local_rope_base(cls, hp: HParams) -> float:
        """The sliding layers' RoPE base: ``rope.freq_base_swa`` (10000 where absent, gemma3's)."""
        return hp.rope_base_swa

    def query_scale(self, hp: HParams) -> float:
        """The scale of q·k: 1/sqrt(head_dim) (llama.cpp reads no file's own for these families)."""
        return 1.0 / math.sqrt(hp.head_dim)

    def embedding_scale(self, hp: HParams) -> float:
        """What the token embeddings are multiplied by (gemma: sqrt(n_embd))."""
        return 1.0

    def layer_frequencies(self, hp: HParams, layer: int, factors: np.ndarray) -> np.ndarray:
        """Layer i's inverse frequencies: the local base on sliding layers, the linear scaling on
        the others, divided by the file's per-frequency ``factors`` (Llama 3's ``rope_freqs``,
        Phi's ``rope_factors_short`` or ``_long``: their scalings as the converter bakes them)."""
        if self.is_sliding(hp, layer):
            inv = rope_frequencies(hp.head_dim, hp.rope_dim, self.local_rope_base(hp))
        else:
            inv = rope_frequencies(hp.head_dim, hp.rope_dim, hp.rope_base) / hp.rope_linear
        return inv / factors if factors.shape[0] else inv

    def __init__(self, gguf: GGUFFile, hp: HParams, ram_budget: Budget = None, mtp: bool = False) -> None:
        """``ram_budget``: bytes (or experts per MoE layer) the expert store's resident copies may take
        (None: no limit); ``mtp``: load the file's first NextN layer where the architecture runs one
        (``nextn``: its weights and experts; its K/V layer is the cache's whether loaded or not)."""
        self.hp = hp
        has_nextn = self.NEXTN and hp.n_nextn > 0
        self.kv_layers = hp.kv_layers  # a NextN layer's K/V: the last
        n_run = hp.n_layers + (has_nextn and mtp)  # the layers loaded: the NextN one last
        self.embedding = Embedding(gguf, hp.n_embd)
        if (why := hp.unsupported_rope()) is not None:
            raise GGUFError(f"{gguf.path}: {why}")
        self.head = OutputHead(gguf, hp.n_embd, hp.norm_eps)
        self.experts = ExpertStore(gguf, n_run, hp.n_expert, hp.n_expert_used, ram_budget)
        rule = routing(hp, self.GATING, norm=self.NORM_TOPK)
        # Per-frequency RoPE divisors: Llama 3's; or Phi's short ones, and its long ones for a cache
        # longer than the original context (llama.cpp's choice: by the context, not the position).
        short = optional_vector(gguf, "rope_freqs.weight")
        if short.shape[0] == 0:
            short = optional_vector(gguf, "rope_factors_short.weight")
        if hp.rope_scaling == "yarn":
            short = yarn_divisors(hp).astype(np.float32)
        long = optional_vector(gguf, "rope_factors_long.weight")
        if hp.rope_scaling == "longrope" and long.shape[0] == 0:
            raise GGUFError(f"{gguf.path}: RoPE scaling 'longrope' without its factors (rope_factors_long)")
        self.embed_scale = np.float32(self.embedding_scale(hp))
        self.attn, self.ffn_norm, self.ffn, self.moe = [], [], [], []
        self.shapes, self.inv_freq, self.inv_freq_long = [], [], []
        for i in range(n_run):
            p = f"blk.{i}."
            self.attn.append(self.load_attention(gguf, i, hp))
            norms = FFNNorms(named_norm(gguf, p, self.FFN_NORM), named_norm(gguf, p, self.FFN_POST_NORM))
            self.ffn_norm.append(norms)
            moe = self.is_moe(gguf, hp, i)
            if moe and (self.GELU or self.FFN_POST_NORM):  # the experts' call knows neither
                raise NotImplementedError(f"{hp.arch}: a MoE layer with GeGLU or an FFN post-norm")
            self.moe.append(self._load_moe(gguf, hp, i, rule) if moe else None)
            self.ffn.append(None if moe else load_ffn(gguf, p))
            window = hp.sliding_window if self.is_sliding(hp, i) else 0
            self.shapes.append(LayerShape(hp.n_heads, hp.n_kv_heads, hp.head_dim, float(hp.norm_eps),
                                          self.NEOX, float(self.query_scale(hp)), window, self.GELU,
                                          float(hp.rope_attn_factor * yarn_magnitude(hp))))
            self.inv_freq.append(self.layer_frequencies(hp, i, short.astype(np.float64)))
            self.inv_freq_long.append(self.layer_frequencies(hp, i, long.astype(np.float64)))
        if long.shape[0] == 0:
            self.inv_freq_long = self.inv_freq
        def alike(n: int) -> bool:  # the first n layers' arguments type alike
            return all(same_types(self.DENSE_LAYER, values[:n]) for values in (
                self.attn, self.ffn_norm, [f for f in self.ffn[:n] if f is not None], self.shapes,
                self.inv_freq[:n] + self.inv_freq_long[:n]))

        main = alike(hp.n_layers)
        self.dense_layer = Entry(self.DENSE_LAYER) if main else self.DENSE_LAYER
        self.attention_then_norm = Entry(self.ATTENTION_THEN_NORM) if main else self.ATTENTION_THEN_NORM
        # the NextN layer through the entry points only where its weights type as the others'
        self._nextn_entries = main and alike(n_run)
        self.step_times = StepTimes()
        self._hidden = np.zeros((0, hp.n_embd), np.float32)  # the last step's last-layer rows, pre-norm
        self.nextn = (NextN(gguf, hp, hp.n_layers, self.layer, self.embedding, self.head.output)
                      if n_run > hp.n_layers else None)
        gguf.release_again()  # what the small tensors' reads mapped back

    def _load_moe(self, gguf: GGUFFile, hp: HParams, i: int, rule: Routing) -> MoEFFN:
        """Layer i's experts (the NextN layer's are not read ahead from the last layer's input:
        another space), with the architecture's SwiGLU."""
        return load_moe_ffn(gguf, i, rule, self.experts, i < hp.n_layers, self.SWIGLU_CLAMP)

    def rope_variant(self, n_ctx: int) -> str:
        """"": the same RoPE at any context; else "short" or "long": Phi's factors, the long ones for a
        cache longer than the original context (llama.cpp's choice: by the context, not the
        position)."""
        if self.inv_freq_long is self.inv_freq:
            return ""
        return "long" if n_ctx > self.hp.n_ctx_orig else "short"

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
            if embeds is None:  # (soft inputs enter as they are, as llama.cpp takes them)
                x = self.embedding(tokens)
                if self.embed_scale != 1:
                    x *= self.embed_scale
            else:
                x = np.array(embeds, np.float32, order="C")
            if x.ndim != 2 or x.shape[1] != self.hp.n_embd:
                raise ValueError(f"soft input rows must be [rows, {self.hp.n_embd}], got {list(x.shape)}")
            h = np.empty_like(x)  # every MoE layer's normed rows, one buffer a step
            t_attn = sum(self.layer(i, x, kv, slots, positions, n_direct, h) for i in range(self.hp.n_layers))
            self._hidden = x
            t0 = time.perf_counter()
            logits = self.head(x, logit_rows)
            self.step_times = StepTimes(t_attn, time.perf_counter() - t0)
            done = True
            return logits
        finally:  # a step that failed is not weighed, but its counts end with it
            self.experts.step_done(time.perf_counter() - start, decode=done and n_direct == len(x))

    def layer(self, i: int, x: np.ndarray, kv: KVCache, slots: np.ndarray, positions: np.ndarray,
              n_direct: int, h: np.ndarray | None = None) -> float:
        """Layer i on the rows ``x``, in place; the seconds of its attention where it is its own
        call (a MoE layer's), else 0. ``h``: scratch rows like ``x`` (a MoE layer's FFN input)."""
        inv_freq = self.inv_freq_long if self.rope_variant(kv.n_ctx) == "long" else self.inv_freq
        args = (self.shapes[i], kv.k, kv.v, i, slots, positions, inv_freq[i], n_direct)
        entries = i < self.hp.n_layers or self._nextn_entries
        if self.moe[i] is None:
            dense = self.dense_layer if entries else self.DENSE_LAYER
            dense(x, self.attn[i], self.ffn_norm[i], self.ffn[i], *args)
            return 0.0
        h = np.empty_like(x) if h is None else h
        t0 = time.perf_counter()
        attend = self.attention_then_norm if entries else self.ATTENTION_THEN_NORM
        attend(x, self.attn[i], self.ffn_norm[i], *args, h)
        t_attn = time.perf_counter() - t0
        add_into(x, self.moe[i](h, n_direct))
        return t_attn

    def hidden(self, rows: np.ndarray) -> np.ndarray:
        """The last step's ``rows`` as the output head sees them: the last layer's output, after
        the final norm (the NextN layer's input, as vLLM and SGLang give it)."""
        return self.head.normed(self._hidden[rows])

    def draft(self, tokens: np.ndarray, hidden: np.ndarray, slots: np.ndarray, positions: np.ndarray,
              kv: KVCache, logit_rows: np.ndarray, n_direct: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The NextN layer's step (``nextn.py``): its logits of ``logit_rows`` and those rows as
        its head sees them (the next draft row's hidden state)."""
        if self.nextn is None:
            raise ValueError(f"{self.hp.arch}: no NextN layer loaded")
        # (the layer's entry points read whatever they are given as the types they were compiled for)
        tokens, slots, positions, logit_rows = (np.ascontiguousarray(a, np.int64).reshape(-1)
                                                for a in (tokens, slots, positions, logit_rows))
        hidden = np.ascontiguousarray(hidden, np.float32)
        n = tokens.shape[0]
        if hidden.shape != (n, self.hp.n_embd) or slots.shape[0] != n or positions.shape[0] != n:
            raise ValueError(f"NextN rows: {tokens.shape[0]} tokens, hidden {list(hidden.shape)}, "
                             f"{slots.shape[0]} slots, {positions.shape[0]} positions")
        start = time.perf_counter()
        try:
            return self.nextn(tokens, hidden, slots, positions, kv, logit_rows, int(n_direct))
        finally:  # its expert uses are not the next step's
            self.experts.step_done(time.perf_counter() - start, decode=False)
