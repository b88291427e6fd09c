"""The plans of the mixture-of-experts architectures: qwen2moe, qwen3moe, glm4moe, olmoe (and the
experts of mixtral, which llama.cpp writes as ``llama``).

Experts become one 3-D tensor per projection, ``blk.N.ffn_{gate,up,down}_exps.weight``, expert by
expert (numpy shape ``(n_expert, rows, cols)``), from per-expert tensors or from the fused
``experts.gate_up_proj`` / ``experts.down_proj`` layout of newer transformers. These use NEOX rope,
which is Hugging Face's rotate-half layout: nothing permuted.
"""

from __future__ import annotations

import gguf

from colibri.convert.checkpoint_config import Config, ConvertError
from colibri.convert.plan import (
    Builder,
    Dims,
    K,
    Plan,
    T,
    V,
    attention,
    common_metadata,
    dense_ffn,
    embeddings,
    tensor_name,
)

# The config keys that give the number of routed experts, by model family and transformers version.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
GLM_DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's default, also llama.cpp's converter's


def moe_metadata(plan: Plan, n_expert: int, n_used: int, gating: gguf.ExpertGatingFuncType | int,
                 norm: bool) -> None:
    """``gating``: llama.cpp's expert_gating_func (gguf-py names 1 and 2; gpt-oss's is 3)."""
    if not 0 < n_used <= n_expert:
        raise ConvertError(f"config.json: {n_used} experts per token out of {n_expert}")
    plan.kv(K.LLM.EXPERT_COUNT, n_expert, V.UINT32)
    plan.kv(K.LLM.EXPERT_USED_COUNT, n_used, V.UINT32)
    plan.kv(K.LLM.EXPERT_GATING_FUNC, int(gating), V.UINT32)
    plan.kv(K.LLM.EXPERT_WEIGHTS_NORM, bool(norm), V.BOOL)


def shared_experts_metadata(plan: Plan, cfg: Config, n_ff_exp: int, n_shared: int, n_dense: int,
                            groups: tuple[int, int]) -> None:
    """What GLM-4.5's and DeepSeek's layouts say beside the routing: the expert width, the shared
    experts, the leading dense layers, the routed scaling factor, the groups (count, used)."""
    plan.kv(K.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff_exp, V.UINT32)
    plan.kv(K.LLM.EXPERT_SHARED_COUNT, n_shared, V.UINT32)
    plan.kv(K.LLM.LEADING_DENSE_BLOCK_COUNT, n_dense, V.UINT32)
    plan.kv(K.LLM.EXPERT_WEIGHTS_SCALE, float(cfg.get("routed_scaling_factor", 1.0)), V.FLOAT32)
    plan.kv(K.LLM.EXPERT_GROUP_COUNT, groups[0], V.UINT32)
    plan.kv(K.LLM.EXPERT_GROUP_USED_COUNT, groups[1], V.UINT32)


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


def plan_olmoe(b: Builder, cfg: Config, d: Dims) -> None:
    """OLMoE: softmax top-k (renormalised only where ``norm_topk_prob`` says), no shared expert,
    q and k each normalised over its whole width (the norms are as wide as q and k, not a head).
    NEOX rope: nothing permuted. OLMo's ``clip_qkv`` (clamping q, k, v) is refused: llama.cpp's
    olmoe has none, and OLMoE-1B-7B sets none."""
    plan = b.plan
    if cfg.get("clip_qkv") is not None:
        raise ConvertError(f"config.json: clip_qkv {cfg.get('clip_qkv')!r} is not supported (llama.cpp's "
                           "olmoe does not clamp q, k and v)")
    n_expert = cfg.first_int(*EXPERT_COUNT_KEYS)
    common_metadata(plan, cfg, d, d.n_layer, d.head_dim)
    moe_metadata(plan, n_expert, cfg.int("num_experts_per_tok"), gguf.ExpertGatingFuncType.SOFTMAX,
                 bool(cfg.get("norm_topk_prob", False)))
    embeddings(b, cfg, d)
    for i in range(d.n_layer):
        p = f"model.layers.{i}"
        attention(b, i, d, permute=False, qk_norm=False, post_norm=T.FFN_NORM)
        b.vector(T.ATTN_Q_NORM, i, f"{p}.self_attn.q_norm.weight", d.n_head * d.head_dim)
        b.vector(T.ATTN_K_NORM, i, f"{p}.self_attn.k_norm.weight", d.n_head_kv * d.head_dim)
        router(b, i, n_expert, d.n_embd)
        experts(b, i, n_expert, d.n_embd, d.n_ff, p + ".mlp.experts.{e}.{proj}.weight",
                ("gate_proj", "up_proj", "down_proj"))


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
    shared_experts_metadata(plan, cfg, n_ff_exp, n_shared, n_dense, (n_group, n_group_used))
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

