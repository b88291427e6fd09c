"""``out = x @ W.T`` on weights kept as the file's own blocks (``Kind.BLOCKS``: Q5, the K-quants,
IQ4, and stacks mixing them with anything).

Rows are decoded to float32 a few at a time (``colibri.store.blocks``), transposed so that rows are
SIMD lanes as in the packed path: GROUP rows for the *direct* path (decode rows; each lane's sum in
the same order whatever the batch), a tile of TILE_ROWS for BLAS on the *tiled* path (prompt rows).

The activations are rounded first the way llama.cpp's CPU backend rounds them for the row's block
type (its ``vec_dot_type``): to Q8_0's 32-value blocks with an f16 scale for the 32-value formats,
to Q8_K's 256-value blocks for the K-quants and IQ4_XS. Its dot products are integer sums of those
8-bit quants; ours are float sums of the same rounded values, equal up to float32 rounding. That
rounding moves a logit by more than the weights' own format does between the two engines, and
without it llama.cpp's near-ties flip (top-1 agreement on a Q6_K file: 0.93 without, see
docs/performance.md). Rounding is per activation row, so a row's result stays batch-independent.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from colibri.store.blocks import QK_K, T_IQ4_NL, T_IQ4_XS, T_Q2_K, T_Q5_0, T_Q5_1, T_Q6_K
from colibri.store.formats import BLOCK
from colibri.store.packed import GROUP, JIT_OPTIONS, T_Q4_0, T_Q4_1, T_Q8_0, Weight, dequantize_row

# Weight rows per BLAS tile: 256 rows of 1536 floats is 1.5 MB, about what L2 holds.
TILE_ROWS = 256
# Runs of row groups the direct path splits a matrix into for its threads (a constant: numba
# cannot cache code that asks for the thread count).
MAX_CHUNKS = 32

# The activation roundings, as indexes into the stack ``rounded_activations`` returns.
ACT_FLOAT, ACT_Q8_0, ACT_Q8_K = 0, 1, 2
N_ACTS = 3
Q8_MAX = np.float32(127.0)  # the 8-bit quants' largest magnitude

_JIT = JIT_OPTIONS


@nb.njit(inline="always", **_JIT)
def act_kind(gtype: int) -> int:
    """The rounding llama.cpp gives the activations a row of ``gtype`` meets."""
    if T_Q2_K <= gtype <= T_Q6_K or gtype == T_IQ4_XS:
        return ACT_Q8_K
    if gtype in (T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_IQ4_NL):
        return ACT_Q8_0
    return ACT_FLOAT


@nb.njit(inline="always", **_JIT)
def to_half(v: np.float32) -> np.float32:
    """``v`` rounded to the nearest IEEE half (ties to even), as float32: llama.cpp's f16 scale."""
    if v == 0.0:
        return np.float32(0.0)
    _, e = math.frexp(v)
    ulp = math.ldexp(1.0, max(e - 11, -24))  # 11 significant bits; f16 subnormals below 2**-14
    return np.float32(np.rint(np.float64(v) / ulp) * ulp)


