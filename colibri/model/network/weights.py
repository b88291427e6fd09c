"""Reading tensors out of the file into the forms the network computes with: packed matrices
(``colibri.store.packed``) for the matmuls, float32 vectors and small matrices for the rest."""

from __future__ import annotations

import numpy as np

from colibri.store.arena import Arena
from colibri.store.blocks import dequantize_row
from colibri.store.gguf import GGUFFile
from colibri.store.packed import EMPTY_WEIGHT, KIND_BLOCKS, Weight, make_weight, packed_nbytes

EMPTY_VECTOR = np.zeros(0, np.float32)  # an optional vector the file lacks: length 0, one numba type
# The packed matrices of every model this process loads: they live as long as their model, in
# huge pages where the kernel gives them (``arena.py``: a decode step streams them all).
LIFETIME = Arena()


def load_weight(gguf: GGUFFile, *names: str) -> Weight:
    """One matrix from one or more tensors of the same row length, stacked by rows."""
    infos = [gguf.require_supported(n) for n in names]
    parts = [(gguf.raw(n), int(i.gtype)) for n, i in zip(names, infos, strict=True)]
    weight = make_weight(parts, infos[0].shape[0], arena=LIFETIME)
    if weight.kind != KIND_BLOCKS:  # packed: the file's pages are not read again
        for name in names:
            gguf.release(name)
    return weight


def load_stack_or_apart(gguf: GGUFFile, *names: str) -> tuple[Weight, Weight]:
    """``names`` stacked as one matrix, one matmul (and ``EMPTY_WEIGHT``); or, where the last
    one's format would widen the stack's packing, the others stacked and the last apart. A
    ``_K_M`` file's Q6_K ``attn_v`` beside Q4_K ``attn_q`` and ``attn_k`` made all three Q8 of
    16-value blocks: 1.5x the bytes each token reads (65 MB a token where the file's q, k and v
    hold 44, on the qwen3moe benchmark file)."""
    infos = [gguf.require_supported(n) for n in names]
    parts = [(int(i.shape[1]), int(i.gtype)) for i in infos]  # (rows, block type): matrices
    n_cols = int(infos[0].shape[0])
    if packed_nbytes(parts, n_cols) <= packed_nbytes(parts[:-1], n_cols) + packed_nbytes(parts[-1:], n_cols):
        return load_weight(gguf, *names), EMPTY_WEIGHT
    return load_weight(gguf, *names[:-1]), load_weight(gguf, names[-1])


def load_vector(gguf: GGUFFile, name: str) -> np.ndarray:
    """A tensor (norm weights, biases) as a flat float32 vector, dequantized if stored otherwise."""
    info = gguf.require_supported(name)
    out = np.empty(info.n_elements, dtype=np.float32)
    dequantize_row(gguf.raw(name).reshape(-1), int(info.gtype), out)
    gguf.release(name)  # the copy is what is read
    return out


def load_matrix(gguf: GGUFFile, name: str) -> np.ndarray:
    """A small matrix (a router) widened to float32 [rows, row length]."""
    info = gguf.require_supported(name)
    raw = gguf.raw(name)
    out = np.empty((raw.shape[0], info.shape[0]), np.float32)
    for r in range(raw.shape[0]):
        dequantize_row(raw[r], int(info.gtype), out[r])
    gguf.release(name)  # the copy is what is read: a MoE's routers are ~0.3% of the file
    return out


def optional_vector(gguf: GGUFFile, name: str) -> np.ndarray:
    """``load_vector``, or an empty vector when the file has no such tensor."""
    return load_vector(gguf, name) if name in gguf.tensors else EMPTY_VECTOR


def named_norm(gguf: GGUFFile, prefix: str, name: str) -> np.ndarray:
    """The norm ``{prefix}{name}.weight`` an architecture has (it must be in the file), or an
    empty vector for an architecture without one (``name`` "")."""
    return load_vector(gguf, f"{prefix}{name}.weight") if name else EMPTY_VECTOR


def stacked_bias(gguf: GGUFFile, names: list[str], sizes: list[int]) -> np.ndarray:
    """Biases of row-stacked matrices (q, k, v), stacked the same way; empty when none exists, zeros
    for a part that has none."""
    if not any(n in gguf.tensors for n in names):
        return EMPTY_VECTOR
    return np.concatenate([
        load_vector(gguf, n) if n in gguf.tensors else np.zeros(size, np.float32)
        for n, size in zip(names, sizes, strict=True)
    ])
