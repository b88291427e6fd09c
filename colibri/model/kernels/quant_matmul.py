"""``out = x @ W.T`` for every kind of weight, the one call the layers make.

- Packed Q4, Q5 and Q8 (``colibri.store.packed``: the legacy formats, and the others re-expressed in
  their lanes): decode rows by integer dot products on 8-bit activations (``int8_matmul``), each
  row computed alone; prompt rows *tiled*: a tile of weight rows dequantized into float32 once and
  multiplied by BLAS (``np.dot`` inside numba) for every prompt row, the whole matrix never
  expanded. A prompt's logits are then float32's whatever the chunking (``tests/test_golden.py``).
- Weights kept as the file's blocks (``Kind.BLOCKS``: the expert store's in-place K-quants):
  decode rows of Q4_K and Q6_K by integer dot products on the blocks (``kquant_matmul``); other
  formats' decode rows decoded to float32 a few rows at a time (``block_matmul``), prompt rows
  tiled through BLAS.
- Float formats widened to float32: BLAS.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.block_matmul import TILE_ROWS, direct_blocks, tiled_blocks
from colibri.model.kernels.int8_matmul import int8_matmul
from colibri.model.kernels.kquant_matmul import computes, kquant_matmul
from colibri.store.blocks import F16_TABLE
from colibri.store.formats import BLOCK
from colibri.store.packed import (
    GROUP,
    JIT_OPTIONS,
    KIND_BLOCKS,
    KIND_F32,
    KIND_Q4,
    KIND_Q5,
    OFFSET_Q4,
    OFFSET_Q5,
    OFFSET_Q8,
    Q4_BYTES,
    QUAD,
    Weight,
    nibbles,
)

# Quant j of a Q4 block shares its byte with quant j + PAIR.
PAIR = BLOCK // 2


@nb.njit(inline="always", **JIT_OPTIONS)
def _bit(v: np.float32, p: int) -> np.float32:
    """Bit ``p`` of a byte held as float32 (float arithmetic, as ``nibbles``)."""
    t = np.floor(v * np.float32(1.0 / (1 << p)))
    return t - np.float32(2.0) * np.floor(t * np.float32(0.5))


@nb.njit(inline="always", **JIT_OPTIONS)
def _five_columns(w: Weight, g: int, b: int, d: np.ndarray, m: np.ndarray, tile_t: np.ndarray,
                  o: int) -> None:
    """Block ``b`` of group ``g`` of a Q5 weight into ``tile_t``'s columns ``o..o + GROUP``."""
    fifths = w.q[g, b, Q4_BYTES // QUAD]
    for j in range(Q4_BYTES):
        qj = w.q[g, b, j // QUAD]
        p = j // QUAD
        for r in range(GROUP):
            lo, hi = nibbles(qj[QUAD * r + j % QUAD])
            h = np.float32(fifths[QUAD * r + j % QUAD])
            lo += np.float32(16.0) * _bit(h, p)
            hi += np.float32(16.0) * _bit(h, 4 + p)
            tile_t[b * BLOCK + j, o + r] = d[r] * lo + m[r]
            tile_t[b * BLOCK + PAIR + j, o + r] = d[r] * hi + m[r]


@nb.njit(parallel=True, **JIT_OPTIONS)
def _tiled(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    n_groups, n_blocks, per = w.q.shape[0], w.q.shape[1], w.q.shape[2] * QUAD  # per: bytes per block
    per_tile = TILE_ROWS // GROUP
    for c in nb.prange((n_groups + per_tile - 1) // per_tile):
        g0 = c * per_tile
        g1 = min(n_groups, g0 + per_tile)
        # tile_t[k, lane]: the tile's rows as columns, so that the writes run along the lanes
        tile_t = np.empty((x.shape[1], (g1 - g0) * GROUP), np.float32)
        d = np.empty(GROUP, np.float32)
        m = np.empty(GROUP, np.float32)
        off = OFFSET_Q4 if w.kind == KIND_Q4 else OFFSET_Q5 if w.kind == KIND_Q5 else OFFSET_Q8
        for g in range(g0, g1):
            o = (g - g0) * GROUP
            for b in range(n_blocks):
                for r in range(GROUP):
                    if w.dh.size:  # the file's halves
                        d[r] = F16_TABLE[w.dh[g, b, r]]
                        m[r] = F16_TABLE[w.mh[g, b, r]] if w.mh.size else off * d[r]
                    else:
                        d[r] = w.d[g, b, r]
                        m[r] = w.m[g, b, r] if w.m.size else off * d[r]
                if w.kind == KIND_Q5:
                    _five_columns(w, g, b, d, m, tile_t, o)
                    continue
                for j in range(per):
                    qj = w.q[g, b, j // QUAD]
                    if w.kind == KIND_Q4:
                        for r in range(GROUP):
                            lo, hi = nibbles(qj[QUAD * r + j % QUAD])
                            tile_t[b * BLOCK + j, o + r] = d[r] * lo + m[r]
                            tile_t[b * BLOCK + PAIR + j, o + r] = d[r] * hi + m[r]
                    else:
                        for r in range(GROUP):
                            tile_t[b * per + j, o + r] = d[r] * np.float32(qj[QUAD * r + j % QUAD]) + m[r]
        res = np.dot(x, tile_t)
        r0 = g0 * GROUP
        rows = min(w.n_rows, g1 * GROUP) - r0
        out[:, r0 : r0 + rows] = res[:, :rows]


@nb.njit(**JIT_OPTIONS)
def qmatmul(x: np.ndarray, w: Weight, out: np.ndarray, n_direct: int) -> None:
    """``out[T, N] = x[T, K] @ W.T``: rows ``[0, n_direct)`` are decode rows, the rest prompt rows.

    The caller chooses per row, not per batch, so that a decode row's result does not depend on
    what else is in the step: a request gives the same tokens alone or batched with fifteen others.
    """
    if w.kind == KIND_F32:
        for t in range(n_direct):  # one BLAS call per decode row: its rounding ignores the batch
            out[t] = np.dot(w.f, x[t])
        if n_direct < x.shape[0]:
            out[n_direct:] = np.dot(x[n_direct:], w.f.T)
        return
    if w.kind == KIND_BLOCKS:
        if n_direct > 0 and computes(w):  # Q4_K and Q6_K: integer dot products on the blocks
            kquant_matmul(x[:n_direct], w, out[:n_direct])
        elif n_direct > 0:
            direct_blocks(x[:n_direct], w, out[:n_direct])
        if n_direct < x.shape[0]:
            tiled_blocks(x[n_direct:], w, out[n_direct:])
        return
    if n_direct > 0:
        int8_matmul(x[:n_direct], w, out[:n_direct])
    if n_direct < x.shape[0]:
        _tiled(x[n_direct:], w, out[n_direct:])
