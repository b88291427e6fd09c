"""``make_synthetic_moe.py --arch gpt-oss``'s layer and metadata: gpt-oss-20b's layout scaled down,
as llama.cpp's MXFP4_MOE writes it (the experts MXFP4, every other matrix Q8_0).

A layer: q, k, v and output with biases (Q8_0), a sink per head, the router with its bias, experts
of random MXFP4 blocks (an exponent byte per 32 values, chosen so a weight's spread is the Q4_0
file's) with biases; even layers slide over ``SLIDING_WINDOW`` positions, YaRN as the released
config has it (factor 32 over 4096, base 150000).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from colibri.store.formats import GGMLType, row_nbytes

MXFP4 = gguf.GGMLQuantizationType.MXFP4
Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
SLIDING_WINDOW = 128
ROPE_BASE, YARN_FACTOR, YARN_ORIGINAL = 150000.0, 32.0, 4096
GATING_SOFTMAX_WEIGHT = 3  # llama.cpp's expert_gating_func: the softmax of the chosen
FILE_TYPE = 38  # MOSTLY_MXFP4_MOE
BIAS_SCALE = 0.02
MXFP4_GRID_STD = 6.04  # of a value drawn uniformly from the doubled E2M1 grid
E8M0_BIAS = 128  # a block's scale is 2^(e - 128): the grid doubled


def random_mxfp4(rng: np.random.Generator, rows: int, cols: int, spread: float) -> np.ndarray:
    """Random MXFP4 rows (uint8, [rows, cols/32*17]) whose values spread about ``spread``."""
    blocks = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    blocks[:, :, 0] = E8M0_BIAS + int(round(np.log2(spread / MXFP4_GRID_STD)))
    return blocks.reshape(rows, -1)


def random_q8_0(rng: np.random.Generator, rows: int, cols: int, spread: float) -> np.ndarray:
    """Random Q8_0 rows: int8 quants uniform in -127..127, the scale giving ``spread``."""
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(-127, 128, (rows, cols // 32, 32)).astype(np.int8).view(np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(spread / 73.3).tobytes(), np.uint8)  # 73.3: the quants' std
    return blocks.reshape(rows, -1)


def layer(plan: Any, i: int, shape: Any, spread: Callable[[int], float]) -> None:
    """Layer i of ``plan`` (``make_synthetic_moe._Plan``) in gpt-oss's layout; ``spread(cols)``: a
    weight's spread in a matrix of ``cols`` columns."""
    p, w, n_embd, n_ff, n_exp = f"blk.{i}.", plan.weights, shape.n_embd, shape.n_ff, plan.weights.n_experts

    def q8(name: str, rows: int, cols: int) -> None:
        plan.entries.append((p + name, (rows, row_nbytes(GGMLType.Q8_0, cols)), Q8,
                             lambda: random_q8_0(w.rng, rows, cols, spread(cols))))

    def vector(name: str, shape_: tuple[int, ...], scale: float = BIAS_SCALE) -> None:
        plan.f32_tensor(p + name, shape_, lambda: (scale * w.rng.standard_normal(shape_)).astype(np.float32))

    plan.f32_tensor(p + "attn_norm.weight", (n_embd,), w.ones_ish)
    for x, rows in (("q", shape.q_dim), ("k", shape.kv_dim), ("v", shape.kv_dim)):
        q8(f"attn_{x}.weight", rows, n_embd)
        vector(f"attn_{x}.bias", (rows,))
    q8("attn_output.weight", n_embd, shape.q_dim)
    vector("attn_output.bias", (n_embd,))
    vector("attn_sinks.weight", (shape.n_heads,), 1.0)
    plan.f32_tensor(p + "post_attention_norm.weight", (n_embd,), w.ones_ish)
    plan.f32_tensor(p + "ffn_gate_inp.weight", (n_exp, n_embd), w.router)
    vector("ffn_gate_inp.bias", (n_exp,))
    for part, rows, cols in (("gate", n_ff, n_embd), ("up", n_ff, n_embd), ("down", n_embd, n_ff)):
        shape3 = (n_exp, rows, row_nbytes(GGMLType.MXFP4, cols))
        make = lambda r=rows, c=cols: random_mxfp4(w.rng, n_exp * r, c, spread(c)).reshape(n_exp, r, -1)  # noqa: E731
        plan.entries.append((f"{p}ffn_{part}_exps.weight", shape3, MXFP4, make))
        vector(f"ffn_{part}_exps.bias", (n_exp, rows))


def metadata(w: gguf.GGUFWriter, shape: Any) -> None:
    """What gpt-oss's files say beside the other layouts' keys."""
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_expert_feed_forward_length(shape.n_ff)
    w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=w.arch), GATING_SOFTMAX_WEIGHT)
    w.add_expert_weights_norm(False)
    w.add_sliding_window(SLIDING_WINDOW)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN_FACTOR)
    w.add_rope_scaling_orig_ctx_len(YARN_ORIGINAL)
