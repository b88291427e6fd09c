"""Quantizers that match llama.cpp's ``quantize_row_*_ref`` (ggml/src/ggml-quants.c) bit for bit:
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q4_K, Q5_K, Q6_K, and MXFP4.

Bit-exact, so that a file ``coli convert`` writes is the file ``llama-quantize`` would write from the
same float32 values (without an importance matrix, llama.cpp quantizes with these very functions).
Exactness comes from doing what the C does, in its order, in float32:

- every intermediate is rounded to float32 where the C rounds it (numpy scalars are ``np.float32``,
  sums run element by element, never pairwise), and nothing is fused (ggml-base is built without
  FMA contraction);
- ``nearest_int`` is ggml's float trick (add 1.5 * 2**23, keep the low mantissa bits), reproduced
  for every input, also the out-of-range ones the searches can produce;
- C's conversions are kept: ``(int8_t)`` truncates, ``roundf`` rounds half away from zero, a scale
  stored as ``uint8_t``/``int8_t`` wraps; ``GGML_FP32_TO_FP16`` rounds to nearest even (numpy's).

The scale searches (``make_qkx2_quants``, ``make_qx_quants``) loop per block and are compiled with
numba, imported on first use only (the HTTP server imports the block table, never numba); the rest
is vectorized numpy over all blocks. Each quantizer takes float32 ``[n_blocks, block]`` and returns
``uint8 [n_blocks, bytes]`` in ggml-common.h's block layout.
"""

from __future__ import annotations

import math

import numpy as np

from colibri.store.numerics import EXACT, QK_K

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # ggml's "all zero" threshold for a group's absolute maximum
MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it rounds a float to an integer in the low mantissa
CHUNK = 1024  # groups per parallel task of the searches


# -- the scalar helpers and the scale searches (numba, compiled on first use) ---------------------


def _nearest_int(f: float) -> int:
    """ggml's ``nearest_int``: the bits of ``f + 1.5 * 2**23``; round-half-even inside its range."""
    if -4194303.0 <= f <= 4194303.0:
        return int(np.rint(f))
    v = F32(f + MAGIC)
    if v != v:  # NaN: x86's default NaN has a mantissa of 0x400000
        return 0
    a = abs(v)
    if a == np.inf or a == 0:
        return -0x400000
    m, _ = math.frexp(float(a))
    return int(m * 16777216.0) - 0x800000 - 0x400000


def _qkx2(x: np.ndarray, w: np.ndarray, L: np.ndarray, laux: np.ndarray, nmax: int, rmin: float,
          rdelta: float, nstep: int) -> tuple[float, float]:
    """``make_qkx2_quants`` without ``use_mad``: a scale and (negated) min fitted to one group by
    weighted least squares over ``nstep + 1`` trial scales. Returns (scale, the_min); fills L."""
    n = x.shape[0]
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F32(0.0)
    if mx == mn:
        L[:] = 0
        return F32(0.0), -mn
    fnmax = F32(nmax)
    iscale = fnmax / (mx - mn)
    scale = F32(1.0) / iscale
    best = F32(0.0)
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
        diff = scale * F32(L[i]) + mn - x[i]
        best += w[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (mx - mn)
        sum_l, sum_l2, sum_xl = F32(0.0), F32(0.0), F32(0.0)
        for i in range(n):
            li = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
            laux[i] = li
            fl = F32(li)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            err = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(laux[i]) + this_min - x[i]
                err += w[i] * (diff * diff)
            if err < best:
                L[:] = laux
                best, scale, mn = err, this_scale, this_min
    return scale, -mn


def _qkx2_weighted(x: np.ndarray, w: np.ndarray, L: np.ndarray, laux: np.ndarray, nmax: int,
                   rmin: float, rdelta: float, nstep: int) -> tuple[float, float]:
    """One group of Q4_K/Q5_K: weights ``sqrt(mean(x**2)) + |x|``, then the search."""
    n = x.shape[0]
    sum_x2 = F32(0.0)
    for i in range(n):
        sum_x2 += x[i] * x[i]
    av_x = np.sqrt(sum_x2 / F32(n))
    for i in range(n):
        w[i] = av_x + abs(x[i])
    return _qkx2(x, w, L, laux, nmax, rmin, rdelta, nstep)


def _qkx2_groups(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, scales: np.ndarray,
                 mins: np.ndarray, L: np.ndarray) -> None:
    """Every group's search, runs of CHUNK groups in parallel (each with its own scratch)."""
    n_groups, n = x.shape
    for c in prange((n_groups + CHUNK - 1) // CHUNK):
        w = np.empty(n, np.float32)
        laux = np.empty(n, np.uint8)
        for g in range(c * CHUNK, min(n_groups, (c + 1) * CHUNK)):
            scales[g], mins[g] = _qkx2_weighted(x[g], w, L[g], laux, nmax, F32(rmin), F32(rdelta), nstep)


def _qx_pass(x: np.ndarray, nmax: int, iscale: float) -> tuple[float, float]:
    """One trial scale of ``make_qx_quants`` (rmse_type 1, weights x**2): (sum w x l, sum w l**2)."""
    sumlx, suml2 = F32(0.0), F32(0.0)
    for i in range(x.shape[0]):
        li = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        fl = F32(li)
        w = x[i] * x[i]
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    return sumlx, suml2


def _qx_fill(x: np.ndarray, nmax: int, iscale: float, L: np.ndarray) -> None:
    for i in range(x.shape[0]):
        L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))


