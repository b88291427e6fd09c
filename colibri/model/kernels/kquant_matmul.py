"""``out = x @ W.T`` for decode rows on Q4_K and Q6_K blocks as the file has them: integer dot
products, nothing decoded to float32.

The expert store keeps a K-quant expert as its file bytes (``Kind.BLOCKS``), so a resident expert
is no bigger than the file; the general path for such weights decodes every weight to float32
first (``block_matmul``), which made a Q4_K_M MoE's decode ~20x slower than its Q4_0 twin. Here a
weight row is read as llama.cpp's CPU kernels read it: per 256-value super-block, 64 quant bytes
a vector, one ``vpdpbusd`` per vector and activation level, the block's scales applied per lane
(``quad_floats``), the lanes summed once at the row's end. The activations are the integer path's
(``int8_matmul``): three 8-bit levels per 32 values, so a row's result is the float product's
within float32's noise; the offsets (Q4_K's ``dmin m``, Q6_K's ``-32``) are applied to the exact
float sums of the activations. Each (activation row, weight row) takes the same steps whatever the
batch, so a result does not depend on the other rows of the step.

Vector lanes 0-7 and 8-15 hold two 32-value runs of a super-block: for Q4_K's low nibbles of
bytes 0-63 the values 0-31 and 64-95 (its sub-blocks 0 and 2), and so on (``Q4K_RUNS``); for Q6_K
the low and high nibbles of 64 bytes of ``ql`` with two bits of ``qh`` each (``six_bits_low``),
values 0-63 and 64-127 of each half block.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.int8_matmul import LEVELS, quantize_row
from colibri.model.kernels.simd import (
    dpbusd,
    fma_float,
    high_nibbles,
    lane_sum,
    load_bytes,
    load_floats,
    load_runs,
    low_nibbles,
    mul_float,
    quad_floats,
    six_bits_high,
    six_bits_low,
    to_float,
    zeros_float,
    zeros_int,
)
from colibri.store.blocks import Q4_K_SIZE, Q6_K_SIZE, QK_K, T_Q4_K, T_Q6_K, half, scale_min_k4
from colibri.store.formats import BLOCK
from colibri.store.packed import JIT_OPTIONS, Weight, block_row

_JIT = JIT_OPTIONS
# The block types this path computes; a weight with any other part takes ``block_matmul``.
TYPES = (T_Q4_K, T_Q6_K)
# Runs of rows the threads split a matrix into (a constant: numba cannot cache code that asks
# for the thread count).
MAX_CHUNKS = 32
# A super-block's four vectors, and the 32-value runs (x blocks) in their lanes 0-7 and 8-15.
Q4K_RUNS = np.array([[0, 2], [1, 3], [4, 6], [5, 7]], np.int64)
Q6K_RUNS = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int64)
# The 32-value runs of a super-block in the order Q4_K's vectors take them (``Q4K_RUNS`` flattened):
# the activation quants are laid out so, so that each vector's are one 64-byte load.
Q4K_ORDER = Q4K_RUNS.reshape(-1)
# Floats of one vector's activation scales, all levels: ``_lane_scales``'s stride per vector.
_PER_VECTOR = LEVELS * 16


@nb.njit(**_JIT)
def computes(w: Weight) -> bool:
    """Whether every part of an in-place weight is Q4_K or Q6_K, over whole super-blocks."""
    for p in range(w.parts.shape[0]):
        t = w.parts[p, 3]
        if t != T_Q4_K and t != T_Q6_K:
            return False
    return True


@nb.njit(**_JIT)
def _lane_scales(dx: np.ndarray, runs: np.ndarray, out: np.ndarray) -> None:
    """Each super-block's four vectors' activation scales, lane by lane, per level:
    ``out[((sb 4 + v) LEVELS + l) 16 + i]`` is level l's scale of run ``runs[v, i // 8]``."""
    n_sb = dx.shape[1] * BLOCK // QK_K
    for sb in range(n_sb):
        for v in range(4):
            for lv in range(LEVELS):
                at = ((sb * 4 + v) * LEVELS + lv) * 16
                a, b = dx[lv, sb * 8 + runs[v, 0]], dx[lv, sb * 8 + runs[v, 1]]
                for i in range(8):
                    out[at + i] = a
                    out[at + 8 + i] = b


