"""Element-wise and row-wise kernels of the transformer block: RMSNorm (whole rows or per head),
RoPE (normal and NEOX, full or partial), SwiGLU, bias and residual adds, and an exponential that
vectorizes.

Compiled with the kernels' options and fast-math policy (``colibri.store.numerics``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.store.numerics import KERNEL

# exp(x) = 2^k e^r, k = round(x log2 e), r = x - k ln 2 (ln 2 in two parts, so that r keeps its
# bits), e^r by Cephes' expf polynomial on |r| <= ln 2 / 2: within 3e-7 of the true value, against
# libm's correctly rounded expf, which numba calls once per element (no vector math library here):
# 1536 SwiGLU exponentials took 5 us a layer that way, 0.4 us this way.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                          4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
# Inputs clamped here: 2^k stays a normal float32 (exp(-87) ~ 1.6e-38; exp(88) ~ 1.65e38).
_EXP_LO, _EXP_HI = np.float32(-87.0), np.float32(88.0)


@nb.njit(**KERNEL)
def exp_into(x: np.ndarray, out: np.ndarray) -> None:
    """``out = exp(x)`` for 1-D float32 arrays; ``out`` must not overlap ``x`` (the loop's overlap
    check would then take its scalar path)."""
    exp_with(x, out, np.empty(x.shape[0], np.int32))


@nb.njit(**KERNEL)
def exp_with(x: np.ndarray, out: np.ndarray, bits: np.ndarray) -> None:
    """``exp_into`` with its scratch given (int32, as long as ``x``): a row-by-row caller allocates
    it once, not once a row."""
    n = x.shape[0]
    p0, p1, p2, p3, p4, p5 = _EXP_POLY
    for i in range(n):  # bits: 2^k as float32 bits, the exponent field alone
        v = min(_EXP_HI, max(_EXP_LO, x[i]))
        k = np.floor(v * _LOG2E + np.float32(0.5))
        r = v - k * _LN2_HI - k * _LN2_LO
        poly = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5
        out[i] = poly * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits[:n].view(np.float32)
    for i in range(n):
        out[i] *= scale[i]


@nb.njit(**KERNEL)
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``out[t] = x[t] / rms(x[t]) * weight`` for every row t."""
    t_rows, k = x.shape
    for t in range(t_rows):
        ss = np.float32(0.0)
        for i in range(k):
            ss += x[t, i] * x[t, i]
        scale = np.float32(1.0) / np.sqrt(ss / np.float32(k) + np.float32(eps))
        for i in range(k):
            out[t, i] = x[t, i] * scale * weight[i]


@nb.njit(**KERNEL)
def rmsnorm_heads(x: np.ndarray, weight: np.ndarray, n_heads: int, head_dim: int, eps: float) -> None:
    """RMSNorm of each head of each row in place: ``x`` is (T, n_heads * head_dim), ``weight``
    (head_dim,) is shared by the heads (the q/k norms of qwen3 and glm4moe)."""
    for t in range(x.shape[0]):
        for h in range(n_heads):
            o = h * head_dim
            ss = np.float32(0.0)
            for i in range(head_dim):
                ss += x[t, o + i] * x[t, o + i]
            scale = np.float32(1.0) / np.sqrt(ss / np.float32(head_dim) + np.float32(eps))
            for i in range(head_dim):
                x[t, o + i] = x[t, o + i] * scale * weight[i]


