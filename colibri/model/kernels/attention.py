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

_JIT = dict(nogil=True, cache=True, fastmath=True)


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
    for i in range(scores.shape[0]):
        row, n = scores[i], last[i] + 1
        best = np.float32(-np.inf)
        for p in range(n):
            row[p] *= scale
            best = max(best, row[p])
        total = np.float32(0.0)
        for p in range(n):
            e = np.exp(row[p] - best)
            row[p] = e
            total += e
        for p in range(n):
            row[p] /= total
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


@nb.njit(parallel=True, **_JIT)
def attend(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
    slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, head_dim: int,
    n_direct: int, out: np.ndarray,
) -> None:
    """``out[t, head] = softmax(q·K / sqrt(d)) · V`` over the row's slot, causally.

    A decode row (``[0, n_direct)``) is computed on its own, per kv head: the query heads that
    share it are the rows of the products, the same shapes whatever the batch. The prompt rows
    that follow come as runs of one slot each (a prefill chunk): per run and query head, the
    scores of all its rows are one matrix product, and so is their sum of values."""
    group = n_heads // n_kv
    for item in nb.prange(n_direct * n_kv):  # a decode row: the same shapes whatever the batch
        t, kh = item // n_kv, item % n_kv
        span = slice(kh * group * head_dim, (kh + 1) * group * head_dim)
        heads = np.ascontiguousarray(q[t, span]).reshape(group, head_dim)
        out[t, span] = _attend_rows(heads, k_cache, v_cache, layer, slots[t], kh,
                                    np.full(group, positions[t], np.int64)).reshape(-1)
    starts = np.empty(q.shape[0] - n_direct + 1, np.int64)  # runs of prompt rows of one slot
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
