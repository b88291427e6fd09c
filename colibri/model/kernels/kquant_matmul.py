"""``out = x @ W.T`` on Q4_K and Q6_K blocks as the file has them: integer dot products, nothing
decoded to float32, for decode and prompt rows alike.

For Q4_K and Q6_K weights kept as the file's bytes (``Kind.BLOCKS``, ``make_weight(...,
lanes=False)``); the expert store packs those formats into lanes instead (``experts.STORE_LANES``:
the lanes kernel is 1.5-3x this one's speed), so the engine no longer reaches this path. The
general path for such weights decodes every weight to float32 first (``block_matmul``). Here a
weight row is read as llama.cpp's CPU kernels read it: per 256-value super-block, 64 quant bytes
a vector, one ``vpdpbusd`` per vector and activation level, the block's scales applied per lane
(one vector of a super-block's scales, spread over the lanes by a shuffle), the lanes summed once
at the row's end. The activations are the integer path's (``int8_matmul``): two 8-bit levels per
32 values (``int8_matmul.LEVELS``); the offsets (Q4_K's ``dmin m``, Q6_K's ``-32``) are applied
to the sums of those same rounded activations, so a row is the float product of the weights and
the rounded row (the exact row's sums instead put the rounding error on ``q``, 0..63, rather
than on the centred weight: in a Q6_K test, 0.065 against 0.0004 off that product, 0.074 against
0.034 off the exact one). Each (activation row, weight row) takes the same steps whatever the
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
    bytes_to_floats,
    dpbusd,
    fma_float,
    high_nibbles,
    lane_sum,
    load_bytes,
    load_floats,
    load_i8_floats,
    load_runs,
    low_nibbles,
    mul_float,
    six_bits_high,
    six_bits_low,
    splat_float,
    spread_0_2,
    spread_1_3,
    spread_4_6,
    spread_5_7,
    spread_quad0,
    spread_quad1,
    spread_quad2,
    spread_quad3,
    to_float,
    zeros_float,
    zeros_int,
)
from colibri.store.blocks import Q4_K_SIZE, Q6_K_SIZE, T_Q4_K, T_Q6_K, _u32
from colibri.store.halves import half
from colibri.store.numerics import BLOCK, KERNEL, QK_K
from colibri.store.packed import Weight, block_row

# Runs of rows the threads split a matrix into (a constant: numba cannot cache code that asks
# for the thread count).
MAX_CHUNKS = 32
# Activation rows taken against one pass over a weight row (prompt rows): its scales and quants
# unpacked once for four.
ROWS_AT_ONCE = 4
# A super-block's four vectors, and the 32-value runs (x blocks) in their lanes 0-7 and 8-15.
Q4K_RUNS = np.array([[0, 2], [1, 3], [4, 6], [5, 7]], np.int64)
Q6K_RUNS = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int64)
# The 32-value runs of a super-block in the order Q4_K's vectors take them (``Q4K_RUNS`` flattened):
# the activation quants are laid out so, so that each vector's are one 64-byte load.
Q4K_ORDER = Q4K_RUNS.reshape(-1)
# Floats of one vector's activation scales, all levels: ``_lane_scales``'s stride per vector.
_PER_VECTOR = LEVELS * 16


@nb.njit(**KERNEL)
def computes(w: Weight) -> bool:
    """Whether every part of an in-place weight is Q4_K or Q6_K (this path's formats; a weight with
    any other part takes ``block_matmul``)."""
    for p in range(w.parts.shape[0]):
        t = w.parts[p, 3]
        if t != T_Q4_K and t != T_Q6_K:
            return False
    return True


@nb.njit(**KERNEL)
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


@nb.njit(inline="always", **KERNEL)
def _vector(acc, wv, xqf: np.ndarray, xa: int, k: int, dvf: np.ndarray, at: int, ws):  # noqa: ANN001, ANN202
    """``acc`` plus one weight vector's products: per level (two), the exact integer sums against the
    64 activation quants at ``xa`` (in the vector's lane order) times that level's lane scales,
    then the weights' scales ``ws``, rounded in that order whatever the batch."""
    z = zeros_int()
    p = mul_float(to_float(dpbusd(z, wv, load_bytes(xqf, xa))), load_floats(dvf, at))
    p = fma_float(to_float(dpbusd(z, wv, load_bytes(xqf, xa + k))), load_floats(dvf, at + 16), p)
    return fma_float(p, ws, acc)


@nb.njit(inline="always", **KERNEL)
def _q4_k_scales(raw: np.ndarray, base: int):  # noqa: ANN202
    """A Q4_K super-block's eight scales and eight mins, times its ``d`` and ``dmin``, as two
    vectors: the 6-bit values come out of their 12 bytes as three words, as llama.cpp unpacks them."""
    d, dmin = half(raw[base], raw[base + 1]), half(raw[base + 2], raw[base + 3])
    w0, w1, w2 = _u32(raw, base + 4), _u32(raw, base + 8), _u32(raw, base + 12)
    sc_hi = (w2 & 0x0F0F0F0F) | (((w0 >> 6) & 0x03030303) << 4)
    m_hi = ((w2 >> 4) & 0x0F0F0F0F) | (((w1 >> 6) & 0x03030303) << 4)
    scv = mul_float(bytes_to_floats(w0 & 0x3F3F3F3F, sc_hi), splat_float(d))
    return scv, mul_float(bytes_to_floats(w1 & 0x3F3F3F3F, m_hi), splat_float(dmin))


@nb.njit(inline="always", **KERNEL)
def _q6_k_scales(raw: np.ndarray, base: int):  # noqa: ANN202
    """A Q6_K super-block's sixteen 8-bit scales times its ``d``, as a vector."""
    return mul_float(load_i8_floats(raw, base + 192), splat_float(half(raw[base + 208], raw[base + 209])))


@nb.njit(inline="always", **KERNEL)
def _q4_k_row(raw: np.ndarray, at: int, n_sb: int, xqf: np.ndarray, x0: int, k: int, dvf: np.ndarray,
              xsm: np.ndarray) -> np.float32:
    """One Q4_K row at ``raw[at:]`` against the activation row whose quants, in Q4_K's run order
    (``Q4K_ORDER``), start at ``x0``: ``sum d sc_j (q . x) - dmin m_j sum(x)`` over the 32-value
    sub-blocks j (``_q4_k_scales``); the mins' term is one vector product with ``-sum(x)`` (``xsm``,
    of the rounded activations)."""
    acc = zeros_float()
    for sb in range(n_sb):
        base = at + sb * Q4_K_SIZE
        scv, mv = _q4_k_scales(raw, base)
        acc = fma_float(mv, load_floats(xsm, sb * 16), acc)
        v0, v1 = load_bytes(raw, base + 16), load_bytes(raw, base + 80)
        xb, dv = x0 + sb * QK_K, sb * 4 * _PER_VECTOR
        acc = _vector(acc, low_nibbles(v0), xqf, xb, k, dvf, dv, spread_0_2(scv))
        acc = _vector(acc, high_nibbles(v0), xqf, xb + 64, k, dvf, dv + _PER_VECTOR, spread_1_3(scv))
        acc = _vector(acc, low_nibbles(v1), xqf, xb + 128, k, dvf, dv + 2 * _PER_VECTOR, spread_4_6(scv))
        acc = _vector(acc, high_nibbles(v1), xqf, xb + 192, k, dvf, dv + 3 * _PER_VECTOR, spread_5_7(scv))
    return lane_sum(acc)


@nb.njit(inline="always", **KERNEL)
def _q6_k_row(raw: np.ndarray, at: int, n_sb: int, xqf: np.ndarray, x0: int, k: int, dvf: np.ndarray,
              xso: np.ndarray) -> np.float32:
    """One Q6_K row: ``sum d sc_i ((q - 32) . x)`` over the 16-value sub-blocks i, the ``-32`` one
    vector product of the scales with ``-32 sum(x)`` (``xso``, of the rounded activations)."""
    acc = zeros_float()
    for sb in range(n_sb):
        base = at + sb * Q6_K_SIZE
        scv = _q6_k_scales(raw, base)
        acc = fma_float(scv, load_floats(xso, sb * 16), acc)
        xb, dv = x0 + sb * QK_K, sb * 4 * _PER_VECTOR
        ql = load_bytes(raw, base)
        qh = load_runs(raw, base + 128, base + 128)  # its 32 bytes twice
        acc = _vector(acc, six_bits_low(ql, qh), xqf, xb, k, dvf, dv, spread_quad0(scv))
        acc = _vector(acc, six_bits_high(ql, qh), xqf, xb + 64, k, dvf, dv + _PER_VECTOR, spread_quad1(scv))
        ql = load_bytes(raw, base + 64)
        qh = load_runs(raw, base + 160, base + 160)
        acc = _vector(acc, six_bits_low(ql, qh), xqf, xb + 128, k, dvf, dv + 2 * _PER_VECTOR,
                      spread_quad2(scv))
        acc = _vector(acc, six_bits_high(ql, qh), xqf, xb + 192, k, dvf, dv + 3 * _PER_VECTOR,
                      spread_quad3(scv))
    return lane_sum(acc)


@nb.njit(inline="always", **KERNEL)
def _q4_k_rows4(raw: np.ndarray, at: int, n_sb: int, xqf: np.ndarray, x0: int, xs: int, k: int,
                dvf: np.ndarray, d0: int, ds: int, xsm: np.ndarray, s0: int, ss: int):  # noqa: ANN202
    """Four activation rows against one Q4_K row (``_q4_k_row``'s for each): row i's quants at
    ``x0 + i xs``, its lane scales at ``d0 + i ds`` and its offsets' sums at ``s0 + i ss`` of the
    flattened arrays. The weight's scales and vectors are unpacked once for the four; each row's
    sum takes ``_q4_k_row``'s steps in its order, so its bits are the same."""
    a0, a1, a2, a3 = zeros_float(), zeros_float(), zeros_float(), zeros_float()
    for sb in range(n_sb):
        base = at + sb * Q4_K_SIZE
        scv, mv = _q4_k_scales(raw, base)
        v0, v1 = load_bytes(raw, base + 16), load_bytes(raw, base + 80)
        q0, q1, q2, q3 = low_nibbles(v0), high_nibbles(v0), low_nibbles(v1), high_nibbles(v1)
        s0v, s1v, s2v, s3v = spread_0_2(scv), spread_1_3(scv), spread_4_6(scv), spread_5_7(scv)
        xb, dv, sm = sb * QK_K, sb * 4 * _PER_VECTOR, sb * 16
        a0 = fma_float(mv, load_floats(xsm, s0 + sm), a0)
        a1 = fma_float(mv, load_floats(xsm, s0 + ss + sm), a1)
        a2 = fma_float(mv, load_floats(xsm, s0 + 2 * ss + sm), a2)
        a3 = fma_float(mv, load_floats(xsm, s0 + 3 * ss + sm), a3)
        for v in range(4):
            wv = q0 if v == 0 else q1 if v == 1 else q2 if v == 2 else q3
            ws = s0v if v == 0 else s1v if v == 1 else s2v if v == 2 else s3v
            xa, da = xb + 64 * v, dv + v * _PER_VECTOR
            a0 = _vector(a0, wv, xqf, x0 + xa, k, dvf, d0 + da, ws)
            a1 = _vector(a1, wv, xqf, x0 + xs + xa, k, dvf, d0 + ds + da, ws)
            a2 = _vector(a2, wv, xqf, x0 + 2 * xs + xa, k, dvf, d0 + 2 * ds + da, ws)
            a3 = _vector(a3, wv, xqf, x0 + 3 * xs + xa, k, dvf, d0 + 3 * ds + da, ws)
    return lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)


