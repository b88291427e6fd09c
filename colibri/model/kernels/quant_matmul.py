"""``out = x @ W.T`` computed on W's quantized blocks, two ways.

GGUF stores a matrix row by row, each row a run of 32-element blocks with their own scale. A
kernel walking a row must reduce every block horizontally, which SIMD does badly, so for decode
each quantized matrix is also *packed* at load: GROUP (32) rows are interleaved block by block,

    q[g, b, j, r]   quant j of block b of row 32*g + r   (Q4: a byte of two nibbles, Q8: q + 128)
    d[g, b, r]      that block's scale;  m[g, b, r] its offset (Q4_1's min, -8d Q4_0, -128d Q8_0)

so the 32 rows of a group are 32 SIMD lanes: each quant position j is one vector of weights times
one broadcast activation, with no horizontal sums at all. The bits stay 4- or 8-bit; only the
scales widen to float32. That is the *direct* path, for a few activation rows (decode).

For many rows (prefill, big batches) the *tiled* path dequantizes a tile of rows into float32 and
lets BLAS (``np.dot`` inside numba) multiply: the expansion is paid once per tile and reused by
every activation row; the whole matrix is never expanded.

numba widens integer arithmetic on small types to int64, which quarters the SIMD lanes; the kernels
therefore split nibbles in float32 arithmetic (``_nibbles``) and keep Q8_0's quants *biased* (stored
as ``q + 128``, an unsigned byte, with the offset ``m = -128 d``): a byte converts to float32 in one
vector instruction, where a signed one went through scalar code (~5x slower on the Q8_0 output head).
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.store.quant import GGMLType

# Weight rows per BLAS tile: 256 rows of 1536 floats is 1.5 MB, about what L2 holds.
TILE_ROWS = 256
# Runs of row groups the direct path splits a matrix into for its threads (a constant: numba
# cannot cache code that asks for the thread count).
MAX_CHUNKS = 32
# Rows interleaved by packing: the SIMD lanes of the direct path. 32, not 16 (one AVX-512
# vector): LLVM leaves the 16-trip lane loops scalar and vectorizes the 32-trip ones.
GROUP = 32
# LANES_AT_RUN_TIME: the Q8 lane loops take their trip count from an array shape, not from GROUP.
# With a constant 32, LLVM fully unrolls their short bodies into scalar code before the vectorizer
# sees them (the Q8_0 output head ran 4x slower); the Q4 bodies are long enough to stay loops.

KIND_F32, KIND_Q4, KIND_Q8 = 0, 1, 2

T_F32 = int(GGMLType.F32)
T_F16 = int(GGMLType.F16)
T_BF16 = int(GGMLType.BF16)
T_Q8_0 = int(GGMLType.Q8_0)
T_Q4_0 = int(GGMLType.Q4_0)
T_Q4_1 = int(GGMLType.Q4_1)

# IEEE half -> float32 for every bit pattern: numba has no float16 on the CPU, and a 256 KB table
# lookup is cheaper than decoding exponent and mantissa by hand.
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# fastmath without 'reassoc': no loop here needs reassociation (the lanes are independent), and
# without it a row's result is bitwise the same whether it is computed alone or in a batch.
_JIT = dict(nogil=True, cache=True, fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"})


class Weight(NamedTuple):
    """A matrix in the kernels' layout. One type for every format, so that a layer's weights
    form a homogeneous tuple for numba; the arrays a kind does not use are empty."""

    kind: int
    n_rows: int
    q: np.ndarray  # uint8 [G, nb, 16 (Q4: two nibbles) or 32 (Q8: q + 128), GROUP]
    d: np.ndarray  # float32 [G, nb, GROUP]
    m: np.ndarray  # float32 [G, nb, GROUP]
    f: np.ndarray  # float32 [N, K], for the float formats


_EMPTY_Q = np.zeros((0, 0, 0, 0), np.uint8)
_EMPTY_S = np.zeros((0, 0, 0), np.float32)
_EMPTY_F = np.zeros((0, 0), np.float32)


def _packed_kind(types: list[int]) -> int:
    kinds = {KIND_Q8 if t == T_Q8_0 else KIND_Q4 if t in (T_Q4_0, T_Q4_1) else KIND_F32 for t in types}
    return kinds.pop() if len(kinds) == 1 else KIND_F32


def packed_nbytes(parts: list[tuple[int, int]], n_cols: int) -> int:
    """Bytes ``make_weight`` will allocate for parts of (rows, block type), without reading them:
    the expert store budgets experts it has not packed yet."""
    kind, n_rows = _packed_kind([t for _, t in parts]), sum(rows for rows, _ in parts)
    if kind == KIND_F32:
        return n_rows * n_cols * 4
    per = 16 if kind == KIND_Q4 else 32  # quant bytes per block per row, then float32 d and m
    return -(-n_rows // GROUP) * GROUP * (n_cols // 32) * (per + 8)


def make_weight(parts: list[tuple[np.ndarray, int]], n_cols: int) -> Weight:
    """One matrix from the raw GGUF rows of one or more tensors stacked by rows (q, k and v
    become one matmul). Q4_0 and Q4_1 pack to Q4, Q8_0 to Q8; anything else, or a mix of
    kinds, is widened to float32."""
    kind, n_rows = _packed_kind([t for _, t in parts]), sum(raw.shape[0] for raw, _ in parts)
    if kind != KIND_F32:
        groups, n_blocks = -(-n_rows // GROUP), n_cols // 32
        q = np.zeros((groups, n_blocks, 16 if kind == KIND_Q4 else 32, GROUP), np.uint8)
        d = np.zeros((groups, n_blocks, GROUP), np.float32)
        m = np.zeros((groups, n_blocks, GROUP), np.float32)
        row = 0
        for raw, t in parts:
            _pack_rows(raw, t, row, q, d, m)
            row += raw.shape[0]
        return Weight(kind, n_rows, q, d, m, _EMPTY_F)
    f = np.empty((n_rows, n_cols), np.float32)
    row = 0
    for raw, t in parts:
        for r in range(raw.shape[0]):
            dequantize_row(raw[r], t, f[row])
            row += 1
    return Weight(KIND_F32, n_rows, _EMPTY_Q, _EMPTY_S, _EMPTY_S, f)


@nb.njit(inline="always", **_JIT)
def _nibbles(byte: np.uint8) -> tuple[np.float32, np.float32]:
    """(low, high) nibble of a byte as float32. Split in float arithmetic on purpose: numba
    widens integer ``&`` and ``>>`` to int64, which halves the SIMD lanes (2.5x slower here)."""
    v = np.float32(byte)
    hi = np.floor(v * np.float32(0.0625))
    return v - np.float32(16.0) * hi, hi


@nb.njit(inline="always", **_JIT)
def _half(lo: np.uint8, hi: np.uint8) -> np.float32:
    return F16_TABLE[np.int64(lo) | (np.int64(hi) << 8)]


@nb.njit(**_JIT)
def _pack_rows(raw: np.ndarray, gtype: int, row0: int, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Raw GGUF rows (Q4_0, Q4_1 or Q8_0 blocks) into rows ``row0..`` of the packed layout, in one
    pass: experts are packed on every miss, so this runs near memory speed (1.7 GB/s here, twice
    the numpy version's temporaries; a group-major order, writing whole lane vectors, was slower).
    Offsets: Q4_1 its own min, Q4_0 ``-8 d``; Q8_0 stores ``q + 128`` with ``-128 d``."""
    size = 20 if gtype == T_Q4_1 else 18 if gtype == T_Q4_0 else 34
    head = 4 if gtype == T_Q4_1 else 2
    flip = np.uint8(0x80) if gtype == T_Q8_0 else np.uint8(0)
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        row = raw[r]
        for b in range(q.shape[1]):
            base = b * size
            scale = _half(row[base], row[base + 1])
            d[g, b, lane] = scale
            if gtype == T_Q4_1:
                m[g, b, lane] = _half(row[base + 2], row[base + 3])
            elif gtype == T_Q4_0:
                m[g, b, lane] = np.float32(-8.0) * scale
            else:
                m[g, b, lane] = np.float32(-128.0) * scale
            qs = q[g, b]
            for j in range(q.shape[2]):
                qs[j, lane] = row[base + head + j] ^ flip


