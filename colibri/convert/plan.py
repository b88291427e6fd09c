"""The building blocks of a conversion plan: what a GGUF tensor is made of, the checks, the parts
every architecture shares (sizes, metadata, embeddings, attention, feed-forward).

A plan lists the GGUF metadata a config.json gives (keys and value types as llama.cpp's converter
writes and ``llama-model.cpp`` reads them) and the output tensors: llama.cpp's names, shapes, and
for each one the checkpoint tensors it is made of (or the values it holds, for a tensor llama.cpp's
converter computes, such as Llama 3's ``rope_freqs``). The ``Builder`` checks it against the
checkpoint (every tensor present, every shape as the config says, nothing left over) before a byte
is written, so a bad checkpoint fails in a second, not after an hour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from colibri.convert.checkpoint_config import Config, ConvertError

T = gguf.MODEL_TENSOR
K = gguf.Keys
V = gguf.GGUFValueType

# Checkpoint tensors that carry nothing a GGUF model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Rope scalings every architecture's plan writes as llama.cpp does (an architecture may allow more).
ROPE_SCALINGS = ("default", "linear", "yarn")


@dataclass(frozen=True)
class Source:
    """A piece of an output tensor: a checkpoint tensor, or part of one."""

    name: str
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    expert: int | None = None  # index into the first axis of a 3-D (fused experts) tensor
    rows: tuple[int, int] | None = None  # row range taken (gate or up half of gate_up_proj)
    permute_heads: int | None = None  # llama.cpp's rope row permutation over this many heads
    shift: float = 0.0  # added to every value (Gemma's norms: the file holds 1 + w, see dense.py)
    transposed: bool = False  # the part is the transpose of ``rows`` (DeepSeek's k_b, see deepseek.py)
    # (first, step): every step-th output row from ``first`` (gpt-oss's interleaved gate and up): the
    # checkpoint's columns where it stores the matrix transposed, the rows of MXFP4 blocks
    columns: tuple[int, int] | None = None
    scales: str | None = None  # MXFP4: the exponents' tensor beside ``name``, the ``_blocks`` one

    def row_order(self, n_rows: int) -> np.ndarray | None:
        """Source row of each output row, or None when rows are taken in order."""
        if self.permute_heads is None:
            return None
        return llama_rope_order(n_rows, self.permute_heads)


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: its name, numpy-order shape and sources (one per expert when stacked), or
    the values it holds when it is computed from the config rather than read."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[Source, ...]
    quantizable: bool = True  # False: stays F32 whatever --type says (norms, biases, routers)
    values: tuple[float, ...] | None = None  # a computed vector (no sources), float32 values
    gtype: int | None = None  # a block type the checkpoint holds already (MXFP4), whatever --type says

    @property
    def part_shape(self) -> tuple[int, int]:
        """(rows, cols) of the matrix each source contributes (a vector is one row)."""
        if len(self.shape) == 1:
            return 1, self.shape[0]
        return self.shape[-2], self.shape[-1]


@dataclass
class Plan:
    arch: str
    hf_arch: str
    metadata: list[tuple[str, Any, gguf.GGUFValueType]] = field(default_factory=list)
    tensors: list[TensorPlan] = field(default_factory=list)
    n_vocab: int = 0
    warnings: list[str] = field(default_factory=list)  # one line each, for convert's ``warn``
    add_space_prefix: bool | None = None  # overrides the tokenizer's, where llama.cpp's converter does

    def kv(self, key: str, value: Any, vtype: gguf.GGUFValueType) -> None:
        self.metadata.append((key.format(arch=self.arch), value, vtype))


def llama_rope_order(n_rows: int, n_heads: int) -> np.ndarray:
    """For each output row, the input row: within every head, rows ``[x0..x_{d/2-1}, y0..]``
    become ``[x0, y0, x1, y1, ...]`` (llama.cpp's ``LlamaModel.permute``, as an index)."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)


class Builder:
    """Builds a Plan and checks it against the checkpoint's tensors as it goes."""

    def __init__(self, plan: Plan, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.plan, self.shapes, self.used = plan, shapes, set[str]()

    def has(self, name: str) -> bool:
        return name in self.shapes

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.shapes)

    def skip(self, name: str) -> None:
        """A tensor the checkpoint may hold that the file does not need (not a leftover)."""
        self.used.add(name)

    def source(self, name: str, shape: tuple[int, ...], **kw: Any) -> Source:
        if name not in self.shapes:
            raise ConvertError(f"missing tensor {name!r} (needed for {self.plan.hf_arch})")
        if tuple(self.shapes[name]) != shape:
            raise ConvertError(f"tensor {name!r} has shape {list(self.shapes[name])}, the config says "
                               f"{list(shape)}")
        self.used.add(name)
        return Source(name, shape, **kw)

    def add(self, gguf_name: str, shape: tuple[int, ...], *sources: Source, quantizable: bool = True,
            gtype: int | None = None) -> None:
        self.plan.tensors.append(TensorPlan(gguf_name, shape, tuple(sources), quantizable, gtype=gtype))

    def matrix(self, kind: T, bid: int | None, hf_name: str, rows: int, cols: int, **kw: Any) -> None:
        self.add(tensor_name(kind, bid, "weight"), (rows, cols), self.source(hf_name, (rows, cols), **kw))

    def vector(self, kind: T, bid: int | None, hf_name: str, n: int, suffix: str = "weight",
               src_shape: tuple[int, ...] | None = None, **kw: Any) -> None:
        src = self.source(hf_name, src_shape or (n,), **kw)
        self.add(tensor_name(kind, bid, suffix), (n,), src, quantizable=False)

    def computed(self, kind: T, values: np.ndarray) -> None:
        """A float32 vector the config determines (no checkpoint tensor), kept F32."""
        vals = tuple(float(v) for v in np.asarray(values, np.float32))
        self.plan.tensors.append(TensorPlan(tensor_name(kind, None, "weight"), (len(vals),), (), False, vals))

    def leftovers(self) -> list[str]:
        return sorted(n for n in self.shapes if n not in self.used and not n.endswith(IGNORED_SUFFIXES))


def tensor_name(kind: T, bid: int | None, suffix: str) -> str:
    """llama.cpp's name for a tensor kind (gguf-py's table), e.g. ``blk.3.ffn_up_exps.weight``."""
    base = gguf.TENSOR_NAMES[kind]
    return f"{base.format(bid=bid) if bid is not None else base}.{suffix}"


@dataclass(frozen=True)
class Dims:
    """The sizes every architecture shares, read once from config.json."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int

    @classmethod
    def read(cls, cfg: Config) -> Dims:
        n_embd, n_head = cfg.int("hidden_size"), cfg.int("num_attention_heads")
        n_head_kv = cfg.int("num_key_value_heads", n_head)
        if n_head == 0 or n_head_kv == 0 or n_head % n_head_kv:
            raise ConvertError(f"config.json: {n_head} heads do not group into {n_head_kv} kv heads")
        head_dim = cfg.int("head_dim", 0) or n_embd // n_head
        if head_dim == 0 or head_dim % 2:
            raise ConvertError(f"config.json: head dimension {head_dim} is not even")
        return cls(cfg.int("num_hidden_layers"), n_embd, cfg.int("intermediate_size"), n_head, n_head_kv,
                   head_dim, cfg.int("vocab_size"))


def common_metadata(plan: Plan, cfg: Config, d: Dims, n_blocks: int, rope_dim: int,
                    rope_scalings: tuple[str, ...] = ROPE_SCALINGS,
                    kv: tuple[int, int, int] | None = None) -> None:
    """The sizes, norm epsilon and rope of every architecture; a rope scaling outside
    ``rope_scalings`` is an error (the planner adds what its own scalings need). ``kv``: (kv heads,
    key length, value length) where they are not the config's heads (MLA's one latent head)."""
    n_head_kv, key_length, value_length = kv or (d.n_head_kv, d.head_dim, d.head_dim)
    plan.kv(K.LLM.VOCAB_SIZE, d.n_vocab, V.UINT32)
    plan.kv(K.LLM.CONTEXT_LENGTH, cfg.int("max_position_embeddings"), V.UINT32)
    plan.kv(K.LLM.EMBEDDING_LENGTH, d.n_embd, V.UINT32)
    plan.kv(K.LLM.FEED_FORWARD_LENGTH, d.n_ff, V.UINT32)
    plan.kv(K.LLM.BLOCK_COUNT, n_blocks, V.UINT32)
    plan.kv(K.Attention.HEAD_COUNT, d.n_head, V.UINT32)
    plan.kv(K.Attention.HEAD_COUNT_KV, n_head_kv, V.UINT32)
    plan.kv(K.Attention.KEY_LENGTH, key_length, V.UINT32)
    plan.kv(K.Attention.VALUE_LENGTH, value_length, V.UINT32)
    plan.kv(K.Attention.LAYERNORM_RMS_EPS, float(cfg.need("rms_norm_eps")), V.FLOAT32)
    plan.kv(K.Rope.FREQ_BASE, cfg.rope_theta(), V.FLOAT32)
    plan.kv(K.Rope.DIMENSION_COUNT, rope_dim, V.UINT32)
    rope_scaling_metadata(plan, cfg, rope_scalings)


def rope_scaling_metadata(plan: Plan, cfg: Config, allowed: tuple[str, ...]) -> None:
    """rope.scaling.* for linear and yarn scaling, as llama.cpp's converter writes them."""
    rope_type = cfg.rope_type()
    if rope_type not in allowed:
        raise ConvertError(f"config.json: rope scaling {rope_type!r} is not supported "
                           f"({', '.join(allowed)})")
    if rope_type in ("linear", "yarn"):
        plan.kv(K.Rope.SCALING_TYPE, rope_type, V.STRING)
        plan.kv(K.Rope.SCALING_FACTOR, cfg.rope_number("factor"), V.FLOAT32)
    if rope_type == "yarn" and cfg.rope.get("original_max_position_embeddings") is not None:
        # Absent, transformers and llama.cpp both take the context length as the original one.
        orig = int(cfg.rope_number("original_max_position_embeddings"))
        plan.kv(K.Rope.SCALING_ORIG_CTX_LEN, orig, V.UINT32)
    betas = (("beta_fast", K.Rope.SCALING_YARN_BETA_FAST), ("beta_slow", K.Rope.SCALING_YARN_BETA_SLOW))
    for beta, key in betas:
        if rope_type == "yarn" and cfg.rope.get(beta) is not None:  # absent: llama.cpp's 32 and 1
            plan.kv(key, cfg.rope_number(beta), V.FLOAT32)


