"""Grouped-query attention over a slotted KV cache.

The cache holds every slot's keys and values: ``k_cache[slot, layer, position, kv_head, dim]``, as
halves (``colibri.store.halves``: uint16 bits, rounded when a row is stored, widened when it is
read) or float32. A latent attention's cache (MLA) holds keys only, ``v_cache`` 0 values wide: a
token's value is its key's first values (the latent), as many as ``out`` has per head.
A forward step is a ragged batch: row t belongs to slot ``slots[t]`` at position ``positions[t]``,
so one call serves a prefill (many rows, one slot), a batched decode (one row per slot) or both.
Rows first write their key and value, then attend causally to positions ``0..positions[t]`` of
their own slot.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.ops import exp_from_peak
from colibri.model.kernels.simd import (
    LANES,
    add_float,
    fma_float,
    load_part,
    load_widened,
    mul_float,
    splat_float,
    store_floats,
    sum_lanes,
    sum_lanes4,
    sum_lanes16,
    zeros_float,
)
from colibri.store.halves import stored
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
    keys_only = v_cache.shape[4] == 0  # (MLA: the values are the keys' latent)
    for t in range(k.shape[0]):
        s, p = slots[t], positions[t]
        for h in range(n_kv):
            for d in range(head_dim):
                k_cache[s, layer, p, h, d] = stored(k_cache, k[t, h * head_dim + d])
                if not keys_only:
                    v_cache[s, layer, p, h, d] = stored(v_cache, v[t, h * head_dim + d])


# Query heads of one kv head taken together (grouped-query attention): each key and value is
# loaded and widened once for up to this many heads, and their four sums reduced in one tree.
HEADS = 4


@nb.njit(inline="always", **KERNEL)
def _lanes(row, at: int, c: int, width: int):  # noqa: ANN001, ANN202
    """Lanes ``c .. c + 16`` of the ``width`` values from ``row[at]`` as float32, zeros past
    ``width`` (a head's last, partial vector; none at all from ``c >= width``)."""
    if c + LANES <= width:
        return load_widened(row, at + c)
    return load_part(row, at + c, width - c)


@nb.njit(inline="always", **KERNEL)
def _dot_lanes(q, q0, keys, at: int, head_dim: int, m: int):  # noqa: ANN001, ANN202
    """Query heads ``q0, q0 + head_dim, ..`` (m of them, 1..HEADS) times the key at ``at``, lane by
    lane, before the sum across lanes: each head's products in two sums (a vector's even and odd
    runs of 16 values: one head alone is not one chain of dependent multiply-adds), added."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zeros_float()
    for c in range(0, head_dim, 2 * LANES):
        k, u = _lanes(keys, at, c, head_dim), _lanes(keys, at, c + LANES, head_dim)
        a0 = fma_float(_lanes(q, q0, c, head_dim), k, a0)
        b0 = fma_float(_lanes(q, q0, c + LANES, head_dim), u, b0)
        if m > 1:
            a1 = fma_float(_lanes(q, q0 + head_dim, c, head_dim), k, a1)
            b1 = fma_float(_lanes(q, q0 + head_dim, c + LANES, head_dim), u, b1)
        if m > 2:
            a2 = fma_float(_lanes(q, q0 + 2 * head_dim, c, head_dim), k, a2)
            b2 = fma_float(_lanes(q, q0 + 2 * head_dim, c + LANES, head_dim), u, b2)
        if m > 3:
            a3 = fma_float(_lanes(q, q0 + 3 * head_dim, c, head_dim), k, a3)
            b3 = fma_float(_lanes(q, q0 + 3 * head_dim, c + LANES, head_dim), u, b3)
    return add_float(a0, b0), add_float(a1, b1), add_float(a2, b2), add_float(a3, b3)


@nb.njit(inline="always", **KERNEL)
def _dots(q, q0, keys, at: int, head_dim: int, m: int):  # noqa: ANN001, ANN202
    """``_dot_lanes`` summed across lanes: the m heads' dot products with one key. Each head's sum
    takes the same steps whatever ``m`` (``sum_lanes4`` adds as ``sum_lanes``)."""
    s0, s1, s2, s3 = _dot_lanes(q, q0, keys, at, head_dim, m)
    if m == 1:  # (a kv head of one query head)
        return sum_lanes(s0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    return sum_lanes4(s0, s1, s2, s3)


@nb.njit(inline="always", **KERNEL)
def _scores16(q, q0, keys, at0: int, stride: int, head_dim: int, m: int, scale32, partial,  # noqa: ANN001
              scores, p: int) -> None:
    """``scores[j, p .. p + 16]`` for the m heads: 16 keys' lane products kept (``partial``), then
    summed 16 at a time by one transposing tree, each sum in ``_dots``'s order (the same bits as
    one key at a time, for a third of the additions and shuffles)."""
    for i in range(LANES):
        s0, s1, s2, s3 = _dot_lanes(q, q0, keys, at0 + i * stride, head_dim, m)
        store_floats(partial, i, 0, s0, LANES)
        if m > 1:
            store_floats(partial, LANES + i, 0, s1, LANES)
        if m > 2:
            store_floats(partial, 2 * LANES + i, 0, s2, LANES)
        if m > 3:
            store_floats(partial, 3 * LANES + i, 0, s3, LANES)
    for j in range(m):
        sums = sum_lanes16(partial, j * LANES * LANES)
        store_floats(scores, j, p, mul_float(sums, splat_float(scale32)), LANES)


@nb.njit(inline="always", **KERNEL)
def _weighted(values, e, m: int, n: int, at0: int, stride: int, c: int, head_dim: int):  # noqa: ANN001, ANN202
    """``sum_p e[j, p] value_p[c : c + 32]`` over positions p < n for heads j < m: two vectors
    per head, each value vector loaded and widened once for all m."""
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = zeros_float()
    for p in range(n):
        at = at0 + p * stride
        v0, v1 = _lanes(values, at, c, head_dim), _lanes(values, at, c + LANES, head_dim)
        w = splat_float(e[0, p])
        a0, a1 = fma_float(w, v0, a0), fma_float(w, v1, a1)
        if m > 1:
            w = splat_float(e[1, p])
            b0, b1 = fma_float(w, v0, b0), fma_float(w, v1, b1)
        if m > 2:
            w = splat_float(e[2, p])
            c0, c1 = fma_float(w, v0, c0), fma_float(w, v1, c1)
        if m > 3:
            w = splat_float(e[3, p])
            d0, d1 = fma_float(w, v0, d0), fma_float(w, v1, d1)
    return a0, a1, b0, b1, c0, c1, d0, d1


@nb.njit(**KERNEL)
def _attend_heads(q: np.ndarray, keys: np.ndarray, values: np.ndarray, lo: int, n: int, h0: int,
                  m: int, kh: int, scale: float, out: np.ndarray, v_dim: int, sinks: np.ndarray) -> None:
    """Query heads ``h0 .. h0 + m`` of one row (``q``; ``out``: its output, [1, n_heads * v_dim])
    against kv head ``kh`` of its slot and layer (``keys``, ``values``: [position, kv_head, dim],
    the same layout; a value is its first ``v_dim`` values) over positions ``lo..lo+n-1``:
    ``out = softmax(scale · q·K) · V`` per head. ``sinks`` (one logit a query head, or empty): a
    score with no value, one more term in each softmax's denominator (gpt-oss)."""
    head_dim, stride = keys.shape[2], keys.shape[1] * keys.shape[2]
    scale32 = np.float32(scale)
    n_s = n + 1 if sinks.shape[0] > 0 else n  # the sink's score last, weighing no value
    scores, e = np.empty((m, n_s), np.float32), np.empty((m, n_s), np.float32)
    partial = np.empty((HEADS * LANES, LANES), np.float32)
    q0, at0 = h0 * head_dim, lo * stride + kh * head_dim
    whole = n - n % LANES
    for p in range(0, whole, LANES):
        _scores16(q, q0, keys, at0 + p * stride, stride, head_dim, m, scale32, partial, scores, p)
    for p in range(whole, n):
        sums = _dots(q, q0, keys, (lo + p) * stride + kh * head_dim, head_dim, m)
        for j in range(m):
            scores[j, p] = sums[j] * scale32
    if n_s > n:
        for j in range(m):
            scores[j, n] = sinks[h0 + j]
    inv = np.empty(HEADS, np.float32)
    for j in range(m):
        inv[j] = np.float32(1.0) / exp_from_peak(scores[j], e[j])
    for c in range(0, v_dim, 2 * LANES):
        sums8 = _weighted(values, e, m, n, lo * stride + kh * head_dim, stride, c, v_dim)
        for j in range(m):
            at = (h0 + j) * v_dim + c
            store_floats(out, 0, at, mul_float(sums8[2 * j], splat_float(inv[j])), v_dim - c)
            store_floats(out, 0, at + LANES, mul_float(sums8[2 * j + 1], splat_float(inv[j])),
                         v_dim - c - LANES)