@nb.njit(inline="always", **KERNEL)
def _q6_k_rows4(raw: np.ndarray, at: int, n_sb: int, xqf: np.ndarray, x0: int, xs: int, k: int,
                dvf: np.ndarray, d0: int, ds: int, xso: np.ndarray, s0: int, ss: int):  # noqa: ANN202
    """Four activation rows against one Q6_K row, as ``_q4_k_rows4`` (``_q6_k_row``'s steps)."""
    a0, a1, a2, a3 = zeros_float(), zeros_float(), zeros_float(), zeros_float()
    for sb in range(n_sb):
        base = at + sb * Q6_K_SIZE
        scv = _q6_k_scales(raw, base)
        xb, dv, so = sb * QK_K, sb * 4 * _PER_VECTOR, sb * 16
        a0 = fma_float(scv, load_floats(xso, s0 + so), a0)
        a1 = fma_float(scv, load_floats(xso, s0 + ss + so), a1)
        a2 = fma_float(scv, load_floats(xso, s0 + 2 * ss + so), a2)
        a3 = fma_float(scv, load_floats(xso, s0 + 3 * ss + so), a3)
        for half_block in range(2):
            ql = load_bytes(raw, base + 64 * half_block)
            qh = load_runs(raw, base + 128 + 32 * half_block, base + 128 + 32 * half_block)
            for j in range(2):
                v = 2 * half_block + j
                wv = six_bits_low(ql, qh) if j == 0 else six_bits_high(ql, qh)
                ws = (spread_quad0(scv) if v == 0 else spread_quad1(scv) if v == 1
                      else spread_quad2(scv) if v == 2 else spread_quad3(scv))
                xa, da = xb + 64 * v, dv + v * _PER_VECTOR
                a0 = _vector(a0, wv, xqf, x0 + xa, k, dvf, d0 + da, ws)
                a1 = _vector(a1, wv, xqf, x0 + xs + xa, k, dvf, d0 + ds + da, ws)
                a2 = _vector(a2, wv, xqf, x0 + 2 * xs + xa, k, dvf, d0 + 2 * ds + da, ws)
                a3 = _vector(a3, wv, xqf, x0 + 3 * xs + xa, k, dvf, d0 + 3 * ds + da, ws)
    return lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)