def embeddings(b: Builder, cfg: Config, d: Dims, norm_shift: float = 0.0) -> None:
    """Embedding, final norm, output head. Tied (``tie_word_embeddings``), the head is the
    embedding, as transformers ties it: no ``output.weight``, a saved ``lm_head.weight`` is not
    read, and a checkpoint with only ``lm_head.weight`` gives the embedding from it."""
    tied = cfg.get("tie_word_embeddings", False)
    if tied not in (True, False):
        raise ConvertError(f"config.json: tie_word_embeddings is {tied!r}, not true or false")
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    reverse = tied and not b.has(embed) and b.has(head)
    b.matrix(T.TOKEN_EMBD, None, head if reverse else embed, d.n_vocab, d.n_embd)
    b.vector(T.OUTPUT_NORM, None, "model.norm.weight", d.n_embd, shift=norm_shift)
    if tied:
        b.skip(head)
    elif not b.has(head):
        raise ConvertError(f"missing tensor {head!r}: config.json says tie_word_embeddings is false, so "
                           "the output layer is its own matrix (if it is the embedding, the config "
                           "should say tie_word_embeddings: true)")
    else:
        b.matrix(T.OUTPUT, None, head, d.n_vocab, d.n_embd)


def attention(b: Builder, i: int, d: Dims, *, permute: bool, qk_norm: bool, post_norm: T,
              norm_shift: float = 0.0) -> None:
    """Attention block of layer ``i`` and the norm after it (``post_norm``: before the
    feed-forward part, or Gemma's post-attention norm); every norm weight plus ``norm_shift``."""
    p = f"model.layers.{i}"
    q_rows, kv_rows = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    b.vector(T.ATTN_NORM, i, f"{p}.input_layernorm.weight", d.n_embd, shift=norm_shift)
    for kind, proj, rows, heads in ((T.ATTN_Q, "q_proj", q_rows, d.n_head), (T.ATTN_K, "k_proj", kv_rows,
                                    d.n_head_kv), (T.ATTN_V, "v_proj", kv_rows, None)):
        perm = heads if permute else None
        b.matrix(kind, i, f"{p}.self_attn.{proj}.weight", rows, d.n_embd, permute_heads=perm)
        if b.has(f"{p}.self_attn.{proj}.bias"):
            b.vector(kind, i, f"{p}.self_attn.{proj}.bias", rows, suffix="bias", permute_heads=perm)
    b.matrix(T.ATTN_OUT, i, f"{p}.self_attn.o_proj.weight", d.n_embd, q_rows)
    if qk_norm:
        b.vector(T.ATTN_Q_NORM, i, f"{p}.self_attn.q_norm.weight", d.head_dim, shift=norm_shift)
        b.vector(T.ATTN_K_NORM, i, f"{p}.self_attn.k_norm.weight", d.head_dim, shift=norm_shift)
    b.vector(post_norm, i, f"{p}.post_attention_layernorm.weight", d.n_embd, shift=norm_shift)


def dense_ffn(b: Builder, i: int, prefix: str, n_embd: int, n_ff: int,
              kinds: tuple[T, T, T] = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)) -> None:
    gate, up, down = kinds
    b.matrix(gate, i, f"{prefix}.gate_proj.weight", n_ff, n_embd)
    b.matrix(up, i, f"{prefix}.up_proj.weight", n_ff, n_embd)
    b.matrix(down, i, f"{prefix}.down_proj.weight", n_embd, n_ff)


def first_present(b: Builder, *names: str) -> str:
    """The first of ``names`` the checkpoint has (or the first, for the missing-tensor error)."""
    return next((n for n in names if b.has(n)), names[0])

