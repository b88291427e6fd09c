"""The formats computed on in place: decoders of one raw GGUF row into float32, per block format
(``decode_row``), ``dequantize_row`` for every format the kernels read, and ``dequantize``, the
reference every format's kernels and packings are tested against.

Q5_0/Q5_1, the K-quants (Q2_K … Q6_K, 256-value super-blocks of 16- or 32-value sub-blocks with
their own 4- to 8-bit scales), the IQ4 grids and MXFP4 (E2M1 values, an E8M0 scale) do not fit the
packed layout's ``d * q + m`` per 32-value block, and packing them would make a copy bigger than the
file. So the kernels read the file's blocks as they are (a matrix's rows, ``Kind.BLOCKS`` in
``formats.py``) and decode a few rows at a time into a small float32 tile
(``colibri.model.kernels.quant_matmul``). The layouts are llama.cpp's ``ggml-common.h``; the
arithmetic follows its ``dequantize_row_*`` so values agree with the file's reference dequantizer to
float32 rounding.

Halves are widened by ``halves.half``; the geometry and the compile options are ``numerics``'.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from colibri.store.formats import FORMATS, GGMLType, Kind
from colibri.store.halves import half
from colibri.store.numerics import BLOCK, KERNEL, QK_K
from colibri.store.quantize_k import MXFP4_GRID

# The non-linear 4-bit grid of IQ4_NL and IQ4_XS (ggml-common.h's kvalues_iq4nl).
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

# Type ids and block sizes as plain ints: numba reads module constants, not the table.
T_Q5_0, T_Q5_1 = int(GGMLType.Q5_0), int(GGMLType.Q5_1)
T_Q2_K, T_Q3_K, T_Q4_K = int(GGMLType.Q2_K), int(GGMLType.Q3_K), int(GGMLType.Q4_K)
T_Q5_K, T_Q6_K = int(GGMLType.Q5_K), int(GGMLType.Q6_K)
T_IQ4_NL, T_IQ4_XS = int(GGMLType.IQ4_NL), int(GGMLType.IQ4_XS)
T_MXFP4 = int(GGMLType.MXFP4)
_SIZE = {t: FORMATS[GGMLType(t)].nbytes for t in (T_Q5_0, T_Q5_1, T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K,
                                                   T_Q6_K, T_IQ4_NL, T_IQ4_XS, T_MXFP4)}
Q5_0_SIZE, Q5_1_SIZE, Q2_K_SIZE, Q3_K_SIZE = _SIZE[T_Q5_0], _SIZE[T_Q5_1], _SIZE[T_Q2_K], _SIZE[T_Q3_K]
Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE = _SIZE[T_Q4_K], _SIZE[T_Q5_K], _SIZE[T_Q6_K]
IQ4_NL_SIZE, IQ4_XS_SIZE, MXFP4_SIZE = _SIZE[T_IQ4_NL], _SIZE[T_IQ4_XS], _SIZE[T_MXFP4]
# The formats decoded here.
IN_PLACE = frozenset(GGMLType(t) for t in _SIZE)
# The packed and float formats, for ``dequantize_row`` (embeddings, norms, widened matrices).
T_F32, T_F16, T_BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
T_Q4_0, T_Q4_1, T_Q8_0 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q8_0)
Q4_0_NBYTES = FORMATS[GGMLType.Q4_0].nbytes
Q4_1_NBYTES = FORMATS[GGMLType.Q4_1].nbytes
Q8_0_NBYTES = FORMATS[GGMLType.Q8_0].nbytes
Q8_0_QUANTS_AT = FORMATS[GGMLType.Q8_0].pack.quants_at
NIBBLE_BYTES = BLOCK // 2  # a Q4_0/Q4_1 block's quant bytes, two nibbles each


@nb.njit(inline="always", **KERNEL)
def _u32(w: np.ndarray, at: int) -> np.int64:
    return (np.int64(w[at]) | (np.int64(w[at + 1]) << 8) | (np.int64(w[at + 2]) << 16)
            | (np.int64(w[at + 3]) << 24))


@nb.njit(**KERNEL)
def _q5(w: np.ndarray, out: np.ndarray, size: int, with_min: bool) -> None:
    """Q5_0 (``d * (q - 16)``) and Q5_1 (``d * q + m``): 4 low bits in qs, the fifth in qh."""
    for b in range(out.shape[0] // BLOCK):
        base = b * size
        d = half(w[base], w[base + 1])
        m = half(w[base + 2], w[base + 3]) if with_min else np.float32(0.0)
        qh = _u32(w, base + 4 if with_min else base + 2)
        qs = base + size - 16
        bias = 0 if with_min else 16
        for j in range(16):
            h0 = ((qh >> j) << 4) & 0x10
            h1 = (qh >> (j + 12)) & 0x10
            x0 = np.float32(((np.int64(w[qs + j]) & 0x0F) | h0) - bias)
            x1 = np.float32(((np.int64(w[qs + j]) >> 4) | h1) - bias)
            out[b * BLOCK + j] = x0 * d + m
            out[b * BLOCK + j + 16] = x1 * d + m


@nb.njit(**KERNEL)
def _q2_k(w: np.ndarray, out: np.ndarray) -> None:
    """scales[16] (4-bit scale, 4-bit min), qs[64] (2 bits), d, dmin."""
    for b in range(out.shape[0] // QK_K):
        base = b * Q2_K_SIZE
        d, dmin = half(w[base + 80], w[base + 81]), half(w[base + 82], w[base + 83])
        y, s = b * QK_K, base
        for n in range(2):
            q = base + 16 + 32 * n
            for shift in range(0, 8, 2):
                for half_ in range(2):
                    sc = np.int64(w[s])
                    s += 1
                    dl, ml = d * np.float32(sc & 0xF), dmin * np.float32(sc >> 4)
                    for i in range(16):
                        out[y] = dl * np.float32((np.int64(w[q + 16 * half_ + i]) >> shift) & 3) - ml
                        y += 1


@nb.njit(inline="always", **KERNEL)
def _q3_k_scale(w: np.ndarray, s: int, j: int) -> np.int64:
    """Scale j (0..15) of a Q3_K block whose 12 scale bytes start at s: 6 bits, biased by 32."""
    i, group = j % 4, j // 4
    low = np.int64(w[s + i + 4 * (group % 2)])
    low = (low & 0xF) if group < 2 else (low >> 4)
    high = (np.int64(w[s + 8 + i]) >> (2 * group)) & 3
    return (low | (high << 4)) - 32


@nb.njit(**KERNEL)
def _q3_k(w: np.ndarray, out: np.ndarray) -> None:
    """hmask[32] (the third bit), qs[64] (2 bits), scales[12] (16 six-bit scales), d."""
    for b in range(out.shape[0] // QK_K):
        base = b * Q3_K_SIZE
        d = half(w[base + 108], w[base + 109])
        y, j, bit = b * QK_K, 0, 1
        for n in range(2):
            q = base + 32 + 32 * n
            for shift in range(0, 8, 2):
                for half_ in range(2):
                    dl = d * np.float32(_q3_k_scale(w, base + 96, j))
                    j += 1
                    for i in range(16):
                        lo = (np.int64(w[q + 16 * half_ + i]) >> shift) & 3
                        hi = 0 if np.int64(w[base + 16 * half_ + i]) & bit else 4
                        out[y] = dl * np.float32(lo - hi)
                        y += 1
                bit <<= 1


@nb.njit(inline="always", **KERNEL)
def _scale_min_k4(w: np.ndarray, s: int, j: int) -> tuple[np.int64, np.int64]:
    """Scale and min j (0..7) of a Q4_K/Q5_K block, six bits each, packed in 12 bytes at s."""
    if j < 4:
        return np.int64(w[s + j]) & 63, np.int64(w[s + j + 4]) & 63
    sc = (np.int64(w[s + j + 4]) & 0xF) | ((np.int64(w[s + j - 4]) >> 6) << 4)
    m = (np.int64(w[s + j + 4]) >> 4) | ((np.int64(w[s + j]) >> 6) << 4)
    return sc, m


@nb.njit(**KERNEL)
def _q45_k(w: np.ndarray, out: np.ndarray, size: int, fifth_bit: bool) -> None:
    """Q4_K: d, dmin, scales[12], qs[128]; Q5_K adds qh[32] (the fifth bit) before qs."""
    for b in range(out.shape[0] // QK_K):
        base = b * size
        d, dmin = half(w[base], w[base + 1]), half(w[base + 2], w[base + 3])
        qs = base + (48 if fifth_bit else 16)
        for j64 in range(4):
            sc, mn = _scale_min_k4(w, base + 4, 2 * j64)
            d1, m1 = d * np.float32(sc), dmin * np.float32(mn)
            sc, mn = _scale_min_k4(w, base + 4, 2 * j64 + 1)
            d2, m2 = d * np.float32(sc), dmin * np.float32(mn)
            y, q = b * QK_K + 64 * j64, qs + 32 * j64
            for i in range(32):
                v = np.int64(w[q + i])
                h1 = h2 = 0
                if fifth_bit:
                    h = np.int64(w[base + 16 + i])
                    h1 = 16 if h & (1 << (2 * j64)) else 0
                    h2 = 16 if h & (2 << (2 * j64)) else 0
                out[y + i] = d1 * np.float32((v & 0xF) + h1) - m1
                out[y + 32 + i] = d2 * np.float32((v >> 4) + h2) - m2


@nb.njit(inline="always", **KERNEL)
def _q6_k_scale(w: np.ndarray, base: int, j: int) -> np.int64:
    """Scale j (0..15, one per 16 values) of the Q6_K block at ``base``: a signed byte."""
    s = np.int64(w[base + 192 + j])
    return s - 256 if s >= 128 else s


@nb.njit(**KERNEL)
def _q6_k(w: np.ndarray, out: np.ndarray) -> None:
    """ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16], d."""
    for b in range(out.shape[0] // QK_K):
        base = b * Q6_K_SIZE
        d = half(w[base + 208], w[base + 209])
        for n in range(2):
            ql, qh, y = base + 64 * n, base + 128 + 32 * n, b * QK_K + 128 * n
            for i in range(32):
                lo0, lo1, h = np.int64(w[ql + i]), np.int64(w[ql + i + 32]), np.int64(w[qh + i])
                qv = ((lo0 & 0xF) | ((h & 3) << 4), (lo1 & 0xF) | (((h >> 2) & 3) << 4),
                      (lo0 >> 4) | (((h >> 4) & 3) << 4), (lo1 >> 4) | (((h >> 6) & 3) << 4))
                for k in range(4):
                    s = _q6_k_scale(w, base, 8 * n + i // 16 + 2 * k)
                    out[y + i + 32 * k] = d * np.float32(s) * np.float32(qv[k] - 32)


@nb.njit(inline="always", **KERNEL)
def iq4_sub_block(w: np.ndarray, base: int, ib: int, d: np.float32, xs: bool) -> tuple[np.float32, int]:
    """(scale, byte offset of the quants) of 32-value sub-block ``ib`` of the IQ4 block at ``base``:
    IQ4_NL's is the block's d; IQ4_XS scales each by a six-bit ``ls - 32``."""
    if not xs:
        return d, base + 2
    scales_h = np.int64(w[base + 2]) | (np.int64(w[base + 3]) << 8)
    low = (np.int64(w[base + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
    ls = low | (((scales_h >> (2 * ib)) & 3) << 4)
    return d * np.float32(ls - 32), base + 8 + 16 * ib


@nb.njit(**KERNEL)
def _iq4(w: np.ndarray, out: np.ndarray, xs: bool) -> None:
    """IQ4_NL: d, qs[16] per 32 values on the grid; IQ4_XS: d, scales_h, scales_l[4], qs[128] per 256,
    a six-bit scale per 32 values."""
    per = QK_K if xs else BLOCK
    size = IQ4_XS_SIZE if xs else IQ4_NL_SIZE
    for b in range(out.shape[0] // per):
        base = b * size
        d = half(w[base], w[base + 1])
        for ib in range(per // BLOCK):
            dl, qs = iq4_sub_block(w, base, ib, d, xs)
            y = b * per + BLOCK * ib
            for j in range(16):
                v = np.int64(w[qs + j])
                out[y + j] = dl * IQ4_GRID[v & 0xF]
                out[y + j + 16] = dl * IQ4_GRID[v >> 4]


@nb.njit(inline="always", **KERNEL)
def e8m0_half(byte: np.uint8) -> np.float32:
    """An MXFP4 block's scale: its E8M0 exponent byte e as 2^(e - 128) (``GGML_E8M0_TO_FP32_HALF``:
    the grid is E2M1 doubled), exact for every byte, the two smallest float32 denormals."""
    return np.float32(math.ldexp(1.0, np.int64(byte) - 128))


@nb.njit(**KERNEL)
def _mxfp4(w: np.ndarray, out: np.ndarray) -> None:
    """MXFP4: e, qs[16] per 32 values, quant j in the low nibble of byte j, j + 16 in the high one."""
    for b in range(out.shape[0] // BLOCK):
        base = b * MXFP4_SIZE
        d = e8m0_half(w[base])
        for j in range(16):
            v = np.int64(w[base + 1 + j])
            out[b * BLOCK + j] = d * MXFP4_GRID[v & 0xF]
            out[b * BLOCK + j + 16] = d * MXFP4_GRID[v >> 4]


@nb.njit(**KERNEL)
def decode_row(w: np.ndarray, gtype: int, out: np.ndarray) -> bool:
    """Decode one raw row ``w`` of an in-place format into ``out``; False for any other type."""
    if gtype == T_Q5_0 or gtype == T_Q5_1:
        _q5(w, out, Q5_1_SIZE if gtype == T_Q5_1 else Q5_0_SIZE, gtype == T_Q5_1)
    elif gtype == T_Q4_K or gtype == T_Q5_K:
        _q45_k(w, out, Q5_K_SIZE if gtype == T_Q5_K else Q4_K_SIZE, gtype == T_Q5_K)
    elif gtype == T_IQ4_NL or gtype == T_IQ4_XS:
        _iq4(w, out, gtype == T_IQ4_XS)
    elif gtype == T_Q2_K:
        _q2_k(w, out)
    elif gtype == T_Q3_K:
        _q3_k(w, out)
    elif gtype == T_Q6_K:
        _q6_k(w, out)
    elif gtype == T_MXFP4:
        _mxfp4(w, out)
    else:
        return False
    return True


@nb.njit(inline="always", **KERNEL)
def nibbles(byte: np.uint8) -> tuple[np.float32, np.float32]:
    """(low, high) nibble of a byte as float32. Split in float arithmetic on purpose: numba
    widens integer ``&`` and ``>>`` to int64, which halves the SIMD lanes (2.5x slower here)."""
    v = np.float32(byte)
    hi = np.floor(v * np.float32(0.0625))
    return v - np.float32(16.0) * hi, hi


@nb.njit(**KERNEL)
def dequantize_row(w: np.ndarray, gtype: int, out: np.ndarray) -> None:
    """Expand one raw GGUF row ``w`` into ``out`` (float32, the row's length): embeddings, norms,
    routers and float-widened matrices. A type with no branch here raises."""
    k = out.shape[0]
    if gtype == T_Q4_1 or gtype == T_Q4_0:
        size = Q4_1_NBYTES if gtype == T_Q4_1 else Q4_0_NBYTES
        for b in range(k // BLOCK):
            base = b * size
            d = half(w[base], w[base + 1])
            m = half(w[base + 2], w[base + 3]) if gtype == T_Q4_1 else np.float32(-8.0) * d
            qs = base + size - NIBBLE_BYTES
            for j in range(NIBBLE_BYTES):
                lo, hi = nibbles(w[qs + j])
                out[b * BLOCK + j] = d * lo + m
                out[b * BLOCK + NIBBLE_BYTES + j] = d * hi + m
    elif gtype == T_Q8_0:
        for b in range(k // BLOCK):
            base = b * Q8_0_NBYTES
            d = half(w[base], w[base + 1])
            for j in range(BLOCK):
                out[b * BLOCK + j] = d * np.float32(np.int8(w[base + Q8_0_QUANTS_AT + j]))
    elif gtype == T_F32:
        out[:] = w[: 4 * k].view(np.float32)
    elif gtype == T_F16:
        for i in range(k):
            out[i] = half(w[2 * i], w[2 * i + 1])
    elif gtype == T_BF16:
        bits = w[: 2 * k].view(np.uint16).astype(np.uint32) << np.uint32(16)  # stays uint32
        out[:] = bits.view(np.float32)
    elif not decode_row(w, gtype, out):  # the formats computed on in place
        raise ValueError("dequantize_row: a block type the kernels do not compute on")


def dequantize(raw: np.ndarray, gtype: GGMLType, n_elements: int) -> np.ndarray:
    """Reference dequantization of ``n_elements`` values from the bytes ``raw`` to float32: the
    table's numpy dequantizer, or for a format computed on in place the decoder here, which is its
    definition."""
    fmt = FORMATS.get(gtype)
    if fmt is None or (fmt.dequantize is None and fmt.kind != Kind.BLOCKS):
        raise ValueError(f"no dequantizer for {GGMLType(gtype).name}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    blocks = raw[: n_elements // fmt.block * fmt.nbytes].reshape(-1, fmt.nbytes)
    if fmt.dequantize is None:
        out = np.empty(blocks.shape[0] * fmt.block, np.float32)
        decode_row(blocks.reshape(-1), int(gtype), out)
        return out[:n_elements].copy()
    return np.ascontiguousarray(fmt.dequantize(blocks).reshape(-1)[:n_elements], dtype=np.float32).copy()
