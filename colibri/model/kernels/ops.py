"""Element-wise and row-wise kernels of the transformer block: RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import numba as nb
import numpy as np

_JIT = dict(nogil=True, cache=True, fastmath=True)


@nb.njit(**_JIT)
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


@nb.njit(**_JIT)
def rope_frequencies(head_dim: int, rope_dim: int, freq_base: float) -> np.ndarray:
    """Inverse frequencies ``base^(-2i/rope_dim)`` for the rotated pairs of a head."""
    inv = np.empty(rope_dim // 2, dtype=np.float64)
    for i in range(rope_dim // 2):
        inv[i] = freq_base ** (-2.0 * i / rope_dim)
    return inv


@nb.njit(**_JIT)
def rope(x: np.ndarray, positions: np.ndarray, n_heads: int, head_dim: int, inv_freq: np.ndarray) -> None:
    """Rotate adjacent pairs (ggml's 'normal' RoPE, the llama layout in GGUF) in place.

    ``x`` is (T, n_heads * head_dim); row t sits at ``positions[t]``. Pairs beyond ``rope_dim``
    (the length of ``2 * inv_freq``) are left as they are (partial rotary).
    """
    half = inv_freq.shape[0]
    for t in range(x.shape[0]):
        p = np.float64(positions[t])
        for i in range(half):
            angle = p * inv_freq[i]
            c = np.float32(np.cos(angle))
            s = np.float32(np.sin(angle))
            for h in range(n_heads):
                j = h * head_dim + 2 * i
                a = x[t, j]
                b = x[t, j + 1]
                x[t, j] = a * c - b * s
                x[t, j + 1] = a * s + b * c


@nb.njit(**_JIT)
def swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    """``gate = silu(gate) * up`` in place."""
    t_rows, k = gate.shape
    for t in range(t_rows):
        for i in range(k):
            g = gate[t, i]
            gate[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


@nb.njit(**_JIT)
def add_into(x: np.ndarray, y: np.ndarray) -> None:
    """``x += y`` for 2-D float32 arrays (a loop numba fuses, with no temporary)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += y[t, i]