@nb.njit(inline="always", **_JIT)
def _vector(acc, wv, xqf: np.ndarray, xa: int, k: int, dvf: np.ndarray, at: int, ws):  # noqa: ANN001, ANN202
    """``acc`` plus one weight vector's products: per level, the exact integer sums against the
    64 activation quants at ``xa`` (in the vector's lane order) times that level's lane scales,
    then the weights' scales ``ws``, rounded in that order whatever the batch."""
    z = zeros_int()
    p = mul_float(to_float(dpbusd(z, wv, load_bytes(xqf, xa))), load_floats(dvf, at))
    p = fma_float(to_float(dpbusd(z, wv, load_bytes(xqf, xa + k))), load_floats(dvf, at + 16), p)
    p = fma_float(to_float(dpbusd(z, wv, load_bytes(xqf, xa + 2 * k))), load_floats(dvf, at + 32), p)
    return fma_float(p, ws, acc)


@nb.njit(inline="always", **_JIT)
def _q4_k_row(raw: np.ndarray, at: int, n_sb: int, xqf: np.ndarray, x0: int, k: int, dvf: np.ndarray,
              xs32: np.ndarray) -> np.float32:
    """One Q4_K row at ``raw[at:]`` against the activation row whose quants, in Q4_K's run order
    (``Q4K_ORDER``), start at ``x0``: ``sum d sc_j (q . x) - dmin m_j sum(x)`` over the 32-value
    sub-blocks j."""
    acc = zeros_float()
    mins = np.float32(0.0)
    for sb in range(n_sb):
        base = at + sb * Q4_K_SIZE
        d, dmin = half(raw[base], raw[base + 1]), half(raw[base + 2], raw[base + 3])
        s0, m0 = scale_min_k4(raw, base + 4, 0)
        s1, m1 = scale_min_k4(raw, base + 4, 1)
        s2, m2 = scale_min_k4(raw, base + 4, 2)
        s3, m3 = scale_min_k4(raw, base + 4, 3)
        s4, m4 = scale_min_k4(raw, base + 4, 4)
        s5, m5 = scale_min_k4(raw, base + 4, 5)
        s6, m6 = scale_min_k4(raw, base + 4, 6)
        s7, m7 = scale_min_k4(raw, base + 4, 7)
        j = sb * 8
        mins += dmin * (np.float32(m0) * xs32[j] + np.float32(m1) * xs32[j + 1] + np.float32(m2) * xs32[j + 2]
                        + np.float32(m3) * xs32[j + 3] + np.float32(m4) * xs32[j + 4]
                        + np.float32(m5) * xs32[j + 5] + np.float32(m6) * xs32[j + 6]
                        + np.float32(m7) * xs32[j + 7])
        v0, v1 = load_bytes(raw, base + 16), load_bytes(raw, base + 80)
        xb, dv = x0 + sb * QK_K, sb * 4 * _PER_VECTOR
        acc = _vector(acc, low_nibbles(v0), xqf, xb, k, dvf, dv, quad_floats(d * s0, d * s0, d * s2, d * s2))
        acc = _vector(acc, high_nibbles(v0), xqf, xb + 64, k, dvf, dv + _PER_VECTOR,
                      quad_floats(d * s1, d * s1, d * s3, d * s3))
        acc = _vector(acc, low_nibbles(v1), xqf, xb + 128, k, dvf, dv + 2 * _PER_VECTOR,
                      quad_floats(d * s4, d * s4, d * s6, d * s6))
        acc = _vector(acc, high_nibbles(v1), xqf, xb + 192, k, dvf, dv + 3 * _PER_VECTOR,
                      quad_floats(d * s5, d * s5, d * s7, d * s7))
    return lane_sum(acc) - mins


@nb.njit(inline="always", **_JIT)
def _i8(byte: np.uint8) -> np.float32:
    v = np.int64(byte)
    return np.float32(v - 256 if v >= 128 else v)