@nb.njit(parallel=True, **KERNEL)
def _rows_parallel(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
                   slots: np.ndarray, positions: np.ndarray, n_heads: int, group: int,
                   scale: float, window: int, out: np.ndarray, sinks: np.ndarray) -> None:
    """Every row: one work item per row and block of up to HEADS query heads of one kv head,
    head-major: the threads split the items into equal runs, and a prompt's later rows cost more
    (more positions), so each run takes every row of its heads (row-major, one thread took the
    prompt's second half, ~3/4 of the work). Blocks, not single heads, even for one decode row:
    fewer items, but each key read once for four heads (one row at position 511: 45-50 against
    67-75 us with a head an item, 16 heads of 128 over 4 kv heads)."""
    t_rows, n_kv = q.shape[0], n_heads // group
    blocks = (group + HEADS - 1) // HEADS  # of each kv head's query heads
    v_dim = out.shape[1] // n_heads
    values = v_cache if v_cache.shape[4] > 0 else k_cache  # keys only (MLA): the value is the latent
    for item in nb.prange(t_rows * n_kv * blocks):
        b, t = item // t_rows, item % t_rows
        kh, j0 = b // blocks, b % blocks * HEADS
        s, lo = slots[t], 0
        if window > 0:
            lo = max(0, positions[t] + 1 - window)
        _attend_heads(q[t], k_cache[s, layer], values[s, layer], lo, positions[t] + 1 - lo,
                      kh * group + j0, min(HEADS, group - j0), kh, scale, out[t : t + 1], v_dim, sinks)


