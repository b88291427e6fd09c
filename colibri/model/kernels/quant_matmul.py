"""``out = x @ W.T`` computed on W's packed blocks (``colibri.store.packed``), two ways.

The *direct* path, for a few activation rows (decode): the GROUP rows of a packed group are GROUP
SIMD lanes, so each quant position j is one vector of weights times one broadcast activation, with
no horizontal sums at all; a block's lane sums are scaled by d and offset by m once.

For many rows (prefill, big batches) the *tiled* path dequantizes a tile of rows into float32 and
lets BLAS (``np.dot`` inside numba) multiply: the expansion is paid once per tile and reused by
every activation row; the whole matrix is never expanded.

Q8 blocks hold 32 values, or 16 for the formats scaled per 16 values (Q2_K, Q3_K, Q6_K, packed
through ``colibri.store.lanes``). Weights kept as the file's blocks (``Kind.BLOCKS``: the expert
store's in-place copies) have their own two paths, in ``block_matmul``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.block_matmul import MAX_CHUNKS, TILE_ROWS, direct_blocks, tiled_blocks
from colibri.store.formats import BLOCK
from colibri.store.packed import (
    GROUP,
    JIT_OPTIONS,
    KIND_BLOCKS,
    KIND_F32,
    KIND_Q4,
    OFFSET_Q4,
    OFFSET_Q8,
    Weight,
    nibbles,
)

# LANES_AT_RUN_TIME: the Q8 lane loops take their trip count from an array shape, not from GROUP.
# With a constant 32, LLVM fully unrolls their short bodies into scalar code before the vectorizer
# sees them (the Q8_0 output head ran 4x slower); the Q4 bodies are long enough to stay loops.

_JIT = JIT_OPTIONS
# Quant j of a block pairs with quant j + PAIR: a Q4 byte's two nibbles, and Q8 the same way, so
# both kinds run the same two-FMA loop body.
PAIR = BLOCK // 2


@nb.njit(**_JIT)
def _direct_group(w: Weight, g: int, x: np.ndarray, xs: np.ndarray, lo: np.ndarray,
                  hi: np.ndarray, a: np.ndarray, acc: np.ndarray) -> None:
    """acc[t, r] = row GROUP*g + r of W dotted with activation row t.

    For each quant j of a block, the GROUP lanes (one per row) are multiplied by the same
    activation x[t, BLOCK*b + j]; the block's sum a[t, r] is then scaled once by d and offset by m.
    """
    t_rows, n_blocks = x.shape[0], w.q.shape[1]
    lanes = w.q.shape[3]  # == GROUP, for the Q8 loops: see LANES_AT_RUN_TIME
    per = w.q.shape[2]  # Q8: values per block, 32 or 16 (the formats scaled per 16 values)
    pair = per // 2
    acc[:, :] = 0.0
    for b in range(n_blocks):
        a[:, :] = 0.0
        qb = w.q[g, b]
        if w.kind == KIND_Q4 and t_rows == 1:  # one row: decode and multiply in one pass
            a0 = a[0]
            for j in range(PAIR):
                qj, xl, xh = qb[j], x[0, b * BLOCK + j], x[0, b * BLOCK + PAIR + j]
                for r in range(GROUP):
                    low, high = nibbles(qj[r])
                    a0[r] = (a0[r] + low * xl) + high * xh  # two FMAs, in this order on every path
        elif w.kind == KIND_Q4:  # decode once, for every activation row
            for j in range(PAIR):
                qj = qb[j]
                for r in range(GROUP):
                    lo[r], hi[r] = nibbles(qj[r])
                for t in range(t_rows):
                    at, xl, xh = a[t], x[t, b * BLOCK + j], x[t, b * BLOCK + PAIR + j]
                    for r in range(GROUP):
                        at[r] = (at[r] + lo[r] * xl) + hi[r] * xh
        elif t_rows == 1:  # Q8: quants j and j + per/2 paired, as Q4 pairs its nibbles
            a0 = a[0]
            for j in range(pair):
                ql, qh, xl, xh = qb[j], qb[j + pair], x[0, b * per + j], x[0, b * per + pair + j]
                for r in range(lanes):
                    a0[r] = (a0[r] + np.float32(ql[r]) * xl) + np.float32(qh[r]) * xh
        else:
            for j in range(pair):
                ql, qh = qb[j], qb[j + pair]
                for r in range(GROUP):
                    lo[r] = np.float32(ql[r])
                    hi[r] = np.float32(qh[r])
                for t in range(t_rows):
                    at, xl, xh = a[t], x[t, b * per + j], x[t, b * per + pair + j]
                    for r in range(GROUP):
                        at[r] = (at[r] + lo[r] * xl) + hi[r] * xh
        d = w.d[g, b]
        if w.m.size == 0:  # m = OFFSET d, not stored (packed.OFFSETS_Q4, OFFSETS_Q8)
            off = OFFSET_Q4 if w.kind == KIND_Q4 else OFFSET_Q8
            for t in range(t_rows):
                at, acc_t, xsum = a[t], acc[t], xs[t, b]
                for r in range(GROUP):
                    acc_t[r] += d[r] * at[r] + (off * d[r]) * xsum
        else:
            m = w.m[g, b]
            for t in range(t_rows):
                at, acc_t, xsum = a[t], acc[t], xs[t, b]
                for r in range(GROUP):
                    acc_t[r] += d[r] * at[r] + m[r] * xsum


@nb.njit(parallel=True, **_JIT)
def _direct(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    t_rows = x.shape[0]
    n_groups, n_blocks = w.q.shape[0], w.q.shape[1]
    xs = np.zeros((t_rows, n_blocks), np.float32)  # block sums of x, for the offsets m
    size = x.shape[1] // n_blocks  # values per block: 32, or 16
    for t in range(t_rows):
        for b in range(n_blocks):
            for i in range(size):
                xs[t, b] += x[t, b * size + i]
    n_chunks = min(n_groups, MAX_CHUNKS)
    for c in nb.prange(n_chunks):  # runs of groups, each with its scratch allocated once
        lo = np.empty(GROUP, np.float32)
        hi = np.empty(GROUP, np.float32)
        a = np.empty((t_rows, GROUP), np.float32)
        acc = np.empty((t_rows, GROUP), np.float32)
        for g in range(c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks):
            _direct_group(w, g, x, xs, lo, hi, a, acc)
            for r in range(min(GROUP, w.n_rows - g * GROUP)):
                for t in range(t_rows):
                    out[t, g * GROUP + r] = acc[t, r]


@nb.njit(parallel=True, **_JIT)
def _tiled(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    n_groups, n_blocks, per = w.q.shape[0], w.q.shape[1], w.q.shape[2]
    per_tile = TILE_ROWS // GROUP
    for c in nb.prange((n_groups + per_tile - 1) // per_tile):
        g0 = c * per_tile
        g1 = min(n_groups, g0 + per_tile)
        # tile_t[k, lane]: the tile's rows as columns, so that the writes run along the lanes
        tile_t = np.empty((x.shape[1], (g1 - g0) * GROUP), np.float32)
        m = np.empty(GROUP, np.float32)
        off = OFFSET_Q4 if w.kind == KIND_Q4 else OFFSET_Q8
        for g in range(g0, g1):
            o = (g - g0) * GROUP
            for b in range(n_blocks):
                d = w.d[g, b]
                for r in range(GROUP):
                    m[r] = off * d[r] if w.m.size == 0 else w.m[g, b, r]
                for j in range(per):
                    if w.kind == KIND_Q4:
                        for r in range(GROUP):
                            lo, hi = nibbles(w.q[g, b, j, r])
                            tile_t[b * BLOCK + j, o + r] = d[r] * lo + m[r]
                            tile_t[b * BLOCK + PAIR + j, o + r] = d[r] * hi + m[r]
                    else:
                        for r in range(GROUP):
                            tile_t[b * per + j, o + r] = d[r] * np.float32(w.q[g, b, j, r]) + m[r]
        res = np.dot(x, tile_t)
        r0 = g0 * GROUP
        rows = min(w.n_rows, g1 * GROUP) - r0
        out[:, r0 : r0 + rows] = res[:, :rows]


@nb.njit(**_JIT)
def qmatmul(x: np.ndarray, w: Weight, out: np.ndarray, n_direct: int) -> None:
    """``out[T, N] = x[T, K] @ W.T``: rows ``[0, n_direct)`` on the direct path, the rest tiled.

    The caller chooses per row, not per batch (decode rows direct, prompt rows tiled), so that a
    row's result does not depend on what else is in the step: a request gives the same tokens
    alone or batched with fifteen others.
    """
    if w.kind == KIND_F32:
        for t in range(n_direct):  # one BLAS call per decode row: its rounding ignores the batch
            out[t] = np.dot(w.f, x[t])
        if n_direct < x.shape[0]:
            out[n_direct:] = np.dot(x[n_direct:], w.f.T)
        return
    if w.kind == KIND_BLOCKS:
        if n_direct > 0:
            direct_blocks(x[:n_direct], w, out[:n_direct])
        if n_direct < x.shape[0]:
            tiled_blocks(x[n_direct:], w, out[n_direct:])
        return
    if n_direct > 0:
        _direct(x[:n_direct], w, out[:n_direct])
    if n_direct < x.shape[0]:
        _tiled(x[n_direct:], w, out[n_direct:])