@nb.njit(**KERNEL)
def _prepare(x: np.ndarray, w: Weight, xq: np.ndarray, xq4: np.ndarray, dv4: np.ndarray,
             dv6: np.ndarray, xsm: np.ndarray, xso: np.ndarray) -> None:
    """The activation rows as the vectors of ``w``'s formats take them: the levels of quants
    (in Q4_K's run order where it has Q4_K parts), each vector's lane scales, and the offsets'
    sums. Not in the parallel function: numba would make each of its array copies a parallel
    region of its own."""
    q4_k = q6_k = False
    for p in range(w.parts.shape[0]):
        q4_k |= w.parts[p, 3] == T_Q4_K
        q6_k |= w.parts[p, 3] == T_Q6_K
    t_rows, k = x.shape
    n_sb = k // QK_K
    dx = np.empty((t_rows, LEVELS, k // BLOCK), np.float32)
    sx = np.empty((t_rows, LEVELS, k // BLOCK), np.int32)
    xsm[:] = 0.0
    for t in range(t_rows):
        quantize_row(x[t], BLOCK, xq[t], dx[t], sx[t])
        if q6_k:
            _lane_scales(dx[t], Q6K_RUNS, dv6[t])
            for j in range(k // 16):
                s = np.float32(0.0)
                for lv in range(LEVELS):
                    total = 0  # the level's quants, an exact integer sum
                    for i in range(16 * j, 16 * j + 16):
                        total += np.int32(xq[t, lv, i])
                    s += dx[t, lv, j // 2] * np.float32(total)
                xso[t, j] = np.float32(-32.0) * s
        if not q4_k:
            continue
        _lane_scales(dx[t], Q4K_RUNS, dv4[t])
        for lv in range(LEVELS):
            for sb in range(n_sb):
                for j in range(8):
                    src, dst = sb * QK_K + Q4K_ORDER[j] * BLOCK, sb * QK_K + j * BLOCK
                    for i in range(BLOCK):
                        xq4[t, lv, dst + i] = xq[t, lv, src + i]
        for j in range(k // BLOCK):
            s = np.float32(0.0)
            for lv in range(LEVELS):
                s += dx[t, lv, j] * np.float32(sx[t, lv, j])
            xsm[t, (j // 8) * 16 + j % 8] = -s


@nb.njit(parallel=True, **KERNEL)
def kquant_matmul(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """``out[T, N] = x[T, K] @ W.T`` for an in-place weight of Q4_K and Q6_K parts (``computes``)."""
    t_rows, k = x.shape
    n_sb = k // QK_K
    xq = np.empty((t_rows, LEVELS, k), np.int8)
    xq4 = np.empty((t_rows, LEVELS, k), np.int8)  # the same in Q4_K's run order
    dv4 = np.empty((t_rows, n_sb * 4 * _PER_VECTOR), np.float32)
    dv6 = np.empty((t_rows, n_sb * 4 * _PER_VECTOR), np.float32)
    xsm = np.empty((t_rows, n_sb * 16), np.float32)  # -sum(rounded x) per 32 values, 8 per super-block
    xso = np.empty((t_rows, k // 16), np.float32)  # -32 sum(rounded x) per 16 values
    _prepare(x, w, xq, xq4, dv4, dv6, xsm, xso)
    xqf, xq4f = xq.reshape(-1), xq4.reshape(-1)
    dv4f, dv6f, xsmf, xsof = dv4.reshape(-1), dv6.reshape(-1), xsm.reshape(-1), xso.reshape(-1)
    xs, ds, ss, so = LEVELS * k, dv4.shape[1], xsm.shape[1], xso.shape[1]
    n_rows = w.n_rows
    n_chunks = min(n_rows, MAX_CHUNKS)
    for c in nb.prange(n_chunks):
        for r in range(c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks):
            at, gtype = block_row(w, r)
            fours = t_rows - t_rows % ROWS_AT_ONCE
            for t in range(0, fours, ROWS_AT_ONCE):  # prompt rows, four to a pass over the weight row
                if gtype == T_Q4_K:
                    o = _q4_k_rows4(w.raw, at, n_sb, xq4f, t * xs, xs, k, dv4f, t * ds, ds, xsmf, t * ss, ss)
                else:
                    o = _q6_k_rows4(w.raw, at, n_sb, xqf, t * xs, xs, k, dv6f, t * ds, ds, xsof, t * so, so)
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = o
            for t in range(fours, t_rows):
                x0 = t * LEVELS * k
                if gtype == T_Q4_K:
                    out[t, r] = _q4_k_row(w.raw, at, n_sb, xq4f, x0, k, dv4[t], xsm[t])
                else:
                    out[t, r] = _q6_k_row(w.raw, at, n_sb, xqf, x0, k, dv6[t], xso[t])
