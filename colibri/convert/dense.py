"""The plans of the dense architectures: llama (with Mixtral's experts, see moe.py, and Llama 3's
rope scaling), qwen2, qwen3, gemma3 and phi3, written as llama.cpp's converter writes them.

- llama (rope NORM): the rows of ``q_proj`` and ``k_proj`` are permuted per head from Hugging
  Face's rotate-half layout (pairs ``(i, i + d/2)``) to the interleaved pairs ``(2i, 2i + 1)`` that
  llama.cpp's NORM rope rotates. Llama 3's rope scaling (``rope_type`` llama3) becomes the vector
  ``rope_freqs.weight``: for each rotated pair the number its angle is divided by.
- qwen2 (q/k/v biases) and qwen3 (q/k RMS norms): NEOX rope, which is the rotate-half layout.
- gemma3: Gemma's RMSNorm scales by ``1 + w``, and llama.cpp's file holds ``1 + w`` for every norm
  (q/k norms included). Local (sliding-window) and global layers: the window size and the local
  layers' rope base in the file; which layers are local is llama.cpp's fixed pattern (see
  ``check_gemma3_layers``); a global rope scaling is the file's rope scaling.
- phi3: the fused ``qkv_proj`` and ``gate_up_proj`` stay fused as ``attn_qkv`` and ``ffn_up``
  (gate rows, then up rows); Phi-3.5's and Phi-4-mini's long-context rope (``longrope``) becomes
  the vectors ``rope_factors_long`` and ``rope_factors_short`` and an attention factor.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from colibri.convert.checkpoint_config import GLOBAL_LAYERS, LOCAL_LAYERS, Config, ConvertError
from colibri.convert.moe import EXPERT_COUNT_KEYS, experts, moe_metadata, router
from colibri.convert.plan import (
    ROPE_SCALINGS,
    Builder,
    Dims,
    K,
    T,
    V,
    attention,
    common_metadata,
    dense_ffn,
    embeddings,
    first_present,
)

GEMMA_NORM_SHIFT = 1.0  # Gemma's RMSNorm: x * (1 + w); llama.cpp's file holds 1 + w
# llama.cpp reads no layer pattern from a gemma3 file its converter wrote: with a sliding window,
# layer i is local unless i % 6 == 5 (five local, one global), without one every layer is global.
LLAMA_CPP_GEMMA3_PATTERN = 6
# llama.cpp scales a gemma3 query by 1/sqrt(head_dim), or by 1/sqrt(n_embd / n_head) in a model of
# this many layers (Gemma 3 27B), whatever query_pre_attn_scalar says: the two must agree.
GEMMA3_27B_LAYERS = 62
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"  # llama.cpp's GELU is the tanh approximation


def plan_llama(b: Builder, cfg: Config, d: Dims) -> None:
    """Llama, and Mixtral (llama with experts): NORM rope, so q/k rows permuted."""
    plan = b.plan
    common_metadata(plan, cfg, d, d.n_layer, d.head_dim, (*ROPE_SCALINGS, "llama3"))
    if cfg.rope_type() == "llama3":
        b.computed(T.ROPE_FREQS, llama3_rope_factors(cfg, d.head_dim))
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


def llama3_rope_factors(cfg: Config, head_dim: int) -> np.ndarray:
    """Llama 3's rope scaling as the divisor of each pair's frequency, in float32 as llama.cpp's
    converter computes it: 1 for wavelengths under original context / high_freq_factor, ``factor``
    over original context / low_freq_factor, and a smooth blend between."""
    f32 = np.float32
    factor, low, high, orig = (f32(cfg.rope_number(k)) for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    if not high > low:
        raise ConvertError(f"config.json: llama3 rope scaling needs high_freq_factor ({high}) above "
                           f"low_freq_factor ({low})")
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    freqs = f32(1) / np.power(f32(cfg.rope_theta()), exponents, dtype=f32)
    wavelen = f32(2 * math.pi) / freqs
    smooth = (orig / wavelen - low) / (high - low)
    blend = f32(1) / ((f32(1) - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, f32(1), np.where(wavelen > orig / low, factor, blend)).astype(f32)


def plan_qwen2(b: Builder, cfg: Config, d: Dims) -> None:
    """Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (q/k norms): NEOX rope, nothing permuted."""
    if cfg.get("use_sliding_window", False):
        b.plan.warnings.append("config.json: use_sliding_window is true, but llama.cpp's qwen2 and qwen3 "
                               "have no sliding window: converted with full attention in every layer")
    common_metadata(b.plan, cfg, d, d.n_layer, d.head_dim)
    embeddings(b, cfg, d)
    for i in range(d.n_layer):
        attention(b, i, d, permute=False, qk_norm=b.plan.arch == "qwen3", post_norm=T.FFN_NORM)
        dense_ffn(b, i, f"model.layers.{i}.mlp", d.n_embd, d.n_ff)


def plan_gemma3(b: Builder, cfg: Config, d: Dims) -> None:
    """Gemma 3 (text): norms before and after attention and the feed-forward part, q/k norms, GeGLU,
    local layers with a sliding window and their own rope base, norms stored as 1 + w."""
    plan = b.plan
    gemma3_checks(cfg, d)
    common_metadata(plan, cfg, d, d.n_layer, d.head_dim, ("default", "linear"))
    windowed = cfg.get("sliding_window_pattern") != 1
    if windowed:
        plan.kv(K.Attention.SLIDING_WINDOW, cfg.int("sliding_window"), V.UINT32)
    if cfg.rope_local.get("rope_theta") is not None:
        plan.kv(K.Rope.FREQ_BASE_SWA, float(cfg.rope_local["rope_theta"]), V.FLOAT32)
    if cfg.get("final_logit_softcapping"):
        plan.kv(K.LLM.FINAL_LOGIT_SOFTCAPPING, float(cfg.get("final_logit_softcapping")), V.FLOAT32)
    check_gemma3_layers(cfg, d.n_layer, windowed)
    plan.add_space_prefix = False  # as llama.cpp's converter writes Gemma's SentencePiece vocabulary
    embeddings(b, cfg, d, norm_shift=GEMMA_NORM_SHIFT)
    shift = GEMMA_NORM_SHIFT
    for i in range(d.n_layer):
        p = f"model.layers.{i}"
        attention(b, i, d, permute=False, qk_norm=True, post_norm=T.ATTN_POST_NORM, norm_shift=shift)
        b.vector(T.FFN_NORM, i, f"{p}.pre_feedforward_layernorm.weight", d.n_embd, shift=shift)
        dense_ffn(b, i, f"{p}.mlp", d.n_embd, d.n_ff)
        b.vector(T.FFN_POST_NORM, i, f"{p}.post_feedforward_layernorm.weight", d.n_embd, shift=shift)


def gemma3_checks(cfg: Config, d: Dims) -> None:
    """What llama.cpp's gemma3 computes without reading it from the file must be what config.json
    says, or the file would compute another model."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConvertError("config.json: attn_logit_softcapping is set; Gemma 3 has none (llama.cpp's "
                           "gemma3 neither)")
    act = cfg.get("hidden_activation", GEMMA3_ACTIVATION)
    if act != GEMMA3_ACTIVATION:
        raise ConvertError(f"config.json: hidden_activation {act!r}: llama.cpp's gemma3 computes "
                           f"{GEMMA3_ACTIVATION!r}")
    scalar = d.n_embd // d.n_head if d.n_layer == GEMMA3_27B_LAYERS else d.head_dim
    if cfg.get("query_pre_attn_scalar", scalar) != scalar:
        raise ConvertError(f"config.json: query_pre_attn_scalar is {cfg.get('query_pre_attn_scalar')!r}, "
                           f"but llama.cpp scales a gemma3 query of this shape by 1/sqrt({scalar})")
    local_type = cfg.rope_local.get("rope_type", "default")
    if local_type != "default":
        raise ConvertError(f"config.json: rope scaling {local_type!r} of the local layers: llama.cpp "
                           "scales only the global layers' rope")


