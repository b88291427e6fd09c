"""In-place formats re-expressed as ``d * q + m`` per 32 values, so that they pack into lanes.

The packed layout (``packed.py``) computes on an unsigned quant per value with a scale d and an
offset m per 32-value block; its direct path is 5-20x faster than decoding the file's blocks to
float on every step (docs/performance.md). Every format whose scales are per 32 values fits it
exactly: Q5_0/Q5_1 (5-bit quants), Q4_K/Q5_K (a super-block's 6-bit scale and min per 32 values,
multiplied out: d' = d * sc, m' = -dmin * mn), and IQ4_NL/IQ4_XS (the grid's value plus 128, and
m = -128 d). Q2_K, Q3_K and Q6_K scale every 16 values and stay in place.

``lane_row`` turns one raw row into quants, scales and offsets, with the decoders' arithmetic
(``blocks.py``), so that ``d * q + m`` is the decoded value to float32 rounding. Q4_0, Q4_1 and
Q8_0 are here too, for stacks that mix them with the formats above.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.store.blocks import (
    IQ4_NL_SIZE,
    IQ4_XS_SIZE,
    JIT_OPTIONS,
    Q4_K_SIZE,
    Q5_0_SIZE,
    Q5_1_SIZE,
    Q5_K_SIZE,
    QK_K,
    T_IQ4_NL,
    T_IQ4_XS,
    T_Q4_K,
    T_Q5_0,
    T_Q5_1,
    T_Q5_K,
    _scale_min_k4,
    _u32,
    half,
)
from colibri.store.formats import BLOCK, FORMATS, GGMLType

T_Q4_0, T_Q4_1, T_Q8_0 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q8_0)
Q4_0_SIZE, Q4_1_SIZE, Q8_0_SIZE = (FORMATS[GGMLType(t)].nbytes for t in (T_Q4_0, T_Q4_1, T_Q8_0))
# IQ4's grid (ggml-common.h's kvalues_iq4nl) plus 128: an unsigned quant with m = -128 d.
IQ4_GRID_U8 = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
               + 128).astype(np.uint8)

# The in-place formats that pack into lanes, and those of them whose quants are 4-bit (they pack
# into Q4's nibbles; any other packs into Q8's bytes).
LANE_TYPES = frozenset({GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.IQ4_NL,
                        GGMLType.IQ4_XS})
FOUR_BIT = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K})


@nb.njit(**JIT_OPTIONS)
def _legacy(w: np.ndarray, gtype: int, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: one scale (and min) per 32 values."""
    for b in range(d.shape[0]):
        if gtype == T_Q8_0:
            base = b * Q8_0_SIZE
            d[b] = half(w[base], w[base + 1])
            m[b] = np.float32(-128.0) * d[b]
            for j in range(BLOCK):
                q[b * BLOCK + j] = w[base + 2 + j] ^ np.uint8(0x80)
            continue
        with_min = gtype == T_Q4_1 or gtype == T_Q5_1
        size = Q5_1_SIZE
        if gtype == T_Q4_0:
            size = Q4_0_SIZE
        elif gtype == T_Q4_1:
            size = Q4_1_SIZE
        elif gtype == T_Q5_0:
            size = Q5_0_SIZE
        base = b * size
        d[b] = half(w[base], w[base + 1])
        five = gtype == T_Q5_0 or gtype == T_Q5_1
        qh = _u32(w, base + 4 if with_min else base + 2) if five else np.int64(0)
        qs = base + size - 16
        for j in range(16):
            v = np.int64(w[qs + j])
            q[b * BLOCK + j] = (v & 0x0F) | (((qh >> j) << 4) & 0x10)
            q[b * BLOCK + j + 16] = (v >> 4) | ((qh >> (j + 12)) & 0x10)
        if with_min:
            m[b] = half(w[base + 2], w[base + 3])
        else:
            m[b] = np.float32(-16.0 if five else -8.0) * d[b]


@nb.njit(**JIT_OPTIONS)
def _q45_k(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray, size: int, fifth_bit: bool) -> None:
    for b in range(q.shape[0] // QK_K):
        base = b * size
        dd, dmin = half(w[base], w[base + 1]), half(w[base + 2], w[base + 3])
        qs = base + (48 if fifth_bit else 16)
        for j64 in range(4):
            for k in range(2):  # the low nibbles' 32 values, then the high ones'
                sc, mn = _scale_min_k4(w, base + 4, 2 * j64 + k)
                sub = b * (QK_K // BLOCK) + 2 * j64 + k
                d[sub], m[sub] = dd * np.float32(sc), -(dmin * np.float32(mn))
                for i in range(32):
                    v = np.int64(w[qs + 32 * j64 + i])
                    v = (v >> 4) if k else (v & 0xF)
                    if fifth_bit and np.int64(w[base + 16 + i]) & (1 << (2 * j64 + k)):
                        v += 16
                    q[sub * BLOCK + i] = v


@nb.njit(**JIT_OPTIONS)
def _iq4(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray, xs: bool) -> None:
    per = QK_K if xs else BLOCK
    size = IQ4_XS_SIZE if xs else IQ4_NL_SIZE
    for b in range(q.shape[0] // per):
        base = b * size
        dd = half(w[base], w[base + 1])
        for ib in range(per // BLOCK):
            dl, qs = dd, base + 2
            if xs:
                scales_h = np.int64(w[base + 2]) | (np.int64(w[base + 3]) << 8)
                low = (np.int64(w[base + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
                ls = low | (((scales_h >> (2 * ib)) & 3) << 4)
                dl, qs = dd * np.float32(ls - 32), base + 8 + 16 * ib
            sub = b * (per // BLOCK) + ib
            d[sub], m[sub] = dl, np.float32(-128.0) * dl
            for j in range(16):
                v = np.int64(w[qs + j])
                q[sub * BLOCK + j] = IQ4_GRID_U8[v & 0xF]
                q[sub * BLOCK + j + 16] = IQ4_GRID_U8[v >> 4]


@nb.njit(**JIT_OPTIONS)
def lane_row(w: np.ndarray, gtype: int, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> bool:
    """Raw row ``w`` as quants ``q`` (uint8, one per value), and per 32 values the scale ``d`` and
    offset ``m`` (float32), value = d * q + m; False for a format that does not fit."""
    if gtype in (T_Q4_0, T_Q4_1, T_Q8_0, T_Q5_0, T_Q5_1):
        _legacy(w, gtype, q, d, m)
    elif gtype == T_Q4_K or gtype == T_Q5_K:
        _q45_k(w, q, d, m, Q4_K_SIZE if gtype == T_Q4_K else Q5_K_SIZE, gtype == T_Q5_K)
    elif gtype == T_IQ4_NL or gtype == T_IQ4_XS:
        _iq4(w, q, d, m, gtype == T_IQ4_XS)
    else:
        return False
    return True