@nb.njit(**KERNEL)
def rope_frequencies(head_dim: int, rope_dim: int, freq_base: float) -> np.ndarray:
    """Inverse frequencies ``base^(-2i/rope_dim)`` for the rotated pairs of a head."""
    inv = np.empty(rope_dim // 2, dtype=np.float64)
    for i in range(rope_dim // 2):
        inv[i] = freq_base ** (-2.0 * i / rope_dim)
    return inv


@nb.njit(**KERNEL)
def rope(
    x: np.ndarray, positions: np.ndarray, n_heads: int, head_dim: int, inv_freq: np.ndarray,
    neox: bool = False, mscale: float = 1.0,
) -> None:
    """Rotate pairs of each head in place: adjacent pairs ``(2i, 2i+1)`` (ggml's 'normal' RoPE,
    the llama layout in GGUF), or with ``neox`` the pairs ``(i, i + rope_dim/2)`` (ggml's NEOX,
    Hugging Face's ``rotate_half``: qwen2moe, qwen3moe, glm4moe).

    ``x`` is (T, n_heads * head_dim); row t sits at ``positions[t]``. ``rope_dim`` is
    ``2 * len(inv_freq)``; dimensions beyond it are left as they are (partial rotary). The
    rotated pairs are also scaled by ``mscale`` (Phi's long RoPE's attention factor, as ggml's
    rope applies it: to the rotated dimensions only). ``rope_angles`` then ``rotate``: a caller
    rotating q and k at the same positions takes the angles once.
    """
    cos, sin = rope_angles(positions, inv_freq, mscale)
    rotate(x, cos, sin, n_heads, head_dim, neox)


@nb.njit(**KERNEL)
def rope_angles(
    positions: np.ndarray, inv_freq: np.ndarray, mscale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``mscale`` cos and sin of each row's angles, (T, len(inv_freq)) float32 each: computed in
    float64 from the position, as ggml does, then rounded."""
    cos = np.empty((positions.shape[0], inv_freq.shape[0]), np.float32)
    sin = np.empty_like(cos)
    for t in range(positions.shape[0]):
        p = np.float64(positions[t])
        for i in range(inv_freq.shape[0]):
            angle = p * inv_freq[i]
            cos[t, i] = np.float32(np.cos(angle) * mscale)
            sin[t, i] = np.float32(np.sin(angle) * mscale)
    return cos, sin


@nb.njit(**KERNEL)
def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int, head_dim: int, neox: bool) -> None:
    """``rope``'s rotation by angles from ``rope_angles``, head by head along the pairs (the loop
    runs over contiguous values where it ran across heads: 2.7x faster on a prompt's q and k)."""
    half = cos.shape[1]
    stride, other = (1, half) if neox else (2, 1)  # pair i is (stride*i, stride*i + other)
    for t in range(x.shape[0]):
        c, s = cos[t], sin[t]
        for h in range(n_heads):
            row = x[t, h * head_dim : (h + 1) * head_dim]
            for i in range(half):
                a = row[stride * i]
                b = row[stride * i + other]
                row[stride * i] = a * c[i] - b * s[i]
                row[stride * i + other] = a * s[i] + b * c[i]


# Running maxima kept apart: a maximum is exact in any order, and one running maximum is a chain of
# dependent compares that no vectorizer may split (without "nnan", a NaN could move).
_PEAKS = 16


@nb.njit(inline="always", **KERNEL)
def _peak(x: np.ndarray) -> np.float32:
    """``max(x)`` (-inf when empty)."""
    peaks = np.full(_PEAKS, -np.inf, np.float32)
    whole = x.shape[0] - x.shape[0] % _PEAKS
    for i in range(0, whole, _PEAKS):
        for j in range(_PEAKS):
            peaks[j] = max(peaks[j], x[i + j])
    peak = np.float32(-np.inf)
    for i in range(whole, x.shape[0]):
        peak = max(peak, x[i])
    for j in range(_PEAKS):
        peak = max(peak, peaks[j])
    return peak


@nb.njit(**KERNEL)
def exp_from_peak(x: np.ndarray, out: np.ndarray) -> np.float32:
    """``out = exp(x - max(x))`` (``x`` is left shifted by its max) and the sum of ``out``: a
    softmax's numerators and denominator. ``out`` must not overlap ``x``."""
    peak = _peak(x)
    for i in range(x.shape[0]):
        x[i] -= peak
    exp_into(x, out)
    total = np.float32(0.0)
    for i in range(out.shape[0]):
        total += out[i]
    return total


@nb.njit(**KERNEL)
def swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    """``gate = silu(gate) * up`` in place: ``g / (1 + exp(-g)) * u``."""
    scratch = swiglu_scratch(gate.shape[1])
    for t in range(gate.shape[0]):
        swiglu_row(gate[t], up[t], scratch)


class SwiGLUScratch(NamedTuple):
    """``swiglu_row``'s scratch rows, allocated once for many rows (an allocation a row took a
    quarter of the experts' SwiGLU of a prompt, ``moe._swiglu_quantized``)."""

    neg: np.ndarray  # float32
    e: np.ndarray  # float32
    bits: np.ndarray  # int32


@nb.njit(**KERNEL)
def swiglu_scratch(n: int) -> SwiGLUScratch:
    """Scratch for rows of up to ``n`` values."""
    return SwiGLUScratch(np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.int32))


@nb.njit(**KERNEL)
def swiglu_row(gate: np.ndarray, up: np.ndarray, s: SwiGLUScratch) -> None:
    """``swiglu`` of one row (1-D), with scratch at least as long."""
    k = gate.shape[0]
    neg, e = s.neg[:k], s.e[:k]
    for i in range(k):
        neg[i] = -gate[i]
    exp_with(neg, e, s.bits)
    for i in range(k):
        gate[i] = gate[i] / (np.float32(1.0) + e[i]) * up[i]


# GELU's tanh form (Gemma's ``gelu_pytorch_tanh``, ggml's ``gelu``): 0.5 g (1 + tanh(√(2/π) (g + c g³))).
_GELU_K = np.float32(0.7978845608028654)  # √(2/π)
_GELU_C = np.float32(0.044715)


@nb.njit(**KERNEL)
def geglu(gate: np.ndarray, up: np.ndarray) -> None:
    """``gate = gelu_tanh(gate) * up`` in place (GeGLU). tanh(|z|) = (1 - e) / (1 + e) with
    ``e = exp(-2|z|)``: one vectorized exponential a value, as ``swiglu`` takes."""
    t_rows, k = gate.shape
    neg, e, bits = np.empty(k, np.float32), np.empty(k, np.float32), np.empty(k, np.int32)
    for t in range(t_rows):
        for i in range(k):
            g = gate[t, i]
            neg[i] = np.float32(-2.0) * abs(_GELU_K * (g + _GELU_C * g * g * g))
        exp_with(neg, e, bits)
        for i in range(k):
            g = gate[t, i]
            th = (np.float32(1.0) - e[i]) / (np.float32(1.0) + e[i])
            if g + _GELU_C * g * g * g < 0:
                th = -th
            gate[t, i] = np.float32(0.5) * g * (np.float32(1.0) + th) * up[t, i]


@nb.njit(**KERNEL)
def add_into(x: np.ndarray, y: np.ndarray) -> None:
    """``x += y`` for 2-D float32 arrays (a loop numba fuses, with no temporary)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += y[t, i]


@nb.njit(**KERNEL)
def swiglu_clamped(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> None:
    """gpt-oss's SwiGLU in place: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``gate = g * sigmoid(alpha g) * (u + 1)`` (llama.cpp's ``swiglu_oai``)."""
    t_rows, k = gate.shape
    a, lim = np.float32(alpha), np.float32(limit)
    neg, e, bits = np.empty(k, np.float32), np.empty(k, np.float32), np.empty(k, np.int32)
    for t in range(t_rows):
        for i in range(k):
            gate[t, i] = min(gate[t, i], lim)
            neg[i] = -a * gate[t, i]
        exp_with(neg, e, bits)
        for i in range(k):
            u = min(max(up[t, i], -lim), lim)
            gate[t, i] = gate[t, i] / (np.float32(1.0) + e[i]) * (u + np.float32(1.0))


@nb.njit(**KERNEL)
def add_bias(x: np.ndarray, b: np.ndarray) -> None:
    """``x[t] += b`` for every row t."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += b[i]


@nb.njit(**KERNEL)
def _best_and_shift(logits: np.ndarray, best: np.ndarray, shifted: np.ndarray) -> float:
    """The ``len(best)`` best ids into ``best`` and ``shifted = max(logits - peak, -87)``
    (finite, for ``exp_into``); returns the peak."""
    n, k = logits.shape[0], best.shape[0]
    vals = np.full(k, -np.inf, np.float32)
    best[:] = -1
    for i in range(n):
        v = logits[i]
        if v > vals[k - 1] or (best[k - 1] < 0 and v == vals[k - 1]):
            j = k - 1
            while j > 0 and (v > vals[j - 1] or best[j - 1] < 0):
                vals[j], best[j] = vals[j - 1], best[j - 1]
                j -= 1
            vals[j], best[j] = v, i
    peak = vals[0]
    for i in range(n):
        shifted[i] = max(logits[i] - peak, _EXP_LO)
    return peak


@nb.njit(**KERNEL)
def best_and_log_z(logits: np.ndarray, best: np.ndarray) -> float:
    """The ``len(best)`` largest logits' ids into ``best`` (largest first; ties: the lower id first;
    ``1 <= len(best) <= len(logits)``, a finite peak) and ``log(sum(exp(logits)))``, in one pass
    and one vectorized exp: TOPK's figures for every token of every request, which
    ``argpartition`` and a float64 ``np.exp`` over the vocabulary took 0.65 ms a token to give. The
    sum is float64 over ``exp_into``'s float32 terms: log Z within ~3e-7."""
    n = logits.shape[0]
    shifted, e = np.empty(n, np.float32), np.empty(n, np.float32)
    peak = _best_and_shift(logits, best, shifted)
    exp_into(shifted, e)
    total = 0.0
    for i in range(n):
        total += np.float64(e[i])
    return np.float64(peak) + np.log(total)
