"""The plan of DeepSeek's layouts, GGUF ``deepseek2``: DeepSeek-V2 and V2-Lite, V3 (and the models
built on them: Moonlight, Kimi), from transformers' ``DeepseekV2ForCausalLM`` and
``DeepseekV3ForCausalLM``.

Attention is multi-head latent attention (MLA), written as llama.cpp's converter writes it for its
absorbed form: q from the hidden state (``attn_q``) or through a low rank (``attn_q_a``, its norm,
``attn_q_b``); ``attn_kv_a_mqa`` gives each token's latent (``kv_lora_rank`` values, normed by
``attn_kv_a_norm``) and one rope key shared by the heads; ``kv_b_proj`` is split per head into
``attn_k_b`` (its key rows, transposed: [head, kv_lora_rank, qk_nope]) and ``attn_v_b`` (its value
rows: [head, v_head_dim, kv_lora_rank]). The metadata calls it one kv head whose key is the latent
and the rope key (``key_length`` kv_lora_rank + rope) and whose value is the latent
(``value_length`` kv_lora_rank); ``key_length_mla`` and ``value_length_mla`` are a query head's.
RoPE pairs adjacent dimensions (ggml's "normal" rope), on Hugging Face's own layout: nothing
permuted.

The experts: softmax (V2) or sigmoid plus a correction bias that only steers the choice (V3),
grouped top-k (V3's groups ranked by their two best scores), optionally renormalised, times the
routed scaling factor; shared experts, ungated; the first ``first_k_dense_replace`` layers dense.
"""

from __future__ import annotations

import gguf

from colibri.convert.checkpoint_config import Config, ConvertError
from colibri.convert.moe import EXPERT_COUNT_KEYS, experts, moe_metadata, router, shared_experts_metadata
from colibri.convert.plan import Builder, Dims, K, T, V, common_metadata, dense_ffn, embeddings, tensor_name

# What transformers' classes assume where a checkpoint's config.json does not say (the models'
# own config.json files do): V2's softmax scores, V3's sigmoid ones.
DEFAULT_SCORING = {"DeepseekV2ForCausalLM": "softmax", "DeepseekV3ForCausalLM": "sigmoid"}
SCORING = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}
# The top-k methods whose choice the GGUF's metadata can say: plain top-k, and V3's groups ranked
# by the sum of their two best scores (llama.cpp's only grouping). V2's "group_limited_greedy"
# ranks a group by its best score alone: a file cannot tell it apart, so it is refused.
TOPK_METHODS = ("greedy", "noaux_tc")


def plan_deepseek2(b: Builder, cfg: Config, d: Dims) -> None:
    plan = b.plan
    q_lora, kv_lora = cfg.int("q_lora_rank", 0) or 0, cfg.int("kv_lora_rank")
    nope, rope, v_dim = cfg.int("qk_nope_head_dim"), cfg.int("qk_rope_head_dim"), cfg.int("v_head_dim")
    n_expert, n_ff_exp = cfg.first_int(*EXPERT_COUNT_KEYS), cfg.int("moe_intermediate_size")
    n_shared, n_dense = cfg.int("n_shared_experts", 0), cfg.int("first_k_dense_replace", 0)
    n_group, n_group_used = cfg.int("n_group", 1) or 1, cfg.int("topk_group", 1) or 1
    scoring = cfg.get("scoring_func") or DEFAULT_SCORING[plan.hf_arch]
    method = cfg.get("topk_method") or ("noaux_tc" if scoring == "sigmoid" else "greedy")
    if scoring not in SCORING:
        raise ConvertError(f"config.json: scoring_func {scoring!r} is not supported ({', '.join(SCORING)})")
    if method not in TOPK_METHODS and n_group > 1:
        raise ConvertError(f"config.json: topk_method {method!r} over {n_group} groups is not supported: "
                           "a GGUF file can say only groups ranked by their two best scores (noaux_tc)")
    if n_expert % n_group or n_group_used > n_group:
        raise ConvertError(f"config.json: {n_expert} experts in {n_group} groups, {n_group_used} used")
    if rope % 2:
        raise ConvertError(f"config.json: qk_rope_head_dim {rope} is not even")
    skip_nextn(b, cfg, d.n_layer)
    common_metadata(plan, cfg, d, d.n_layer, rope, kv=(1, kv_lora + rope, kv_lora))
    # 0 where q comes straight from the hidden state: llama.cpp otherwise guesses it from the depth
    plan.kv(K.Attention.Q_LORA_RANK, q_lora, V.UINT32)
    plan.kv(K.Attention.KV_LORA_RANK, kv_lora, V.UINT32)
    plan.kv(K.Attention.KEY_LENGTH_MLA, nope + rope, V.UINT32)
    plan.kv(K.Attention.VALUE_LENGTH_MLA, v_dim, V.UINT32)
    mscale_all = cfg.rope.get("mscale_all_dim")
    if mscale_all is not None:  # llama.cpp's converter writes it so, and divides it back at load
        plan.kv(K.Rope.SCALING_YARN_LOG_MUL, 0.1 * float(mscale_all), V.FLOAT32)
    moe_metadata(plan, n_expert, cfg.int("num_experts_per_tok"), SCORING[scoring],
                 bool(cfg.get("norm_topk_prob", False)))
    shared_experts_metadata(plan, cfg, n_ff_exp, n_shared, n_dense, (n_group, n_group_used))
    embeddings(b, cfg, d)
    for i in range(d.n_layer):
        p = f"model.layers.{i}"
        latent_attention(b, i, d, q_lora, kv_lora, nope, rope, v_dim)
        if i < n_dense:
            dense_ffn(b, i, f"{p}.mlp", d.n_embd, d.n_ff)
            continue
        router(b, i, n_expert, d.n_embd)
        if b.has(f"{p}.mlp.gate.e_score_correction_bias"):
            b.vector(T.FFN_EXP_PROBS_B, i, f"{p}.mlp.gate.e_score_correction_bias", n_expert, suffix="bias")
        experts(b, i, n_expert, d.n_embd, n_ff_exp, p + ".mlp.experts.{e}.{proj}.weight",
                ("gate_proj", "up_proj", "down_proj"))
        if n_shared:
            dense_ffn(b, i, f"{p}.mlp.shared_experts", d.n_embd, n_ff_exp * n_shared,
                      (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP))
        else:  # transformers builds them 0 wide: nothing to convert
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"{p}.mlp.shared_experts.{proj}.weight"
                if b.has(name) and 0 in b.shapes[name]:
                    b.skip(name)