def check_gemma3_layers(cfg: Config, n_layer: int, windowed: bool) -> None:
    """config.json's local and global layers must be llama.cpp's pattern (LLAMA_CPP_GEMMA3_PATTERN)."""
    p = LLAMA_CPP_GEMMA3_PATTERN
    expected = [LOCAL_LAYERS if windowed and i % p < p - 1 else GLOBAL_LAYERS for i in range(n_layer)]
    types = cfg.get("layer_types")
    if types is None:  # transformers 4: a pattern of sliding_window_pattern layers, the last global
        n = cfg.int("sliding_window_pattern", p) or 1
        types = [LOCAL_LAYERS if (i + 1) % n else GLOBAL_LAYERS for i in range(n_layer)]
    if list(types) != expected:
        raise ConvertError(f"config.json: layer_types {list(types)} are not the layers llama.cpp makes local "
                           f"in a gemma3 file ({expected})")


def plan_phi3(b: Builder, cfg: Config, d: Dims) -> None:
    """Phi-3 and Phi-4-mini: fused projections kept fused, NEOX rope over part of each head."""
    plan = b.plan
    rope_dim = int(cfg.partial_rotary_factor(1.0) * d.n_embd) // d.n_head
    common_metadata(plan, cfg, d, d.n_layer, rope_dim, ("default", "longrope"))
    orig = cfg.get("original_max_position_embeddings", cfg.rope.get("original_max_position_embeddings"))
    if not isinstance(orig, int) or orig <= 0:
        raise ConvertError(f"config.json: original_max_position_embeddings is {orig!r}, not a length "
                           "(llama.cpp's phi3 needs it)")
    plan.kv(K.Rope.SCALING_ORIG_CTX_LEN, orig, V.UINT32)
    plan.kv(K.Attention.SLIDING_WINDOW, cfg.int("sliding_window", 0), V.UINT32)  # 0: none (Phi-4)
    if cfg.rope_type() == "longrope":
        phi3_longrope(b, cfg, rope_dim, orig)
    embeddings(b, cfg, d)
    q_rows, kv_rows = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    for i in range(d.n_layer):
        p = f"model.layers.{i}"
        b.vector(T.ATTN_NORM, i, f"{p}.input_layernorm.weight", d.n_embd)
        b.matrix(T.ATTN_QKV, i, f"{p}.self_attn.qkv_proj.weight", q_rows + 2 * kv_rows, d.n_embd)
        b.matrix(T.ATTN_OUT, i, f"{p}.self_attn.o_proj.weight", d.n_embd, q_rows)
        b.vector(T.FFN_NORM, i, f"{p}.post_attention_layernorm.weight", d.n_embd)
        b.matrix(T.FFN_UP, i, f"{p}.mlp.gate_up_proj.weight", 2 * d.n_ff, d.n_embd)
        b.matrix(T.FFN_DOWN, i, f"{p}.mlp.down_proj.weight", d.n_embd, d.n_ff)


def phi3_longrope(b: Builder, cfg: Config, rope_dim: int, orig: int) -> None:
    """The long and short factor vectors (one per rotated pair) and the attention factor that
    transformers computes from the context extension, as llama.cpp's converter writes them."""
    for key, kind in (("long_factor", T.ROPE_FACTORS_LONG), ("short_factor", T.ROPE_FACTORS_SHORT)):
        factors = cfg.rope.get(key)
        if not isinstance(factors, list) or len(factors) != rope_dim // 2:
            raise ConvertError(f"config.json: longrope's {key} must list {rope_dim // 2} numbers (one per "
                               f"rotated pair of {rope_dim})")
        b.computed(kind, np.array(factors, dtype=np.float32))
    scale = cfg.int("max_position_embeddings") / orig
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    b.plan.kv(K.Rope.SCALING_ATTN_FACTOR, attn_factor, V.FLOAT32)