@nb.njit(inline="always", **_JIT)
def _q6_k_row(raw: np.ndarray, at: int, n_sb: int, xqf: np.ndarray, x0: int, k: int, dvf: np.ndarray,
              xs16: np.ndarray) -> np.float32:
    """One Q6_K row: ``sum d sc_i ((q - 32) . x)`` over the 16-value sub-blocks i, the ``-32``
    applied to the float sums of x."""
    acc = zeros_float()
    offs = np.float32(0.0)
    for sb in range(n_sb):
        base = at + sb * Q6_K_SIZE
        d = half(raw[base + 208], raw[base + 209])
        sc = base + 192
        for i in range(16):
            offs += d * _i8(raw[sc + i]) * xs16[sb * 16 + i]
        for n in range(2):
            ql = load_bytes(raw, base + 64 * n)
            qh = load_runs(raw, base + 128 + 32 * n, base + 128 + 32 * n)  # its 32 bytes twice
            s = sc + 8 * n
            xb, dv = x0 + sb * QK_K + 128 * n, (sb * 4 + 2 * n) * _PER_VECTOR
            acc = _vector(acc, six_bits_low(ql, qh), xqf, xb, k, dvf, dv,
                          quad_floats(d * _i8(raw[s]), d * _i8(raw[s + 1]), d * _i8(raw[s + 2]),
                                      d * _i8(raw[s + 3])))
            acc = _vector(acc, six_bits_high(ql, qh), xqf, xb + 64, k, dvf, dv + _PER_VECTOR,
                          quad_floats(d * _i8(raw[s + 4]), d * _i8(raw[s + 5]), d * _i8(raw[s + 6]),
                                      d * _i8(raw[s + 7])))
    return lane_sum(acc) - np.float32(32.0) * offs


@nb.njit(parallel=True, **_JIT)
def kquant_matmul(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """``out[T, N] = x[T, K] @ W.T`` for an in-place weight of Q4_K and Q6_K parts (``computes``)."""
    t_rows, k = x.shape
    n_sb = k // QK_K
    xq = np.empty((t_rows, LEVELS, k), np.int8)
    xq4 = np.empty((t_rows, LEVELS, k), np.int8)  # the same in Q4_K's run order
    dx = np.empty((t_rows, LEVELS, k // BLOCK), np.float32)
    sx = np.empty((t_rows, LEVELS, k // BLOCK), np.int32)
    xs32 = np.empty((t_rows, k // BLOCK), np.float32)
    xs16 = np.empty((t_rows, k // 16), np.float32)
    dv4 = np.empty((t_rows, n_sb * 4 * _PER_VECTOR), np.float32)
    dv6 = np.empty((t_rows, n_sb * 4 * _PER_VECTOR), np.float32)
    for t in range(t_rows):
        quantize_row(x[t], BLOCK, xq[t], dx[t], sx[t])
        for lv in range(LEVELS):
            for sb in range(n_sb):
                for j in range(8):
                    src, dst = sb * QK_K + Q4K_ORDER[j] * BLOCK, sb * QK_K + j * BLOCK
                    xq4[t, lv, dst : dst + BLOCK] = xq[t, lv, src : src + BLOCK]
        for j in range(k // 16):
            s = np.float32(0.0)
            for i in range(16 * j, 16 * j + 16):
                s += x[t, i]
            xs16[t, j] = s
        for j in range(k // BLOCK):
            s = np.float32(0.0)
            for i in range(BLOCK * j, BLOCK * j + BLOCK):
                s += x[t, i]
            xs32[t, j] = s
        _lane_scales(dx[t], Q4K_RUNS, dv4[t])
        _lane_scales(dx[t], Q6K_RUNS, dv6[t])
    xqf, xq4f = xq.reshape(-1), xq4.reshape(-1)
    n_rows = w.n_rows
    n_chunks = min(n_rows, MAX_CHUNKS)
    for c in nb.prange(n_chunks):
        for r in range(c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks):
            at, gtype = block_row(w, r)
            for t in range(t_rows):
                x0 = t * LEVELS * k
                if gtype == T_Q4_K:
                    out[t, r] = _q4_k_row(w.raw, at, n_sb, xq4f, x0, k, dv4[t], xs32[t])
                else:
                    out[t, r] = _q6_k_row(w.raw, at, n_sb, xqf, x0, k, dv6[t], xs16[t])
