"""``out = x @ W.T`` computed on W's quantized blocks, two ways.

GGUF stores a matrix row by row, each row a run of 32-element blocks with their own scale. A
kernel walking a row must reduce every block horizontally, which SIMD does badly, so for decode
each quantized matrix is also *packed* at load: 16 rows are interleaved block by block,

    q[g, b, j, r]   quant j of block b of row 16*g + r   (Q4: a byte of two nibbles, Q8: int8)
    d[g, b, r]      that block's scale;  m[g, b, r] its offset (Q4_1's min, -8*d for Q4_0)

so a block of 16 rows is one contiguous run of bytes that vectorizes as a flat loop, and the
per-row reduction is a 4-step tree over 16 lanes. The bits stay 4- or 8-bit; only the scales widen
to float32. That is the *direct* path, for a few activation rows (decode).

For many rows (prefill, big batches) the *tiled* path dequantizes a tile of rows from the raw GGUF
bytes into float32 and lets BLAS (``np.dot`` inside numba) multiply: the expansion is paid once per
tile and reused by every activation row; the whole matrix is never expanded.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.store.quant import GGMLType

# Activation rows up to which the direct path beats tile + BLAS (bench/bench_kernels.py).
DIRECT_MAX_ROWS = 4
# Weight rows per BLAS tile: 256 rows of 1536 floats is 1.5 MB, about what L2 holds.
TILE_ROWS = 256
GROUP = 16  # rows interleaved by packing: one AVX-512 vector of float32

KIND_NONE, KIND_Q4, KIND_Q8 = 0, 1, 2

T_F32 = int(GGMLType.F32)
T_F16 = int(GGMLType.F16)
T_BF16 = int(GGMLType.BF16)
T_Q8_0 = int(GGMLType.Q8_0)
T_Q4_0 = int(GGMLType.Q4_0)
T_Q4_1 = int(GGMLType.Q4_1)

# IEEE half -> float32 for every bit pattern: numba has no float16 on the CPU, and a 256 KB table
# lookup is cheaper than decoding exponent and mantissa by hand.
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_JIT = dict(nogil=True, cache=True, fastmath=True)


class Weight(NamedTuple):
    """A matrix: its raw GGUF rows (a view of the mmap) and, for Q4/Q8, its packed form.
    One type for every format, so a layer's weights form a homogeneous tuple for numba."""

    raw: np.ndarray  # uint8 [N, row_bytes]
    gtype: int
    kind: int
    q: np.ndarray  # uint8 [G, nb, 16 (Q4) or 32 (Q8), GROUP]
    d: np.ndarray  # float32 [G, nb, GROUP]
    m: np.ndarray  # float32 [G, nb, GROUP]


_EMPTY_Q = np.zeros((0, 0, 0, 0), np.uint8)
_EMPTY_S = np.zeros((0, 0, 0), np.float32)


