"""What a Hugging Face checkpoint of each supported architecture becomes in GGUF.

For each architecture: the GGUF metadata its config.json gives (keys and value types as llama.cpp's
converter writes and ``llama-model.cpp`` reads them), and the plan of output tensors: llama.cpp's
names, shapes, and for each one the checkpoint tensors it is made of. The plan is checked against
the checkpoint (every tensor present, every shape as the config says, nothing left over) before a
byte is written, so a bad checkpoint fails in a second, not after an hour.

The transformations, as llama.cpp does them:

- llama and mixtral (GGUF arch ``llama``, rope type NORM): the rows of ``q_proj`` and ``k_proj``
  (weights and biases) are permuted per head from Hugging Face's rotate-half layout (pairs
  ``(i, i + d/2)``) to the interleaved pairs ``(2i, 2i + 1)`` llama.cpp's NORM rope rotates.
- qwen2moe, qwen3moe, glm4moe use NEOX rope, which is the rotate-half layout: nothing permuted.
- Experts become one 3-D tensor per projection, ``blk.N.ffn_{gate,up,down}_exps.weight``, expert
  by expert (numpy shape ``(n_expert, rows, cols)``), from per-expert tensors or from the fused
  ``experts.gate_up_proj`` / ``experts.down_proj`` layout of newer transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from colibri.convert.checkpoint_config import Config, ConvertError

T = gguf.MODEL_TENSOR
K = gguf.Keys
V = gguf.GGUFValueType

# Hugging Face ``architectures[0]`` -> GGUF architecture. llama.cpp writes Mixtral as "llama" with
# expert tensors; it has no "mixtral" architecture of its own.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Glm4MoeForCausalLM": "glm4moe",
}
# The config keys that give the number of routed experts, by model family and transformers version.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# Checkpoint tensors that carry nothing a GGUF model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
GLM_DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's default, also llama.cpp's converter's


@dataclass(frozen=True)
class Source:
    """A piece of an output tensor: a checkpoint tensor, or part of one."""

    name: str
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    expert: int | None = None  # index into the first axis of a 3-D (fused experts) tensor
    rows: tuple[int, int] | None = None  # row range taken (gate or up half of gate_up_proj)
    permute_heads: int | None = None  # llama.cpp's rope row permutation over this many heads

    def row_order(self, n_rows: int) -> np.ndarray | None:
        """Source row of each output row, or None when rows are taken in order."""
        if self.permute_heads is None:
            return None
        return llama_rope_order(n_rows, self.permute_heads)


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: its name, numpy-order shape and sources (one per expert when stacked)."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[Source, ...]
    quantizable: bool = True  # False: stays F32 whatever --type says (norms, biases, routers)

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

    def add(self, gguf_name: str, shape: tuple[int, ...], *sources: Source, quantizable: bool = True) -> None:
        self.plan.tensors.append(TensorPlan(gguf_name, shape, tuple(sources), quantizable))

    def matrix(self, kind: T, bid: int | None, hf_name: str, rows: int, cols: int, **kw: Any) -> None:
        self.add(tensor_name(kind, bid, "weight"), (rows, cols), self.source(hf_name, (rows, cols), **kw))

    def vector(self, kind: T, bid: int | None, hf_name: str, n: int, suffix: str = "weight",
               src_shape: tuple[int, ...] | None = None, **kw: Any) -> None:
        src = self.source(hf_name, src_shape or (n,), **kw)
        self.add(tensor_name(kind, bid, suffix), (n,), src, quantizable=False)

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


def common_metadata(plan: Plan, cfg: Config, d: Dims, n_blocks: int, rope_dim: int) -> None:
    plan.kv(K.LLM.VOCAB_SIZE, d.n_vocab, V.UINT32)
    plan.kv(K.LLM.CONTEXT_LENGTH, cfg.int("max_position_embeddings"), V.UINT32)
    plan.kv(K.LLM.EMBEDDING_LENGTH, d.n_embd, V.UINT32)
    plan.kv(K.LLM.FEED_FORWARD_LENGTH, d.n_ff, V.UINT32)
    plan.kv(K.LLM.BLOCK_COUNT, n_blocks, V.UINT32)
    plan.kv(K.Attention.HEAD_COUNT, d.n_head, V.UINT32)
    plan.kv(K.Attention.HEAD_COUNT_KV, d.n_head_kv, V.UINT32)
    plan.kv(K.Attention.KEY_LENGTH, d.head_dim, V.UINT32)
    plan.kv(K.Attention.VALUE_LENGTH, d.head_dim, V.UINT32)
    plan.kv(K.Attention.LAYERNORM_RMS_EPS, float(cfg.need("rms_norm_eps")), V.FLOAT32)
    plan.kv(K.Rope.FREQ_BASE, cfg.rope_theta(), V.FLOAT32)
    plan.kv(K.Rope.DIMENSION_COUNT, rope_dim, V.UINT32)
    rope_type = cfg.rope_type()
    if rope_type in ("linear", "yarn"):
        plan.kv(K.Rope.SCALING_TYPE, rope_type, V.STRING)
        plan.kv(K.Rope.SCALING_FACTOR, cfg.rope_number("factor"), V.FLOAT32)
    if rope_type == "yarn" and cfg.rope.get("original_max_position_embeddings") is not None:
        # Absent, transformers and llama.cpp both take the context length as the original one.
        orig = int(cfg.rope_number("original_max_position_embeddings"))
        plan.kv(K.Rope.SCALING_ORIG_CTX_LEN, orig, V.UINT32)
    elif rope_type not in ("default", "linear", "yarn"):
        raise ConvertError(f"config.json: rope scaling {rope_type!r} is not supported "
                           "(default, linear, yarn)")


def moe_metadata(plan: Plan, n_expert: int, n_used: int, gating: gguf.ExpertGatingFuncType,
                 norm: bool) -> None:
    if not 0 < n_used <= n_expert:
        raise ConvertError(f"config.json: {n_used} experts per token out of {n_expert}")
    plan.kv(K.LLM.EXPERT_COUNT, n_expert, V.UINT32)
    plan.kv(K.LLM.EXPERT_USED_COUNT, n_used, V.UINT32)
    plan.kv(K.LLM.EXPERT_GATING_FUNC, int(gating), V.UINT32)
    plan.kv(K.LLM.EXPERT_WEIGHTS_NORM, bool(norm), V.BOOL)


def embeddings(b: Builder, cfg: Config, d: Dims) -> None:
    """Embedding, final norm, output head. Tied (``tie_word_embeddings``), the head is the
    embedding, as transformers ties it: no ``output.weight``, a saved ``lm_head.weight`` is not
    read, and a checkpoint with only ``lm_head.weight`` gives the embedding from it."""
    tied = cfg.get("tie_word_embeddings", False)
    if tied not in (True, False):
        raise ConvertError(f"config.json: tie_word_embeddings is {tied!r}, not true or false")
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    reverse = tied and not b.has(embed) and b.has(head)
    b.matrix(T.TOKEN_EMBD, None, head if reverse else embed, d.n_vocab, d.n_embd)
    b.vector(T.OUTPUT_NORM, None, "model.norm.weight", d.n_embd)
    if tied:
        b.skip(head)
    elif not b.has(head):
        raise ConvertError(f"missing tensor {head!r}: config.json says tie_word_embeddings is false, so "
                           "the output layer is its own matrix (if it is the embedding, the config "
                           "should say tie_word_embeddings: true)")
    else:
        b.matrix(T.OUTPUT, None, head, d.n_vocab, d.n_embd)


def attention(b: Builder, i: int, d: Dims, *, permute: bool, qk_norm: bool, post_norm: T) -> None:
    """Attention block of layer ``i`` and the norm before its feed-forward part."""
    p = f"model.layers.{i}"
    q_rows, kv_rows = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    b.vector(T.ATTN_NORM, i, f"{p}.input_layernorm.weight", d.n_embd)
    for kind, proj, rows, heads in ((T.ATTN_Q, "q_proj", q_rows, d.n_head), (T.ATTN_K, "k_proj", kv_rows,
                                    d.n_head_kv), (T.ATTN_V, "v_proj", kv_rows, None)):
        perm = heads if permute else None
        b.matrix(kind, i, f"{p}.self_attn.{proj}.weight", rows, d.n_embd, permute_heads=perm)
        if b.has(f"{p}.self_attn.{proj}.bias"):
            b.vector(kind, i, f"{p}.self_attn.{proj}.bias", rows, suffix="bias", permute_heads=perm)
    b.matrix(T.ATTN_OUT, i, f"{p}.self_attn.o_proj.weight", d.n_embd, q_rows)
    if qk_norm:
        b.vector(T.ATTN_Q_NORM, i, f"{p}.self_attn.q_norm.weight", d.head_dim)
        b.vector(T.ATTN_K_NORM, i, f"{p}.self_attn.k_norm.weight", d.head_dim)
    b.vector(post_norm, i, f"{p}.post_attention_layernorm.weight", d.n_embd)


def dense_ffn(b: Builder, i: int, prefix: str, n_embd: int, n_ff: int,
              kinds: tuple[T, T, T] = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)) -> None:
    gate, up, down = kinds
    b.matrix(gate, i, f"{prefix}.gate_proj.weight", n_ff, n_embd)
    b.matrix(up, i, f"{prefix}.up_proj.weight", n_ff, n_embd)
    b.matrix(down, i, f"{prefix}.down_proj.weight", n_embd, n_ff)


def experts(b: Builder, i: int, n_expert: int, n_embd: int, n_ff: int, per_expert: str,
            proj_names: tuple[str, str, str]) -> None:
    """The three stacked expert tensors of layer ``i``, from per-expert tensors named
    ``per_expert.format(e=..., proj=...)`` or the fused layout ``mlp.experts.gate_up_proj``."""
    fused_gate_up = f"model.layers.{i}.mlp.experts.gate_up_proj"
    fused_down = f"model.layers.{i}.mlp.experts.down_proj"
    out = {T.FFN_GATE_EXP: (n_ff, n_embd), T.FFN_UP_EXP: (n_ff, n_embd), T.FFN_DOWN_EXP: (n_embd, n_ff)}
    if b.has(fused_gate_up) and not b.has(per_expert.format(e=0, proj=proj_names[0])):
        for kind, rows in ((T.FFN_GATE_EXP, (0, n_ff)), (T.FFN_UP_EXP, (n_ff, 2 * n_ff))):
            srcs = [b.source(fused_gate_up, (n_expert, 2 * n_ff, n_embd), expert=e, rows=rows)
                    for e in range(n_expert)]
            b.add(tensor_name(kind, i, "weight"), (n_expert, *out[kind]), *srcs)
        srcs = [b.source(fused_down, (n_expert, n_embd, n_ff), expert=e) for e in range(n_expert)]
        b.add(tensor_name(T.FFN_DOWN_EXP, i, "weight"), (n_expert, n_embd, n_ff), *srcs)
        return
    for kind, proj in zip((T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP), proj_names, strict=True):
        srcs = [b.source(per_expert.format(e=e, proj=proj), out[kind]) for e in range(n_expert)]
        b.add(tensor_name(kind, i, "weight"), (n_expert, *out[kind]), *srcs)


def first_present(b: Builder, *names: str) -> str:
    """The first of ``names`` the checkpoint has (or the first, for the missing-tensor error)."""
    return next((n for n in names if b.has(n)), names[0])


def plan_llama(b: Builder, cfg: Config, d: Dims) -> None:
    """Llama, and Mixtral (llama with experts): NORM rope, so q/k rows permuted."""
    plan = b.plan
    common_metadata(plan, cfg, d, d.n_layer, d.head_dim)
    n_expert = cfg.first_int(*EXPERT_COUNT_KEYS, default=0)
    if n_expert:
        moe_metadata(plan, n_expert, cfg.int("num_experts_per_tok"), gguf.ExpertGatingFuncType.SOFTMAX, True)
    embeddings(b, cfg, d)
    for i in range(d.n_layer):
        attention(b, i, d, permute=True, qk_norm=False, post_norm=T.FFN_NORM)
        if not n_expert:
            dense_ffn(b, i, f"model.layers.{i}.mlp", d.n_embd, d.n_ff)
            continue
        legacy = f"model.layers.{i}.block_sparse_moe"
        name = first_present(b, f"{legacy}.gate.weight", f"model.layers.{i}.mlp.gate.weight")
        router(b, i, n_expert, d.n_embd, name)
        experts(b, i, n_expert, d.n_embd, d.n_ff, legacy + ".experts.{e}.{proj}.weight", ("w1", "w3", "w2"))


def router(b: Builder, i: int, n_expert: int, n_embd: int, name: str | None = None) -> None:
    """The router stays F32, as llama.cpp keeps it: its logits pick the experts."""
    src = b.source(name or f"model.layers.{i}.mlp.gate.weight", (n_expert, n_embd))
    b.add(tensor_name(T.FFN_GATE_INP, i, "weight"), (n_expert, n_embd), src, quantizable=False)


def check_all_sparse(cfg: Config) -> None:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ConvertError("config.json: layers without experts (mlp_only_layers, decoder_sparse_step) "
                           "are not supported (llama.cpp has none for this architecture)")


def plan_qwen_moe(b: Builder, cfg: Config, d: Dims) -> None:
    """Qwen2-MoE (softmax top-k, optionally renormalised, plus a sigmoid-gated shared expert,
    q/k/v biases) and Qwen3-MoE (q/k norms, no shared expert). NEOX rope: nothing permuted."""
    plan, qwen3 = b.plan, b.plan.arch == "qwen3moe"
    check_all_sparse(cfg)
    n_expert, n_ff_exp = cfg.first_int(*EXPERT_COUNT_KEYS), cfg.int("moe_intermediate_size")
    common_metadata(plan, cfg, d, d.n_layer, d.head_dim)
    moe_metadata(plan, n_expert, cfg.int("num_experts_per_tok"), gguf.ExpertGatingFuncType.SOFTMAX,
                 bool(cfg.get("norm_topk_prob", False)))
    plan.kv(K.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff_exp, V.UINT32)
    n_ff_sh = 0 if qwen3 else cfg.int("shared_expert_intermediate_size", 0)
    if n_ff_sh:
        plan.kv(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, n_ff_sh, V.UINT32)
    embeddings(b, cfg, d)
    for i in range(d.n_layer):
        attention(b, i, d, permute=False, qk_norm=qwen3, post_norm=T.FFN_NORM)
        router(b, i, n_expert, d.n_embd)
        experts(b, i, n_expert, d.n_embd, n_ff_exp, f"model.layers.{i}.mlp.experts.{{e}}.{{proj}}.weight",
                ("gate_proj", "up_proj", "down_proj"))
        if n_ff_sh:
            dense_ffn(b, i, f"model.layers.{i}.mlp.shared_expert", d.n_embd, n_ff_sh,
                      (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP))
            # (1, n_embd) in the checkpoint: llama.cpp takes it as the vector it is.
            b.vector(T.FFN_GATE_INP_SHEXP, i, f"model.layers.{i}.mlp.shared_expert_gate.weight", d.n_embd,
                     src_shape=(1, d.n_embd))


def plan_glm4moe(b: Builder, cfg: Config, d: Dims) -> None:
    """GLM-4.5: sigmoid scores plus a correction bias that only steers the choice, grouped top-k,
    renormalised weights times a routed scaling factor, shared experts, leading dense layers,
    NEOX rope over part of each head, q/k/v biases, optional q/k norm, optional NextN layers."""
    plan = b.plan
    n_expert, n_ff_exp = cfg.first_int(*EXPERT_COUNT_KEYS), cfg.int("moe_intermediate_size")
    n_shared, n_dense = cfg.int("n_shared_experts", 0), cfg.int("first_k_dense_replace", 0)
    n_group, n_group_used = cfg.int("n_group", 1), cfg.int("topk_group", 1)
    n_nextn = saved_nextn_layers(b, cfg, d.n_layer)
    if n_group == 0 or n_expert % n_group or not 0 < n_group_used <= n_group:
        raise ConvertError(f"config.json: {n_expert} experts in {n_group} groups, {n_group_used} used")
    rope_dim = int(d.head_dim * cfg.partial_rotary_factor(GLM_DEFAULT_PARTIAL_ROTARY))
    if rope_dim % 2:
        raise ConvertError(f"config.json: rotary dimension {rope_dim} is not even")
    n_blocks = d.n_layer + n_nextn  # llama.cpp counts the NextN (multi-token prediction) layers too
    common_metadata(plan, cfg, d, n_blocks, rope_dim)
    moe_metadata(plan, n_expert, cfg.int("num_experts_per_tok"), gguf.ExpertGatingFuncType.SIGMOID,
                 bool(cfg.get("norm_topk_prob", True)))
    plan.kv(K.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff_exp, V.UINT32)
    plan.kv(K.LLM.EXPERT_SHARED_COUNT, n_shared, V.UINT32)
    plan.kv(K.LLM.LEADING_DENSE_BLOCK_COUNT, n_dense, V.UINT32)
    plan.kv(K.LLM.EXPERT_WEIGHTS_SCALE, float(cfg.get("routed_scaling_factor", 1.0)), V.FLOAT32)
    plan.kv(K.LLM.EXPERT_GROUP_COUNT, n_group, V.UINT32)
    plan.kv(K.LLM.EXPERT_GROUP_USED_COUNT, n_group_used, V.UINT32)
    plan.kv(K.LLM.NEXTN_PREDICT_LAYERS, n_nextn, V.UINT32)
    embeddings(b, cfg, d)
    qk_norm = bool(cfg.get("use_qk_norm", False))
    for i in range(n_blocks):
        p = f"model.layers.{i}"
        attention(b, i, d, permute=False, qk_norm=qk_norm, post_norm=T.ATTN_POST_NORM)
        if i < n_dense:
            dense_ffn(b, i, f"{p}.mlp", d.n_embd, d.n_ff)
            continue
        router(b, i, n_expert, d.n_embd)
        b.vector(T.FFN_EXP_PROBS_B, i, f"{p}.mlp.gate.e_score_correction_bias", n_expert, suffix="bias")
        experts(b, i, n_expert, d.n_embd, n_ff_exp, p + ".mlp.experts.{e}.{proj}.weight",
                ("gate_proj", "up_proj", "down_proj"))
        if n_shared:
            dense_ffn(b, i, f"{p}.mlp.shared_experts", d.n_embd, n_ff_exp * n_shared,
                      (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP))
        if i >= d.n_layer:
            nextn(b, i, d)


def saved_nextn_layers(b: Builder, cfg: Config, n_layer: int) -> int:
    """The NextN layers to convert: as many as config.json says, or none, with a warning, when the
    checkpoint holds none of them (transformers does not build them: a model it saved has none)."""
    key = cfg.first_key("num_nextn_predict_layers", "num_mtp_layers")
    n = cfg.int(key, 0)
    if n == 0 or any(b.has_prefix(f"model.layers.{i}.") for i in range(n_layer, n_layer + n)):
        return n  # some present: all must be, as today (a missing one is a missing-tensor error)
    b.plan.warnings.append(
        f"config.json: {key} is {n}, but the checkpoint holds no NextN (multi-token prediction) layer "
        f"(model.layers.{n_layer}.*, which transformers does not save): converted without it "
        f"(nextn_predict_layers 0, block_count {n_layer})")
    return 0


def nextn(b: Builder, i: int, d: Dims) -> None:
    """A NextN (multi-token prediction) layer's own tensors; llama.cpp loads and skips them."""
    p = f"model.layers.{i}"
    b.matrix(T.NEXTN_EH_PROJ, i, f"{p}.eh_proj.weight", d.n_embd, 2 * d.n_embd)
    b.vector(T.NEXTN_ENORM, i, f"{p}.enorm.weight", d.n_embd)
    b.vector(T.NEXTN_HNORM, i, f"{p}.hnorm.weight", d.n_embd)
    if b.has(f"{p}.shared_head.norm.weight"):
        b.vector(T.NEXTN_SHARED_HEAD_NORM, i, f"{p}.shared_head.norm.weight", d.n_embd)
    if b.has(f"{p}.embed_tokens.weight"):
        b.matrix(T.NEXTN_EMBED_TOKENS, i, f"{p}.embed_tokens.weight", d.n_vocab, d.n_embd)
    if b.has(f"{p}.shared_head.head.weight"):
        b.matrix(T.NEXTN_SHARED_HEAD_HEAD, i, f"{p}.shared_head.head.weight", d.n_vocab, d.n_embd)


PLANNERS = {"llama": plan_llama, "qwen2moe": plan_qwen_moe, "qwen3moe": plan_qwen_moe,
            "glm4moe": plan_glm4moe}


def make_plan(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """The conversion plan for a checkpoint with ``config`` and tensors of ``shapes``."""
    archs = config.get("architectures") or []
    hf_arch = archs[0] if isinstance(archs, list) and archs else None
    if hf_arch not in ARCHITECTURES:
        raise ConvertError(f"unsupported architecture {hf_arch!r} (supported: {', '.join(ARCHITECTURES)})")
    cfg = Config(config)
    cfg.check_not_quantized()
    plan = Plan(ARCHITECTURES[hf_arch], hf_arch)
    d = Dims.read(cfg)
    plan.n_vocab = d.n_vocab
    b = Builder(plan, shapes)
    PLANNERS[plan.arch](b, cfg, d)
    extra = b.leftovers()
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ConvertError(f"unexpected tensor {extra[0]!r}{more} (not part of a {hf_arch} model)")
    for t in plan.tensors:
        if math.prod(t.shape) == 0:
            raise ConvertError(f"tensor {t.name} would be empty ({list(t.shape)})")
    return plan
