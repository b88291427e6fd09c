"""``out = x @ W.T`` for every kind of weight, the one call the layers make.

- Packed Q4, Q5 and Q8 (``colibri.store.packed``: the legacy formats, and the others re-expressed in
  their lanes): every row, decode or prompt, by integer dot products on 8-bit activations
  (``int8_matmul``), each row's sums the same steps whatever else is in the step, so a prompt
  run whole, in chunks or token by token gives the same matmul bits. Prompt rows were tiled
  (weight tiles dequantized to float32, then BLAS) until the integer path, four rows to a weight
  load, outran it at 512 rows (docs/performance.md, 2026-12-04).
- Weights kept as the file's blocks (``Kind.BLOCKS``: the expert store's experts of the formats it
  does not pack, ``experts.STORE_LANES``: Q2_K, Q3_K, IQ4): decode rows decoded to float32 a few
  rows at a time (``block_matmul``), prompt rows tiled through BLAS.
- Float formats widened to float32: BLAS.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.block_matmul import direct_blocks, tiled_blocks
from colibri.model.kernels.int8_matmul import int8_matmul
from colibri.store.numerics import KERNEL
from colibri.store.packed import KIND_BLOCKS, KIND_F32, Weight


@nb.njit(**KERNEL)
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
        if n_direct > 0:
            direct_blocks(x[:n_direct], w, out[:n_direct])
        if n_direct < x.shape[0]:
            tiled_blocks(x[n_direct:], w, out[n_direct:])
        return
    int8_matmul(x, w, out)  # decode and prompt rows alike: a row's result ignores the others