def _interleave(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [G, ..., GROUP], zero-padding N to whole groups: row 16g+r goes to lane r."""
    groups = -(-a.shape[0] // GROUP)
    pad = groups * GROUP - a.shape[0]
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return np.ascontiguousarray(np.moveaxis(a.reshape(groups, GROUP, *a.shape[1:]), 1, -1))


def make_weight(raw: np.ndarray, gtype: int) -> Weight:
    """Wrap raw rows, packing Q4_0, Q4_1 and Q8_0 for the direct path."""
    if gtype not in (T_Q4_0, T_Q4_1, T_Q8_0):
        return Weight(raw, gtype, KIND_NONE, _EMPTY_Q, _EMPTY_S, _EMPTY_S)
    n_rows, head = raw.shape[0], 4 if gtype == T_Q4_1 else 2
    blocks = raw.reshape(n_rows, -1, 34 if gtype == T_Q8_0 else head + 16)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if gtype == T_Q4_1:
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d if gtype == T_Q4_0 else np.zeros_like(d)
    kind = KIND_Q8 if gtype == T_Q8_0 else KIND_Q4
    return Weight(raw, gtype, kind, _interleave(blocks[:, :, head:]), _interleave(d), _interleave(m))


@nb.njit(inline="always", **_JIT)
def _half(lo: np.uint8, hi: np.uint8) -> np.float32:
    return F16_TABLE[np.int64(lo) | (np.int64(hi) << 8)]


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
                q = w[qs + j]
                out[b * 32 + j] = d * np.float32(q & 15) + m
                out[b * 32 + 16 + j] = d * np.float32(q >> 4) + m
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
        out[:] = (w[: 2 * k].view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@nb.njit(inline="always", **_JIT)
def _fold16(a: np.ndarray, n: int) -> None:
    """a[0:16] = sum over the n/16 lanes-groups of a[0:n] (n a power of two >= 16)."""
    while n > 16:
        n //= 2
        for i in range(n):
            a[i] += a[i + n]


@nb.njit(parallel=True, **_JIT)
def _direct(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    t_rows, k = x.shape
    n_groups, n_blocks, per = w.q.shape[0], w.q.shape[1], w.q.shape[2]
    span = per * GROUP  # bytes of one block of a group: 256 (Q4) or 512 (Q8)
    # Activations spread to the packed order: xe[t, b, h, i] multiplies byte i of block b
    # (h = 0: low nibble / the int8, h = 1: high nibble).
    halves = 2 if w.kind == KIND_Q4 else 1
    xe = np.empty((t_rows, n_blocks, halves, span), np.float32)
    xs = np.zeros((t_rows, n_blocks), np.float32)
    for t in range(t_rows):
        for b in range(n_blocks):
            for i in range(span):
                xe[t, b, 0, i] = x[t, b * 32 + (i >> 4)]
                if halves == 2:
                    xe[t, b, 1, i] = x[t, b * 32 + 16 + (i >> 4)]
            for i in range(32):
                xs[t, b] += x[t, b * 32 + i]
    for g in nb.prange(n_groups):
        lo = np.empty(span, np.float32)
        hi = np.empty(span, np.float32)
        a = np.empty(span, np.float32)
        acc = np.zeros((t_rows, GROUP), np.float32)
        for b in range(n_blocks):
            qb = w.q[g, b].reshape(span)
            if w.kind == KIND_Q4:
                for i in range(span):
                    v = np.int32(qb[i])
                    lo[i] = np.float32(v & 15)
                    hi[i] = np.float32(v >> 4)
            else:
                for i in range(span):
                    lo[i] = np.float32(np.int8(qb[i]))
            for t in range(t_rows):
                xl = xe[t, b, 0]
                if halves == 2:
                    xh = xe[t, b, 1]
                    for i in range(span):
                        a[i] = lo[i] * xl[i] + hi[i] * xh[i]
                else:
                    for i in range(span):
                        a[i] = lo[i] * xl[i]
                _fold16(a, span)
                for r in range(GROUP):
                    acc[t, r] += w.d[g, b, r] * a[r] + w.m[g, b, r] * xs[t, b]
        for r in range(min(GROUP, out.shape[1] - g * GROUP)):
            for t in range(t_rows):
                out[t, g * GROUP + r] = acc[t, r]


@nb.njit(parallel=True, **_JIT)
def _tiled(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    n = w.raw.shape[0]
    for c in nb.prange((n + TILE_ROWS - 1) // TILE_ROWS):
        r0 = c * TILE_ROWS
        rows = min(TILE_ROWS, n - r0)
        tile = np.empty((rows, x.shape[1]), dtype=np.float32)
        for r in range(rows):
            dequantize_row(w.raw[r0 + r], w.gtype, tile[r])
        out[:, r0 : r0 + rows] = np.dot(x, tile.T)


@nb.njit(**_JIT)
def qmatmul(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """``out[T, N] = x[T, K] @ W.T``."""
    if w.kind != KIND_NONE and x.shape[0] <= DIRECT_MAX_ROWS:
        _direct(x, w, out)
    else:
        _tiled(x, w, out)
