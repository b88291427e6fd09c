"""Grouped-query attention over a slotted KV cache.

The cache holds every slot's keys and values: ``k_cache[slot, layer, position, kv_head, dim]``, as
halves (``colibri.store.halves``: uint16 bits, rounded when a row is stored, widened when it is
read) or float32.
A forward step is a ragged batch: row t belongs to slot ``slots[t]`` at position ``positions[t]``,
so one call serves a prefill (many rows, one slot), a batched decode (one row per slot) or both.
Rows first write their key and value, then attend causally to positions ``0..positions[t]`` of
their own slot.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.ops import exp_from_peak
from colibri.store.halves import loaded, stored
from colibri.store.numerics import KERNEL


@nb.njit(**KERNEL)
def store_kv(
    k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, n_kv: int, head_dim: int,
) -> None:
    """Write the step's keys and values (T, n_kv * head_dim, float32) into their slots' caches, in
    the caches' type.

    Every row's slot and position, and the layer, are checked against the cache before anything is
    written, in every build: numba indexes without bounds checks, and a position past ``--ctx``
    writes into the next layer's rows, another slot's, or past the mapping (a segfault). The
    check is one comparison per row beside its n_kv * head_dim stores. It is not a debug switch (an
    environment variable, numba's ``boundscheck``): compiled code is cached by its sources' hash
    (``colibri/__init__.py``), not by options or globals, so a switch would silently load
    whichever build was cached first. Callers check the rows first with a message that names
    them (``KVCache.check_rows``); this IndexError is the last line."""
    if layer < 0 or layer >= k_cache.shape[1]:
        raise IndexError("store_kv: the layer is outside the KV cache")
    for t in range(k.shape[0]):
        if not (0 <= slots[t] < k_cache.shape[0] and 0 <= positions[t] < k_cache.shape[2]):
            raise IndexError("store_kv: a row's slot or position is outside the KV cache")
    for t in range(k.shape[0]):
        s, p = slots[t], positions[t]
        for h in range(n_kv):
            for d in range(head_dim):
                k_cache[s, layer, p, h, d] = stored(k_cache, k[t, h * head_dim + d])
                v_cache[s, layer, p, h, d] = stored(v_cache, v[t, h * head_dim + d])


@nb.njit(**KERNEL)
def _attend_row(q: np.ndarray, keys: np.ndarray, values: np.ndarray, position: int, h: int,
                kh: int, out: np.ndarray, scratch: np.ndarray) -> None:
    """One row's query head ``h`` (``q``: the row) against kv head kh of its slot and layer
    (``keys``, ``values``: [position, kv_head, dim]) over positions ``0..position``, into ``out``
    (the row); ``scratch``: float32 [2, > position].

    Plain loops, no copies and no BLAS call: their fixed costs were most of a decode row's
    attention (14 us a layer at position 40, now 4-6). Each inner loop indexes a 1-D row by its
    ``range``: an index numba cannot prove non-negative gets a wraparound select per element, and
    LLVM then loads the row with gathers (5x slower)."""
    head_dim, n = keys.shape[2], position + 1
    qh, oh = q[h * head_dim : (h + 1) * head_dim], out[h * head_dim : (h + 1) * head_dim]
    scale = np.float32(1.0 / np.sqrt(head_dim))
    scores, e = scratch[0, :n], scratch[1, :n]
    for p in range(n):
        key = keys[p, kh]
        acc = np.float32(0.0)
        for i in range(head_dim):
            acc += qh[i] * loaded(key[i])
        scores[p] = acc * scale
    total = exp_from_peak(scores, e)
    oh[:] = 0.0
    for p in range(n):
        weight, value = e[p] / total, values[p, kh]
        for i in range(head_dim):
            oh[i] += weight * loaded(value[i])


@nb.njit(parallel=True, **KERNEL)
def _rows_parallel(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
                   slots: np.ndarray, positions: np.ndarray, n_heads: int, group: int,
                   out: np.ndarray) -> None:
    """Every row: one work item per row and query head, head-major: the threads split the items
    into equal runs, and a prompt's later rows cost more (more positions), so each run takes
    every row of its heads (row-major, one thread took the prompt's second half, ~3/4 of the
    work)."""
    t_rows = q.shape[0]
    for item in nb.prange(t_rows * n_heads):
        h, t = item // t_rows, item % t_rows
        s, position = slots[t], positions[t]
        scratch = np.empty((2, position + 1), np.float32)
        _attend_row(q[t], k_cache[s, layer], v_cache[s, layer], position, h, h // group, out[t], scratch)


@nb.njit(**KERNEL)
def attend(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
    slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, out: np.ndarray,
) -> None:
    """``out[t, head] = softmax(q·K / sqrt(d)) · V`` over the row's slot, causally.

    Every row, decode or prompt, is computed on its own, one query head per work item, by the
    same compiled loop whatever the batch, so its bits are too: a prompt run whole, in chunks or
    token by token gives bitwise the same attention (and, with the matmuls' integer path, the
    same logits). Prompt runs took two BLAS products per run and head until 2026-12-04: ~15% of
    a 512-token prefill faster, but their rows differed from the decode loop's in the last bits
    (8e-5 in the logits), which two activation levels then amplified (docs/performance.md).
    Small batches on the calling thread instead, where LLVM inlines and vectorizes the loop its
    own way, changed the last bit of some outputs."""
    # int64 indices whatever the caller's: one compiled loop, one set of bits
    _rows_parallel(q, k_cache, v_cache, layer, slots.astype(np.int64), positions.astype(np.int64),
                   n_heads, n_heads // n_kv, out)
