"""Grouped-query attention over a slotted KV cache.

The cache holds every slot's keys and values: ``k_cache[slot, layer, position, kv_head, dim]``.
A forward step is a ragged batch: row t belongs to slot ``slots[t]`` at position ``positions[t]``,
so one call serves a prefill (many rows, one slot), a batched decode (one row per slot) or both.
Rows first write their key and value, then attend causally to positions ``0..positions[t]`` of
their own slot.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.ops import exp_from_peak

_JIT = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")


@nb.njit(**_JIT)
def store_kv(
    k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, n_kv: int, head_dim: int,
) -> None:
    """Write the step's keys and values (T, n_kv * head_dim) into their slots' caches."""
    for t in range(k.shape[0]):
        s, p = slots[t], positions[t]
        for h in range(n_kv):
            for d in range(head_dim):
                k_cache[s, layer, p, h, d] = k[t, h * head_dim + d]
                v_cache[s, layer, p, h, d] = v[t, h * head_dim + d]


@nb.njit(**_JIT)
def _softmax_rows(scores: np.ndarray, scale: np.float32, last: np.ndarray) -> None:
    """Each row i of ``scores`` scaled, then softmax over its positions ``0..last[i]``; the rest 0."""
    e = np.empty(scores.shape[1], np.float32)
    for i in range(scores.shape[0]):
        row, n = scores[i], last[i] + 1
        for p in range(n):
            row[p] *= scale
        total = exp_from_peak(row[:n], e[:n])
        for p in range(n):
            row[p] = e[p] / total
        row[n:] = 0.0


@nb.njit(**_JIT)
def _attend_rows(queries: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int, s: int,
                 kh: int, last: np.ndarray) -> np.ndarray:
    """``softmax(Q Kᵀ / sqrt(d)) V`` for query rows ``queries`` (R, head_dim) against kv head kh of
    slot s, row i masked to positions ``0..last[i]``: two BLAS products over contiguous copies of
    the keys and values, read once for all R rows."""
    n = 0
    for p in last:
        n = max(n, p + 1)
    keys = np.ascontiguousarray(k_cache[s, layer, :n, kh])
    values = np.ascontiguousarray(v_cache[s, layer, :n, kh])
    scores = np.dot(queries, keys.T)
    _softmax_rows(scores, np.float32(1.0 / np.sqrt(queries.shape[1])), last)
    return np.dot(scores, values)


@nb.njit(**_JIT)
def _attend_decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray, position: int, h: int,
                   kh: int, out: np.ndarray, scratch: np.ndarray) -> None:
    """One decode row's query head ``h`` (``q``: the row) against kv head kh of its slot and layer
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
            acc += qh[i] * key[i]
        scores[p] = acc * scale
    total = exp_from_peak(scores, e)
    oh[:] = 0.0
    for p in range(n):
        weight, value = e[p] / total, values[p, kh]
        for i in range(head_dim):
            oh[i] += weight * value[i]


@nb.njit(parallel=True, **_JIT)
def _decode_parallel(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
                     slots: np.ndarray, positions: np.ndarray, n_heads: int, group: int,
                     n_direct: int, out: np.ndarray) -> None:
    """The decode rows ``[0, n_direct)``: one work item per row and query head."""
    for item in nb.prange(n_direct * n_heads):
        t, h = item // n_heads, item % n_heads
        s, position = slots[t], positions[t]
        scratch = np.empty((2, position + 1), np.float32)
        _attend_decode(q[t], k_cache[s, layer], v_cache[s, layer], position, h, h // group, out[t], scratch)


@nb.njit(parallel=True, **_JIT)
def _prompt_runs(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
                 slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, head_dim: int,
                 n_direct: int, out: np.ndarray) -> None:
    """The prompt rows ``[n_direct, T)``, as runs of one slot each (a prefill chunk): per run and
    query head, the scores of all its rows are one matrix product, and so is their sum of values."""
    group = n_heads // n_kv
    starts = np.empty(q.shape[0] - n_direct + 1, np.int64)
    n_runs = 0
    for t in range(n_direct, q.shape[0]):
        if t == n_direct or slots[t] != slots[t - 1]:
            starts[n_runs] = t
            n_runs += 1
    starts[n_runs] = q.shape[0]
    for item in nb.prange(n_runs * n_heads):
        r, h = item // n_heads, item % n_heads
        t0, t1 = starts[r], starts[r + 1]
        cols = slice(h * head_dim, (h + 1) * head_dim)
        out[t0:t1, cols] = _attend_rows(np.ascontiguousarray(q[t0:t1, cols]), k_cache, v_cache, layer,
                                        slots[t0], h // group, positions[t0:t1])


@nb.njit(**_JIT)
def attend(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
    slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, head_dim: int,
    n_direct: int, out: np.ndarray,
) -> None:
    """``out[t, head] = softmax(q·K / sqrt(d)) · V`` over the row's slot, causally.

    A decode row (``[0, n_direct)``) is computed on its own, one query head per work item, by the
    same compiled loop whatever the batch (so its bits are too: running small batches on the
    calling thread instead, where LLVM inlines and vectorizes the loop its own way, changed the
    last bit of some outputs; and one row at position 40 took 6.3 us that way against 6.0 across
    the threads). The prompt rows that follow take ``_prompt_runs``."""
    if n_direct > 0:  # int64 indices whatever the caller's: one compiled decode loop, one set of bits
        _decode_parallel(q, k_cache, v_cache, layer, slots[:n_direct].astype(np.int64),
                         positions[:n_direct].astype(np.int64), n_heads, n_heads // n_kv, n_direct, out)
    if n_direct < q.shape[0]:
        _prompt_runs(q, k_cache, v_cache, layer, slots, positions, n_heads, n_kv, head_dim, n_direct, out)