def _qx(x: np.ndarray, nmax: int, L: np.ndarray) -> float:
    """``make_qx_quants`` with rmse_type 1 and no importance: a signed scale for one group, the
    best of 19 trial scales around ``-nmax / max``. Fills L (biased by nmax)."""
    mx, amax = F32(0.0), F32(0.0)
    for i in range(x.shape[0]):
        ax = abs(x[i])
        if ax > amax:
            amax, mx = ax, x[i]
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return F32(0.0)
    fnmax = F32(nmax)
    iscale = -fnmax / mx
    _qx_fill(x, nmax, iscale, L)
    sumlx, suml2 = _qx_pass(x, nmax, iscale)
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + F32(0.1) * F32(step)) / mx
        sumlx, suml2 = _qx_pass(x, nmax, iscale)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            _qx_fill(x, nmax, iscale, L)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


def _qx_groups(x: np.ndarray, nmax: int, scales: np.ndarray, L: np.ndarray) -> None:
    for g in prange(x.shape[0]):
        scales[g] = _qx(x[g], nmax, L[g])


prange = range  # numba.prange once compiled
_JITTED = ("_nearest_int", "_qkx2", "_qkx2_weighted", "_qx_pass", "_qx_fill", "_qx")
_PARALLEL = ("_qkx2_groups", "_qx_groups")  # the loops over all groups: independent, in threads
_compiled = False


def _jit() -> None:
    """Compile the searches on first use: each helper is replaced by its numba dispatcher, callees
    first, so the callers resolve them as compiled functions."""
    global _compiled
    if _compiled:
        return
    import numba

    g = globals()
    g["prange"] = numba.prange
    for name in _JITTED:
        g[name] = numba.njit(**EXACT)(g[name])
    for name in _PARALLEL:
        g[name] = numba.njit(parallel=True, **EXACT)(g[name])
    _compiled = True


# -- vectorized pieces: ggml's roundings over whole arrays ----------------------------------------