def latent_attention(b: Builder, i: int, d: Dims, q_lora: int, kv_lora: int, nope: int, rope: int,
                     v_dim: int) -> None:
    """Layer i's MLA tensors and the norm after them; ``kv_b_proj`` split per head."""
    p, n_embd, n_head = f"model.layers.{i}", d.n_embd, d.n_head
    b.vector(T.ATTN_NORM, i, f"{p}.input_layernorm.weight", n_embd)
    q_rows = n_head * (nope + rope)
    if q_lora:
        b.matrix(T.ATTN_Q_A, i, f"{p}.self_attn.q_a_proj.weight", q_lora, n_embd)
        b.vector(T.ATTN_Q_A_NORM, i, f"{p}.self_attn.q_a_layernorm.weight", q_lora)
        b.matrix(T.ATTN_Q_B, i, f"{p}.self_attn.q_b_proj.weight", q_rows, q_lora)
    else:
        b.matrix(T.ATTN_Q, i, f"{p}.self_attn.q_proj.weight", q_rows, n_embd)
    b.matrix(T.ATTN_KV_A_MQA, i, f"{p}.self_attn.kv_a_proj_with_mqa.weight", kv_lora + rope, n_embd)
    b.vector(T.ATTN_KV_A_NORM, i, f"{p}.self_attn.kv_a_layernorm.weight", kv_lora)
    kv_b, per_head = f"{p}.self_attn.kv_b_proj.weight", nope + v_dim
    shape = (n_head * per_head, kv_lora)  # per head: its nope key rows, then its value rows
    keys = [b.source(kv_b, shape, rows=(h * per_head, h * per_head + nope), transposed=True)
            for h in range(n_head)]
    b.add(tensor_name(T.ATTN_K_B, i, "weight"), (n_head, kv_lora, nope), *keys)
    values = [b.source(kv_b, shape, rows=(h * per_head + nope, (h + 1) * per_head)) for h in range(n_head)]
    b.add(tensor_name(T.ATTN_V_B, i, "weight"), (n_head, v_dim, kv_lora), *values)
    b.matrix(T.ATTN_OUT, i, f"{p}.self_attn.o_proj.weight", n_embd, n_head * v_dim)
    b.vector(T.FFN_NORM, i, f"{p}.post_attention_layernorm.weight", n_embd)


def skip_nextn(b: Builder, cfg: Config, n_layer: int) -> None:
    """The next-token-prediction layers a checkpoint may hold (``model.layers.{n_layer}...``): not
    converted, as llama.cpp's converter leaves them (colibri drafts with GLM-4.5's, not these)."""
    n = cfg.int("num_nextn_predict_layers", 0)
    held = [name for name in b.shapes if any(name.startswith(f"model.layers.{i}.")
                                             for i in range(n_layer, n_layer + n))]
    for name in held:
        b.skip(name)
    if held:
        b.plan.warnings.append(f"the checkpoint's {n} next-token-prediction layer(s) "
                               f"(model.layers.{n_layer}.*) are not converted")
