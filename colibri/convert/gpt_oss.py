"""The plan of OpenAI's gpt-oss (``GptOssForCausalLM`` -> ``gpt-oss``), as llama.cpp's converter
writes it from a float checkpoint (one transformers saves).

The experts are fused in the checkpoint: ``mlp.experts.gate_up_proj`` is ``[expert, n_embd, 2 n_ff]``
with gate and up *interleaved* by column (gate the even ones, up the odd), ``down_proj``
``[expert, n_ff, n_embd]``: both transposed from GGUF's rows, each expert's block read whole
(``Source.transposed``, ``Source.columns``). Their biases, the router's, the attention output's and
the sinks (``self_attn.sinks``, a logit per head) are kept F32. The released checkpoints' experts
are MXFP4 blocks (``*_blocks``/``*_scales``, ``quant_method: mxfp4``): they go into the file as they
are, GGUF's MXFP4, whatever ``--type`` says of the other matrices.
"""

from __future__ import annotations

from colibri.convert.checkpoint_config import Config, ConvertError
from colibri.convert.moe import EXPERT_COUNT_KEYS, moe_metadata, router
from colibri.convert.plan import Builder, Dims, K, T, V, attention, common_metadata, embeddings, tensor_name
from colibri.store.formats import GGMLType

# The clamped SwiGLU llama.cpp computes (``swiglu_oai``): no GGUF key can say other values.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
SLIDING, FULL = "sliding_attention", "full_attention"
GATING_SOFTMAX_WEIGHT = 3  # llama.cpp's expert_gating_func: the softmax of the chosen (gguf-py names no 3)


def plan_gpt_oss(b: Builder, cfg: Config, d: Dims) -> None:
    """gpt-oss: biased attention with sinks, alternating sliding-window layers, YaRN; the k best
    of a biased router weighted by their softmax; experts with biases and a clamped SwiGLU."""
    plan = b.plan
    alpha, limit = float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)), float(cfg.get("swiglu_limit", SWIGLU_LIMIT))
    if (alpha, limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
        raise ConvertError(f"config.json: swiglu_alpha {alpha} and swiglu_limit {limit} are not gpt-oss's "
                           f"({SWIGLU_ALPHA}, {SWIGLU_LIMIT}), the only ones llama.cpp computes")
    n_expert = cfg.first_int(*EXPERT_COUNT_KEYS)
    common_metadata(plan, cfg, d, d.n_layer, d.head_dim)
    if cfg.rope_type() == "yarn" and cfg.rope.get("truncate") is not None:
        plan.kv(f"{plan.arch}.rope.scaling.yarn_truncate", bool(cfg.rope["truncate"]), V.BOOL)
    moe_metadata(plan, n_expert, cfg.int("num_experts_per_tok"), GATING_SOFTMAX_WEIGHT, False)
    plan.kv(K.LLM.EXPERT_FEED_FORWARD_LENGTH, d.n_ff, V.UINT32)
    plan.kv(K.Attention.SLIDING_WINDOW, cfg.int("sliding_window"), V.UINT32)
    sliding_pattern(plan, cfg, d.n_layer)
    embeddings(b, cfg, d)
    for i in range(d.n_layer):
        p = f"model.layers.{i}"
        attention(b, i, d, permute=False, qk_norm=False, post_norm=T.ATTN_POST_NORM)
        b.vector(T.ATTN_OUT, i, f"{p}.self_attn.o_proj.bias", d.n_embd, suffix="bias")
        b.vector(T.ATTN_SINKS, i, f"{p}.self_attn.sinks", d.n_head)
        router(b, i, n_expert, d.n_embd, name=f"{p}.mlp.router.weight")
        b.vector(T.FFN_GATE_INP, i, f"{p}.mlp.router.bias", n_expert, suffix="bias")
        experts(b, i, n_expert, d.n_embd, d.n_ff)


def experts(b: Builder, i: int, n_expert: int, n_embd: int, n_ff: int) -> None:
    """The three expert tensors and their biases from the fused, interleaved layout: float, or the
    release's MXFP4 blocks (``mxfp4_experts``)."""
    p = f"model.layers.{i}.mlp.experts"
    gate_up_bias = (n_expert, 2 * n_ff)
    for kind, first in ((T.FFN_GATE_EXP, 0), (T.FFN_UP_EXP, 1)):
        if b.has(f"{p}.gate_up_proj_blocks"):
            mxfp4_experts(b, f"{p}.gate_up_proj", tensor_name(kind, i, "weight"), n_expert, (n_ff, n_embd),
                          (first, 2))
        else:
            srcs = [b.source(f"{p}.gate_up_proj", (n_expert, n_embd, 2 * n_ff), expert=e, transposed=True,
                             columns=(first, 2)) for e in range(n_expert)]
            b.add(tensor_name(kind, i, "weight"), (n_expert, n_ff, n_embd), *srcs)
        b.add(tensor_name(kind, i, "bias"), (n_expert, n_ff),
              b.source(f"{p}.gate_up_proj_bias", gate_up_bias, columns=(first, 2)), quantizable=False)
    if b.has(f"{p}.down_proj_blocks"):
        mxfp4_experts(b, f"{p}.down_proj", tensor_name(T.FFN_DOWN_EXP, i, "weight"), n_expert, (n_embd, n_ff))
    else:
        srcs = [b.source(f"{p}.down_proj", (n_expert, n_ff, n_embd), expert=e, transposed=True)
                for e in range(n_expert)]
        b.add(tensor_name(T.FFN_DOWN_EXP, i, "weight"), (n_expert, n_embd, n_ff), *srcs)
    b.add(tensor_name(T.FFN_DOWN_EXP, i, "bias"), (n_expert, n_embd),
          b.source(f"{p}.down_proj_bias", (n_expert, n_embd)), quantizable=False)


def mxfp4_experts(b: Builder, name: str, out: str, n_expert: int, shape: tuple[int, int],
                  columns: tuple[int, int] | None = None) -> None:
    """A released checkpoint's MXFP4 experts (``{name}_blocks`` [expert, rows, blocks, 16] and
    ``{name}_scales`` [expert, rows, blocks]: llama.cpp's converter's input) as GGUF's MXFP4 blocks,
    byte for byte (``writer.mxfp4_chunks``); ``shape``: an expert's (rows, row length) out;
    ``columns``: gate's or up's rows of the interleaved gate_up."""
    rows, cols = shape
    stored = rows * (2 if columns else 1)
    b.source(f"{name}_scales", (n_expert, stored, cols // 32))  # (checked and taken)
    srcs = [b.source(f"{name}_blocks", (n_expert, stored, cols // 32, 16), expert=e, columns=columns,
                     scales=f"{name}_scales") for e in range(n_expert)]
    b.add(out, (n_expert, rows, cols), *srcs, gtype=int(GGMLType.MXFP4))


def sliding_pattern(plan: object, cfg: Config, n_layer: int) -> None:
    """The layers' kinds: llama.cpp assumes sliding, full, sliding, ... (period 2); another order
    is written out layer by layer (``attention.sliding_window_pattern``, as gemma3's files have)."""
    types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n_layer)]
    if len(types) != n_layer or not set(types) <= {SLIDING, FULL}:
        raise ConvertError(f"config.json: layer_types {types!r} is not {n_layer} of {SLIDING!r}, {FULL!r}")
    if any((t == SLIDING) != (i % 2 == 0) for i, t in enumerate(types)):
        plan.kv(K.Attention.SLIDING_WINDOW_PATTERN, [t == SLIDING for t in types], V.ARRAY)