@nb.njit(**_JIT)
def dequantize_row(w: np.ndarray, gtype: int, out: np.ndarray) -> None:
    """Expand one raw GGUF row ``w`` into ``out`` (float32, the row's length)."""
    k = out.shape[0]
    if gtype == T_Q4_1 or gtype == T_Q4_0:
        size = 20 if gtype == T_Q4_1 else 18
        for b in range(k // 32):
            base = b * size
            d = _half(w[base], w[base + 1])
            m = _half(w[base + 2], w[base + 3]) if gtype == T_Q4_1 else np.float32(-8.0) * d
            qs = base + size - 16
            for j in range(16):
                lo, hi = _nibbles(w[qs + j])
                out[b * 32 + j] = d * lo + m
                out[b * 32 + 16 + j] = d * hi + m
    elif gtype == T_Q8_0:
        for b in range(k // 32):
            base = b * 34
            d = _half(w[base], w[base + 1])
            for j in range(32):
                out[b * 32 + j] = d * np.float32(np.int8(w[base + 2 + j]))
    elif gtype == T_F32:
        out[:] = w[: 4 * k].view(np.float32)
    elif gtype == T_F16:
        for i in range(k):
            out[i] = _half(w[2 * i], w[2 * i + 1])
    elif gtype == T_BF16:
        bits = w[: 2 * k].view(np.uint16).astype(np.uint32) << np.uint32(16)  # stays uint32
        out[:] = bits.view(np.float32)


@nb.njit(**_JIT)
def _direct_group(w: Weight, g: int, x: np.ndarray, xs: np.ndarray, lo: np.ndarray,
                  hi: np.ndarray, a: np.ndarray, acc: np.ndarray) -> None:
    """acc[t, r] = row GROUP*g + r of W dotted with activation row t.

    For each quant j of a block, the GROUP lanes (one per row) are multiplied by the same
    activation x[t, 32b + j]; the block's sum a[t, r] is then scaled once by d and offset by m.
    """
    t_rows, n_blocks = x.shape[0], w.q.shape[1]
    lanes = w.q.shape[3]  # == GROUP, for the Q8 loops: see LANES_AT_RUN_TIME
    acc[:, :] = 0.0
    for b in range(n_blocks):
        a[:, :] = 0.0
        qb = w.q[g, b]
        if w.kind == KIND_Q4 and t_rows == 1:  # one row: decode and multiply in one pass
            a0 = a[0]
            for j in range(16):
                qj, xl, xh = qb[j], x[0, b * 32 + j], x[0, b * 32 + 16 + j]
                for r in range(GROUP):
                    low, high = _nibbles(qj[r])
                    a0[r] = (a0[r] + low * xl) + high * xh  # two FMAs, in this order on every path
        elif w.kind == KIND_Q4:  # decode once, for every activation row
            for j in range(16):
                qj = qb[j]
                for r in range(GROUP):
                    lo[r], hi[r] = _nibbles(qj[r])
                for t in range(t_rows):
                    at, xl, xh = a[t], x[t, b * 32 + j], x[t, b * 32 + 16 + j]
                    for r in range(GROUP):
                        at[r] = (at[r] + lo[r] * xl) + hi[r] * xh
        elif t_rows == 1:  # Q8: quants j and j + 16 paired, as Q4 pairs its nibbles
            a0 = a[0]
            for j in range(16):
                ql, qh, xl, xh = qb[j], qb[j + 16], x[0, b * 32 + j], x[0, b * 32 + 16 + j]
                for r in range(lanes):
                    a0[r] = (a0[r] + np.float32(ql[r]) * xl) + np.float32(qh[r]) * xh
        else:
            for j in range(16):
                ql, qh = qb[j], qb[j + 16]
                for r in range(lanes):
                    lo[r] = np.float32(ql[r])
                    hi[r] = np.float32(qh[r])
                for t in range(t_rows):
                    at, xl, xh = a[t], x[t, b * 32 + j], x[t, b * 32 + 16 + j]
                    for r in range(lanes):
                        at[r] = (at[r] + lo[r] * xl) + hi[r] * xh
        d, m = w.d[g, b], w.m[g, b]
        for t in range(t_rows):
            at, acc_t, xsum = a[t], acc[t], xs[t, b]
            for r in range(GROUP):
                acc_t[r] += d[r] * at[r] + m[r] * xsum


@nb.njit(parallel=True, **_JIT)
def _direct(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    t_rows = x.shape[0]
    n_groups, n_blocks = w.q.shape[0], w.q.shape[1]
    xs = np.zeros((t_rows, n_blocks), np.float32)  # block sums of x, for the offsets m
    for t in range(t_rows):
        for b in range(n_blocks):
            for i in range(32):
                xs[t, b] += x[t, b * 32 + i]
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
        for g in range(g0, g1):
            o = (g - g0) * GROUP
            for b in range(n_blocks):
                for j in range(per):
                    if w.kind == KIND_Q4:
                        for r in range(GROUP):
                            lo, hi = _nibbles(w.q[g, b, j, r])
                            tile_t[b * 32 + j, o + r] = w.d[g, b, r] * lo + w.m[g, b, r]
                            tile_t[b * 32 + 16 + j, o + r] = w.d[g, b, r] * hi + w.m[g, b, r]
                    else:
                        d, m = w.d[g, b], w.m[g, b]
                        for r in range(GROUP):
                            tile_t[b * 32 + j, o + r] = d[r] * np.float32(w.q[g, b, j, r]) + m[r]
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
    if n_direct > 0:
        _direct(x[:n_direct], w, out[:n_direct])
    if n_direct < x.shape[0]:
        _tiled(x[n_direct:], w, out[n_direct:])
