"""In-place formats re-expressed as ``d * q + m`` per 32 values, so that they pack into lanes.

The packed layout (``packed.py``) computes on an unsigned quant per value with a scale d and an
offset m per 32-value block; its direct path is 5-20x faster than decoding the file's blocks to
float on every step (docs/performance.md). Every format whose scales are per 32 values fits it
exactly: Q5_0/Q5_1 (5-bit quants), Q4_K/Q5_K (a super-block's 6-bit scale and min per 32 values,
multiplied out: d' = d * sc, m' = -dmin * mn), IQ4_NL/IQ4_XS and MXFP4 (the grid's value plus 128,
and m = -128 d; MXFP4's 25 levels also fit Q5 lanes). Q2_K, Q3_K and Q6_K scale every 16 values:
they pack into Q8 with 16-value blocks (``lane_row16``; a stack mixing them with the others takes
16-value blocks throughout, a 32-value block's scale written twice). The K-quants' scales are also
given as the file keeps them (``sub_scales``: d per super-block, the file's half widened, and an
integer per block), which the packing keeps instead of a float32 per block where every part is a
K-quant.

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
    MXFP4_SIZE,
    Q2_K_SIZE,
    Q3_K_SIZE,
    Q4_K_SIZE,
    Q5_0_SIZE,
    Q5_1_SIZE,
    Q5_K_SIZE,
    Q6_K_SIZE,
    T_IQ4_NL,
    T_IQ4_XS,
    T_MXFP4,
    T_Q2_K,
    T_Q3_K,
    T_Q4_K,
    T_Q5_0,
    T_Q5_1,
    T_Q5_K,
    T_Q6_K,
    _q3_k_scale,
    _q6_k_scale,
    _scale_min_k4,
    _u32,
    e8m0_half,
    iq4_sub_block,
)
from colibri.store.formats import FORMATS, GGMLType
from colibri.store.halves import half
from colibri.store.numerics import BLOCK, KERNEL, QK_K

T_Q4_0, T_Q4_1, T_Q8_0 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q8_0)
Q4_0_SIZE, Q4_1_SIZE, Q8_0_SIZE = (FORMATS[GGMLType(t)].nbytes for t in (T_Q4_0, T_Q4_1, T_Q8_0))
# IQ4's grid (ggml-common.h's kvalues_iq4nl) plus 128: an unsigned quant with m = -128 d.
IQ4_GRID_U8 = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
               + 128).astype(np.uint8)
# MXFP4's grid (doubled E2M1, -12..12) plus 128, as IQ4's; in Q5 lanes plus 16 (``packers.pack_fives``
# takes 112 off, as from Q5_0's): 25 levels fit five bits.
MXFP4_GRID_U8 = (np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]) + 128).astype(np.uint8)

# The in-place formats that pack into lanes, and those of them whose quants are 4-bit (they pack
# into Q4's nibbles; any other packs into Q8's bytes).
SIXTEEN = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q6_K})  # scaled per 16 values
LANE_TYPES = frozenset({GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.IQ4_NL,
                        GGMLType.IQ4_XS, GGMLType.MXFP4}) | SIXTEEN
FOUR_BIT = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K})
# Those whose quants are 5-bit: with 4-bit ones, they pack into Q5 (nibbles and fifth bits).
FIVE_BIT = frozenset({GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.MXFP4})
# Values per block of a 16-value packing.
HALF_BLOCK = BLOCK // 2


@nb.njit(**KERNEL)
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
        # Q5_0's quants are shifted to Q8_0's offset (q - 16 = (q + 112) - 128), so that a stack
        # of Q5_0 and Q8_0 (and IQ4) packs with m = -128 d derived, not stored (OFFSETS_Q8).
        shift = 112 if gtype == T_Q5_0 else 0
        for j in range(16):
            v = np.int64(w[qs + j])
            q[b * BLOCK + j] = ((v & 0x0F) | (((qh >> j) << 4) & 0x10)) + shift
            q[b * BLOCK + j + 16] = ((v >> 4) | ((qh >> (j + 12)) & 0x10)) + shift
        if with_min:
            m[b] = half(w[base + 2], w[base + 3])
        else:
            m[b] = np.float32(-128.0 if shift else -8.0) * d[b]


@nb.njit(**KERNEL)
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


@nb.njit(**KERNEL)
def _iq4(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray, xs: bool) -> None:
    per = QK_K if xs else BLOCK
    size = IQ4_XS_SIZE if xs else IQ4_NL_SIZE
    for b in range(q.shape[0] // per):
        base = b * size
        dd = half(w[base], w[base + 1])
        for ib in range(per // BLOCK):
            dl, qs = iq4_sub_block(w, base, ib, dd, xs)
            sub = b * (per // BLOCK) + ib
            d[sub], m[sub] = dl, np.float32(-128.0) * dl
            for j in range(16):
                v = np.int64(w[qs + j])
                q[sub * BLOCK + j] = IQ4_GRID_U8[v & 0xF]
                q[sub * BLOCK + j + 16] = IQ4_GRID_U8[v >> 4]


@nb.njit(**KERNEL)
def _mxfp4(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    for b in range(d.shape[0]):
        base = b * MXFP4_SIZE
        d[b] = e8m0_half(w[base])
        m[b] = np.float32(-128.0) * d[b]
        for j in range(16):
            v = np.int64(w[base + 1 + j])
            q[b * BLOCK + j] = MXFP4_GRID_U8[v & 0xF]
            q[b * BLOCK + j + 16] = MXFP4_GRID_U8[v >> 4]


@nb.njit(**KERNEL)
def lane_row(w: np.ndarray, gtype: int, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> bool:
    """Raw row ``w`` as quants ``q`` (uint8, one per value), and per 32 values the scale ``d`` and
    offset ``m`` (float32), value = d * q + m; False for a format that does not fit."""
    if gtype in (T_Q4_0, T_Q4_1, T_Q8_0, T_Q5_0, T_Q5_1):
        _legacy(w, gtype, q, d, m)
    elif gtype == T_Q4_K or gtype == T_Q5_K:
        _q45_k(w, q, d, m, Q4_K_SIZE if gtype == T_Q4_K else Q5_K_SIZE, gtype == T_Q5_K)
    elif gtype == T_IQ4_NL or gtype == T_IQ4_XS:
        _iq4(w, q, d, m, gtype == T_IQ4_XS)
    elif gtype == T_MXFP4:
        _mxfp4(w, q, d, m)
    else:
        return False
    return True


@nb.njit(**KERNEL)
def _q2_k(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Q2_K: 2-bit quants, a 4-bit scale and min per 16 values (``blocks._q2_k``'s order)."""
    for b in range(q.shape[0] // QK_K):
        base = b * Q2_K_SIZE
        dd, dmin = half(w[base + 80], w[base + 81]), half(w[base + 82], w[base + 83])
        y, s = b * QK_K, base
        for n in range(2):
            qs = base + 16 + 32 * n
            for shift in range(0, 8, 2):
                for half_ in range(2):
                    sc = np.int64(w[s])
                    s += 1
                    d[y // HALF_BLOCK] = dd * np.float32(sc & 0xF)
                    m[y // HALF_BLOCK] = -(dmin * np.float32(sc >> 4))
                    for i in range(16):
                        q[y] = (np.int64(w[qs + 16 * half_ + i]) >> shift) & 3
                        y += 1


@nb.njit(**KERNEL)
def _q3_k(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Q3_K: value = dl * (lo - hi), hi 4 where the hmask bit is clear: q = lo - hi + 4, m = -4 dl."""
    for b in range(q.shape[0] // QK_K):
        base = b * Q3_K_SIZE
        dd = half(w[base + 108], w[base + 109])
        y, j, bit = b * QK_K, 0, 1
        for n in range(2):
            qs = base + 32 + 32 * n
            for shift in range(0, 8, 2):
                for half_ in range(2):
                    dl = dd * np.float32(_q3_k_scale(w, base + 96, j))
                    j += 1
                    d[y // HALF_BLOCK], m[y // HALF_BLOCK] = dl, np.float32(-4.0) * dl
                    for i in range(16):
                        lo = (np.int64(w[qs + 16 * half_ + i]) >> shift) & 3
                        q[y] = lo + (4 if np.int64(w[base + 16 * half_ + i]) & bit else 0)
                        y += 1
                bit <<= 1


@nb.njit(**KERNEL)
def _q6_k(w: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Q6_K: value = d * sc * (q - 32), an int8 scale per 16 values: d' = d * sc, and the quants
    shifted to Q8_0's offset (q - 32 = (q + 96) - 128, m = -128 d'), so that m is derived, not
    stored (``packed.OFFSETS_Q8``): 20 bytes per 16 values in Q8 lanes, not 24."""
    for b in range(q.shape[0] // QK_K):
        base = b * Q6_K_SIZE
        dd = half(w[base + 208], w[base + 209])
        for sub in range(QK_K // HALF_BLOCK):
            at = b * (QK_K // HALF_BLOCK) + sub
            d[at] = dd * np.float32(_q6_k_scale(w, base, sub))
            m[at] = np.float32(-128.0) * d[at]
        for n in range(2):
            ql, qh, y = base + 64 * n, base + 128 + 32 * n, b * QK_K + 128 * n
            for i in range(32):
                lo0, lo1, h = np.int64(w[ql + i]), np.int64(w[ql + i + 32]), np.int64(w[qh + i])
                q[y + i] = ((lo0 & 0xF) | ((h & 3) << 4)) + 96
                q[y + i + 32] = ((lo1 & 0xF) | (((h >> 2) & 3) << 4)) + 96
                q[y + i + 64] = ((lo0 >> 4) | (((h >> 4) & 3) << 4)) + 96
                q[y + i + 96] = ((lo1 >> 4) | (((h >> 6) & 3) << 4)) + 96


@nb.njit(**KERNEL)
def lane_row16(w: np.ndarray, gtype: int, q: np.ndarray, d: np.ndarray, m: np.ndarray,
               d32: np.ndarray, m32: np.ndarray) -> bool:
    """``lane_row`` with a scale and offset per 16 values (``d32``/``m32``: scratch, K/32)."""
    if gtype == T_Q2_K:
        _q2_k(w, q, d, m)
    elif gtype == T_Q3_K:
        _q3_k(w, q, d, m)
    elif gtype == T_Q6_K:
        _q6_k(w, q, d, m)
    elif lane_row(w, gtype, q, d32, m32):
        for b in range(d32.shape[0]):
            d[2 * b] = d[2 * b + 1] = d32[b]
            m[2 * b] = m[2 * b + 1] = m32[b]
    else:
        return False
    return True


@nb.njit(**KERNEL)
def sub_scales(w: np.ndarray, gtype: int, per: int, d_sup: np.ndarray, m_sup: np.ndarray, sd: np.ndarray,
               sm: np.ndarray) -> None:
    """Raw row ``w``'s scales as the file keeps them, for blocks of ``per`` values (32, or 16:
    Q4_K's and Q5_K's 32-value multiples then given twice): per super-block ``d_sup`` and
    ``m_sup``, per block ``sd`` and ``sm``, such that ``d_sup * sd`` and ``m_sup * sm`` are
    ``lane_row``'s (``lane_row16``'s) d and m, the same float32 products. Q4_K and Q5_K: d and
    -dmin times their 6-bit scale and min; Q6_K: d and -128 d times its int8 scale (its quants
    shifted to Q8_0's offset: ``_q6_k``)."""
    q6 = gtype == T_Q6_K
    size = Q6_K_SIZE if q6 else Q4_K_SIZE if gtype == T_Q4_K else Q5_K_SIZE
    subs = QK_K // per  # blocks per super-block
    for b in range(d_sup.shape[0]):
        base = b * size
        if q6:
            assert per == HALF_BLOCK, "Q6_K scales every 16 values"
            dd = half(w[base + 208], w[base + 209])
            d_sup[b], m_sup[b] = dd, np.float32(-128.0) * dd
            for j in range(subs):  # per is 16: Q6_K's own scales
                sd[b * subs + j] = sm[b * subs + j] = _q6_k_scale(w, base, j)
        else:
            d_sup[b], m_sup[b] = half(w[base], w[base + 1]), -half(w[base + 2], w[base + 3])
            for j in range(subs):
                sc, mn = _scale_min_k4(w, base + 4, j * per // BLOCK)
                sd[b * subs + j], sm[b * subs + j] = sc, mn