@nb.njit(**_JIT)
def _round_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    """ggml-cpu's quantize_row_q8_0 (its AVX path), dequantized: d = amax / 127 kept as f16, the
    quants rint(x * 127 / amax)."""
    for b in range(x.shape[0] // BLOCK):
        amax = np.float32(0.0)
        for j in range(BLOCK):
            amax = max(amax, abs(x[b * BLOCK + j]))
        d = to_half(amax / Q8_MAX)
        inv = Q8_MAX / amax if amax != 0.0 else np.float32(0.0)
        for j in range(BLOCK):
            out[b * BLOCK + j] = d * np.float32(np.rint(x[b * BLOCK + j] * inv))


@nb.njit(**_JIT)
def _round_q8_k(x: np.ndarray, out: np.ndarray) -> None:
    """quantize_row_q8_K_ref, dequantized: the scale from the value of largest magnitude (the first
    such, with its sign), a float32 d."""
    for b in range(x.shape[0] // QK_K):
        amax, vmax = np.float32(0.0), np.float32(0.0)
        for j in range(QK_K):
            if abs(x[b * QK_K + j]) > amax:
                amax, vmax = abs(x[b * QK_K + j]), x[b * QK_K + j]
        if amax == 0.0:
            out[b * QK_K : (b + 1) * QK_K] = 0.0
            continue
        iscale = -Q8_MAX / vmax
        d = np.float32(1.0) / iscale
        for j in range(QK_K):
            out[b * QK_K + j] = d * np.float32(min(127.0, np.rint(iscale * x[b * QK_K + j])))


@nb.njit(**_JIT)
def rounded_activations(x: np.ndarray) -> np.ndarray:
    """``x`` as each row kind meets it: [N_ACTS, T, K]."""
    t_rows, k_cols = x.shape
    xs = np.empty((N_ACTS, t_rows, k_cols), np.float32)
    for t in range(t_rows):
        xs[ACT_FLOAT, t] = x[t]
        _round_q8_0(x[t], xs[ACT_Q8_0, t])
        if k_cols % QK_K == 0:
            _round_q8_k(x[t], xs[ACT_Q8_K, t])
        else:  # no K-quant row can have this width
            xs[ACT_Q8_K, t] = x[t]
    return xs


@nb.njit(**_JIT)
def _decode_rows_t(w: Weight, r0: int, r1: int, row: np.ndarray, tile_t: np.ndarray) -> None:
    """Rows ``r0..r1`` decoded into the columns of ``tile_t[K, :]``."""
    for r in range(r0, r1):
        dequantize_row(w.raw[w.row_at[r]:], w.row_type[r], row)
        for k in range(row.shape[0]):
            tile_t[k, r - r0] = row[k]


@nb.njit(**_JIT)
def _group(w: Weight, xs: np.ndarray, r0: int, r1: int, tile_t: np.ndarray, acc: np.ndarray,
           out: np.ndarray) -> None:
    """Rows r0..r1 (decoded in ``tile_t``) against every activation row, once per rounding the
    group's rows need (a group straddling two stacked parts may need two)."""
    lanes = tile_t.shape[1]  # a run-time trip count: see quant_matmul's LANES_AT_RUN_TIME
    for a in range(N_ACTS):
        needed = False
        for r in range(r0, r1):
            needed = needed or act_kind(w.row_type[r]) == a
        if not needed:
            continue
        for t in range(xs.shape[1]):
            acc[:] = 0.0
            xt = xs[a, t]
            for k in range(xt.shape[0]):
                xv, tk = xt[k], tile_t[k]
                for r in range(lanes):
                    acc[r] += tk[r] * xv
            for r in range(r0, r1):
                if act_kind(w.row_type[r]) == a:
                    out[t, r] = acc[r - r0]


@nb.njit(parallel=True, **_JIT)
def direct_blocks(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    xs = rounded_activations(x)
    n_groups = -(-w.n_rows // GROUP)
    n_chunks = min(n_groups, MAX_CHUNKS)
    for c in nb.prange(n_chunks):
        row = np.empty(x.shape[1], np.float32)
        tile_t = np.zeros((x.shape[1], GROUP), np.float32)
        acc = np.empty(GROUP, np.float32)
        for g in range(c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks):
            r0, r1 = g * GROUP, min(w.n_rows, (g + 1) * GROUP)
            _decode_rows_t(w, r0, r1, row, tile_t)
            _group(w, xs, r0, r1, tile_t, acc, out)


@nb.njit(parallel=True, **_JIT)
def tiled_blocks(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """Tiles cut where the rows' rounding changes, so that each is one BLAS call."""
    xs = rounded_activations(x)
    for c in nb.prange(-(-w.n_rows // TILE_ROWS)):
        r0, end = c * TILE_ROWS, min(w.n_rows, (c + 1) * TILE_ROWS)
        row = np.empty(x.shape[1], np.float32)
        while r0 < end:
            a = act_kind(w.row_type[r0])
            r1 = r0 + 1
            while r1 < end and act_kind(w.row_type[r1]) == a:
                r1 += 1
            tile_t = np.empty((x.shape[1], r1 - r0), np.float32)
            _decode_rows_t(w, r0, r1, row, tile_t)
            out[:, r0:r1] = np.dot(xs[a], tile_t)
            r0 = r1