def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` over an array, exactly (the same float trick), as int32."""
    v = np.asarray(f, dtype=np.float32) + MAGIC
    return (v.view(np.int32) & 0x7FFFFF) - 0x400000


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``GGML_FP32_TO_FP16`` (round to nearest even): the half's bytes and its float32 value."""
    with _errstate():  # beyond 65504: inf, as ggml's conversion gives
        h = np.asarray(v, dtype=np.float32).astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``."""
    return np.where(d != 0, F32(1.0) / np.where(d != 0, d, F32(1.0)), F32(0.0)).astype(np.float32)


def _trunc_int8(v: np.ndarray) -> np.ndarray:
    """C's ``(int8_t)`` of a float: truncate toward zero, keep the low 8 bits (two's complement)."""
    i = np.trunc(v).astype(np.int64) & 0xFF
    return (i ^ 0x80) - 0x80


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's ``roundf``: to nearest, halves away from zero (``v - trunc(v)`` is exact)."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= F32(0.5), t + np.sign(v), t)


def _abs_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, as C's ``if (fabsf(v) > amax)`` loop from 0 finds them: the largest magnitude
    and the value that has it, the first one on ties, NaNs never chosen; both 0 for a row of zeros
    (the C keeps its initial 0 then, never a -0.0 from the data)."""
    a = np.abs(x)
    a = np.where(a == a, a, F32(0.0))
    i = a.argmax(axis=1)[:, None]
    amax = np.take_along_axis(a, i, axis=1)[:, 0]
    v = np.take_along_axis(x, i, axis=1)[:, 0]
    return amax, np.where(amax > 0, v, F32(0.0)).astype(np.float32)


def _first(x: np.ndarray, arg: str) -> np.ndarray:
    """The first row minimum (``arg`` "argmin") or maximum ("argmax"), as ``if (v < min)`` finds
    it: of equal values (0.0 and -0.0) the earliest."""
    return np.take_along_axis(x, getattr(x, arg)(axis=1)[:, None], axis=1)[:, 0]


def _errstate() -> np.errstate:
    return np.errstate(divide="ignore", invalid="ignore", over="ignore")


def _qh_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of a block's 32 quants, as Q5_0/Q5_1's little-endian uint32 ``qh``."""
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4")[:, None].view(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Quants j and j + 16 of a 32-block in byte j (low, high nibble)."""
    return ((q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)).astype(np.uint8)


# -- the 32-value formats ------------------------------------------------------------------------


# MXFP4's values (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), doubled to integers as
# ggml-common.h's ``kvalues_mxfp4``: its scale is the E8M0 exponent's power of two halved.
MXFP4_GRID = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """``GGML_E8M0_TO_FP32_HALF``: 2^(e - 128) as float32, the two smallest as denormals."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """``quantize_row_mxfp4_ref``: the exponent ``floor(log2(amax)) - 2`` (so that amax lands on
    the grid's 4..8 span of 12), each value to the grid point nearest it (the first on ties)."""
    amax = np.abs(x).max(axis=1)
    with _errstate():
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    d = e8m0_half(e)
    err = np.abs(d[:, None, None] * MXFP4_GRID[None, None, :] - x[:, :, None])
    q = err.argmin(axis=2).astype(np.uint8)
    return np.concatenate([e[:, None], _nibble_pairs(q)], axis=1)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_0_ref``: d = amax / 127, quants ``roundf(x / d)``."""
    with _errstate():
        d = np.abs(x).max(axis=1) / F32(127.0)
        q = _roundf(x * _inverse(d)[:, None]).astype(np.int8)
    return np.concatenate([_f16(d)[0], q.view(np.uint8)], axis=1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_0_ref``: d = max / -8 (the signed value of largest magnitude)."""
    with _errstate():
        d = _abs_max(x)[1] / F32(-8.0)
        q = np.minimum(15, _trunc_int8(x * _inverse(d)[:, None] + F32(8.5)))
    return np.concatenate([_f16(d)[0], _nibble_pairs(q)], axis=1)


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_1_ref``: d = (max - min) / 15 and the min, as halves."""
    lo, hi = _first(x, "argmin"), _first(x, "argmax")
    with _errstate():
        d = (hi - lo) / F32(15.0)
        q = np.minimum(15, _trunc_int8((x - lo[:, None]) * _inverse(d)[:, None] + F32(0.5)))
    return np.concatenate([_f16(d)[0], _f16(lo)[0], _nibble_pairs(q)], axis=1)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_0_ref``: d = max / -16; 5-bit quants, bit 4 of each gathered in ``qh``."""
    with _errstate():
        d = _abs_max(x)[1] / F32(-16.0)
        q = np.minimum(31, _trunc_int8(x * _inverse(d)[:, None] + F32(16.5))) & 0xFF
    return np.concatenate([_f16(d)[0], _qh_bits(q), _nibble_pairs(q)], axis=1)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_1_ref``: d = (max - min) / 31 and the min; no clamp (``(uint8_t)`` cast)."""
    lo, hi = _first(x, "argmin"), _first(x, "argmax")
    with _errstate():
        d = (hi - lo) / F32(31.0)
        q = np.trunc((x - lo[:, None]) * _inverse(d)[:, None] + F32(0.5)).astype(np.int64) & 0xFF
    return np.concatenate([_f16(d)[0], _f16(lo)[0], _qh_bits(q), _nibble_pairs(q)], axis=1)


# -- the K-quants --------------------------------------------------------------------------------


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in 12 bytes (ggml's ``get_scale_min_k4`` layout)."""
    out = np.empty((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return out


def _super_scale(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The largest positive of 8 values and 63 / it (0 when none is positive)."""
    top = np.where(v > 0, v, F32(0.0)).max(axis=1).astype(np.float32)
    return top, np.where(top > 0, F32(63.0) / np.where(top > 0, top, F32(1.0)), F32(0.0)).astype(F32)


def _quantize_kx(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """Q4_K and Q5_K: per group of 32 a scale and min (``make_qkx2_quants``), both quantized to 6
    bits against the super-block's largest, then every value requantized with them. Returns
    (head bytes: d, dmin, scales, and the quants L [n, 256])."""
    _jit()
    nb = len(x)
    groups = np.ascontiguousarray(x.reshape(-1, 32))
    scales, mins = np.empty(len(groups), F32), np.empty(len(groups), F32)
    L = np.empty(groups.shape, np.uint8)
    _qkx2_groups(groups, nmax, rmin, rdelta, nstep, scales, mins, L)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, inv_scale = _super_scale(scales)
    max_min, inv_min = _super_scale(mins)
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d_bytes, d = _f16(max_scale / F32(63.0))
    dmin_bytes, dmin = _f16(max_min / F32(63.0))
    dj = (d[:, None] * ls.astype(F32))[:, :, None]
    dmj = (dmin[:, None] * lm.astype(F32))[:, :, None]
    with _errstate():
        q = np.clip(nearest_int((x.reshape(nb, 8, 32) + dmj) / dj), 0, nmax)
    L = np.where(dj != 0, q, L.reshape(nb, 8, 32)).astype(np.uint8).reshape(nb, QK_K)
    head = np.concatenate([d_bytes, dmin_bytes, _pack_scales_k4(ls, lm)], axis=1)
    return head, L


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_K_ref``: 4-bit quants; byte l of each 32-byte run holds quants l, l + 32
    of a 64-value span."""
    head, L = _quantize_kx(x, 15, -1.0, 0.1, 20)
    q = L.reshape(len(L), 4, 2, 32)
    return np.concatenate([head, (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(L), 128)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_K_ref``: as Q4_K, 5-bit; the fifth bits in ``qh`` (bit 2c + h of byte l
    for quant l + 32 h of span c)."""
    head, L = _quantize_kx(x, 31, -0.5, 0.1, 15)
    q = L.reshape(len(L), 4, 2, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << shifts, axis=(1, 2)).astype(np.uint8)
    ql = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(len(L), 128)
    return np.concatenate([head, qh, ql], axis=1)


def _pack_q6_k(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's ``ql`` (low nibbles: quants l, l + 64 and l + 32, l + 96 of each 128-half) and ``qh``
    (the two high bits of quants l, l + 32, l + 64, l + 96 in one byte)."""
    q = L.reshape(len(L), 2, 4, 32)
    lo = q & 0x0F
    ql = np.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce((q >> 4) << shifts, axis=2)
    return ql.reshape(len(L), 128).astype(np.uint8), qh.reshape(len(L), 64).astype(np.uint8)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q6_K_ref``: per group of 16 a signed scale (``make_qx_quants``, 32 levels),
    quantized to int8 against the largest in magnitude; 6-bit quants. A super-block whose scales
    are all below ggml's epsilon is all zero bytes."""
    _jit()
    nb = len(x)
    groups = np.ascontiguousarray(x.reshape(-1, 16))
    scales, L = np.empty(len(groups), F32), np.empty(groups.shape, np.uint8)
    _qx_groups(groups, 32, scales, L)
    scales = scales.reshape(nb, 16)
    max_abs, max_scale = _abs_max(scales)  # a scale is NaN where x**2 overflowed: never chosen
    zero = max_abs < GROUP_MAX_EPS
    max_scale = np.where(zero, F32(1.0), max_scale).astype(F32)
    iscale = F32(-128.0) / max_scale
    d_bytes, d = _f16(F32(1.0) / iscale)
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales))
    sc = ((sc & 0xFF) ^ 0x80) - 0x80  # stored as int8_t
    dj = (d[:, None] * sc.astype(F32))[:, :, None]
    with _errstate():
        q = np.clip(nearest_int(x.reshape(nb, 16, 16) / dj), -32, 31) + 32
    L = np.where(dj != 0, q, L.reshape(nb, 16, 16)).astype(np.uint8).reshape(nb, QK_K)
    ql, qh = _pack_q6_k(L)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d_bytes], axis=1)
    out[zero] = 0
    return out