@nb.njit(**KERNEL)
def attend(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
    slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, out: np.ndarray,
    scale: float = 0.0, window: int = 0, sinks: np.ndarray | None = None,
) -> None:
    """``out[t, head] = softmax(scale · q·K) · V`` over the row's slot, causally; ``scale`` 0:
    ``1 / sqrt(head_dim)``. ``out`` is [rows, n_heads * v_dim]: a value's width (the keys' where
    the cache has values; a latent's, the keys' first v_dim values, where it holds keys only).
    ``window`` > 0: a row at position p attends to positions ``p - window + 1 .. p`` only
    (sliding-window layers: the work of a row is bounded by the window, whatever the context), as
    llama.cpp's standard SWA masks them. ``sinks``: a logit per query head joining each softmax
    with no value (gpt-oss's attention sinks: a head may attend to nothing).

    Every row, decode or prompt, is computed on its own by the same compiled loop whatever the
    batch, so its bits are too: a prompt run whole, in chunks or token by token gives bitwise
    the same attention (and, with the matmuls' integer path, the same logits). The loop is
    written in explicit vectors (``simd``), each sum's order fixed, the query heads of a kv head
    sharing each key's and value's load: 1.6x the speed of the scalar loop LLVM vectorized
    (docs/performance.md), whose order was its own (small batches on the calling thread, where
    it inlined the loop differently, changed the last bit of some outputs). Prompt runs took two
    BLAS products per run and head until 2026-12-04: their rows differed from the decode loop's
    in the last bits (8e-5 in the logits), which two activation levels then amplified."""
    # int64 indices whatever the caller's: one compiled loop, one set of bits
    if scale == 0.0:
        scale = 1.0 / np.sqrt(k_cache.shape[4])
    logits = np.zeros(0, np.float32) if sinks is None else sinks
    _rows_parallel(q, k_cache, v_cache, layer, slots.astype(np.int64), positions.astype(np.int64),
                   n_heads, n_heads // n_kv, scale, window, out, logits)
