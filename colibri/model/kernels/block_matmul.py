"""``out = x @ W.T`` on weights kept as the file's own blocks (``Kind.BLOCKS``: Q5, the K-quants,
IQ4, and stacks mixing them with anything).

Rows are decoded to float32 a few at a time (``colibri.store.blocks``), transposed so that rows are
SIMD lanes as in the packed path: GROUP rows for the *direct* path (decode rows; each lane's sum in
the same order whatever the batch), a tile of TILE_ROWS for BLAS on the *tiled* path (prompt rows).

The activations stay float32. llama.cpp rounds them to 8 bits first (Q8_0 or Q8_K blocks); done
here too, that rounding made our own decode and prefill logits differ by up to ~1 on the default
model's K-quant files (a hair's difference before rounding flips a quant, and the model amplifies
it), where float activations give the same logits both ways; llama.cpp's own token-by-token and
batched logits differ by as much (docs/performance.md, "K-quants against llama.cpp").
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.store.blocks import dequantize_row
from colibri.store.numerics import KERNEL
from colibri.store.packed import GROUP, Weight, block_row

# Weight rows per BLAS tile: 256 rows of 1536 floats is 1.5 MB, about what L2 holds.
TILE_ROWS = 256
# Runs of row groups the direct path splits a matrix into for its threads (a constant: numba
# cannot cache code that asks for the thread count).
MAX_CHUNKS = 32


@nb.njit(**KERNEL)
def _decode_rows_t(w: Weight, r0: int, r1: int, row: np.ndarray, tile_t: np.ndarray) -> None:
    """Rows ``r0..r1`` decoded into the columns of ``tile_t[K, :]``."""
    for r in range(r0, r1):
        at, gtype = block_row(w, r)
        dequantize_row(w.raw[at:], gtype, row)
        for k in range(row.shape[0]):
            tile_t[k, r - r0] = row[k]


@nb.njit(parallel=True, **KERNEL)
def direct_blocks(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    t_rows, k_cols = x.shape
    n_groups = -(-w.n_rows // GROUP)
    n_chunks = min(n_groups, MAX_CHUNKS)
    for c in nb.prange(n_chunks):
        row = np.empty(k_cols, np.float32)
        tile_t = np.zeros((k_cols, GROUP), np.float32)
        acc = np.empty(GROUP, np.float32)
        lanes = tile_t.shape[1]  # a run-time trip count: see quant_matmul's LANES_AT_RUN_TIME
        for g in range(c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks):
            r0, r1 = g * GROUP, min(w.n_rows, (g + 1) * GROUP)
            _decode_rows_t(w, r0, r1, row, tile_t)
            for t in range(t_rows):
                acc[:] = 0.0
                xt = x[t]
                for k in range(k_cols):
                    xv, tk = xt[k], tile_t[k]
                    for r in range(lanes):
                        acc[r] += tk[r] * xv
                for r in range(r1 - r0):
                    out[t, r0 + r] = acc[r]


@nb.njit(parallel=True, **KERNEL)
def tiled_blocks(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    for c in nb.prange(-(-w.n_rows // TILE_ROWS)):
        r0, r1 = c * TILE_ROWS, min(w.n_rows, (c + 1) * TILE_ROWS)
        row = np.empty(x.shape[1], np.float32)
        tile_t = np.empty((x.shape[1], r1 - r0), np.float32)
        _decode_rows_t(w, r0, r1, row, tile_t)
        out[:, r0:r1] = np.dot(x, tile_t)
