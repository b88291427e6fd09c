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


@nb.njit(parallel=True, **_JIT)
def attend(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
    slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, head_dim: int,
    out: np.ndarray,
) -> None:
    """``out[t, head] = softmax(q·K / sqrt(d)) · V`` over the row's slot, causally."""
    t_rows = q.shape[0]
    group = n_heads // n_kv
    scale = np.float32(1.0 / np.sqrt(head_dim))
    for th in nb.prange(t_rows * n_heads):
        t = th // n_heads
        h = th % n_heads
        kh = h // group
        s, n = slots[t], positions[t] + 1
        qo = h * head_dim
        scores = np.empty(n, dtype=np.float32)
        best = np.float32(-np.inf)
        for p in range(n):
            acc = np.float32(0.0)
            for d in range(head_dim):
                acc += q[t, qo + d] * k_cache[s, layer, p, kh, d]
            acc *= scale
            scores[p] = acc
            best = max(best, acc)
        total = np.float32(0.0)
        for p in range(n):
            e = np.exp(scores[p] - best)
            scores[p] = e
            total += e
        for d in range(head_dim):
            out[t, qo + d] = 0.0
        for p in range(n):
            wgt = scores[p] / total
            for d in range(head_dim):
                out[t, qo + d] += wgt * v_cache[s, layer, p, kh, d]
