"""Block formats: their geometry, and plain numpy dequantizers that serve as the reference.

The kernels in ``colibri.model.kernels`` compute on these blocks directly; the functions here are
the slow, obviously-correct definition the kernel tests compare against.
"""

from __future__ import annotations

import enum

import numpy as np


class GGMLType(enum.IntEnum):
    """ggml's tensor type ids, as GGUF stores them."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


# (elements per block, bytes per block) for every type whose size we know, so that a file holding
# a type we cannot compute on can still be opened, listed and bounds-checked.
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
}

# The formats the kernels compute on.
SUPPORTED: frozenset[GGMLType] = frozenset(
    {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1}
)


def row_nbytes(gtype: GGMLType, n_elements: int) -> int:
    """Bytes of one row of ``n_elements`` values (rows are whole blocks in GGUF)."""
    per_block, block_bytes = BLOCK_GEOMETRY[gtype]
    if n_elements % per_block:
        raise ValueError(f"{gtype.name} rows must be a multiple of {per_block} values")
    return n_elements // per_block * block_bytes


def dequantize(raw: np.ndarray, gtype: GGMLType, n_elements: int) -> np.ndarray:
    """Reference dequantization of ``n_elements`` values from the bytes ``raw`` to float32."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if gtype == GGMLType.F32:
        return raw.view(np.float32)[:n_elements].copy()
    if gtype == GGMLType.F16:
        return raw.view(np.float16)[:n_elements].astype(np.float32)
    if gtype == GGMLType.BF16:
        return (raw.view(np.uint16)[:n_elements].astype(np.uint32) << 16).view(np.float32)
    per_block, block_bytes = BLOCK_GEOMETRY[gtype]
    blocks = raw[: n_elements // per_block * block_bytes].reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if gtype == GGMLType.Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    if gtype in (GGMLType.Q4_0, GGMLType.Q4_1):
        qs = blocks[:, 2:18] if gtype == GGMLType.Q4_0 else blocks[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if gtype == GGMLType.Q4_0:
            return (d * (q - 8.0)).reshape(-1)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (d * q + m).reshape(-1)
    raise ValueError(f"no dequantizer for {gtype.name}")


def quantize(values: np.ndarray, gtype: GGMLType) -> np.ndarray:
    """Reference quantization to the bytes of ``gtype`` (round-to-nearest, as ggml does)."""
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if gtype == GGMLType.F32:
        return x.view(np.uint8).copy()
    if gtype == GGMLType.F16:
        return x.astype(np.float16).view(np.uint8).copy()
    if gtype == GGMLType.BF16:
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.view(np.uint8).copy()
    blocks = x.reshape(-1, 32)
    if gtype == GGMLType.Q8_0:
        amax = np.abs(blocks).max(axis=1)
        d = amax / 127.0
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0.0)
        q = np.clip(np.round(blocks * inv[:, None]), -127, 127).astype(np.int8)
        return np.concatenate(
            [d.astype(np.float16)[:, None].view(np.uint8), q.view(np.uint8)], axis=1
        ).reshape(-1)
    if gtype == GGMLType.Q4_0:
        idx = np.abs(blocks).argmax(axis=1)
        mx = blocks[np.arange(len(blocks)), idx]
        d = mx / -8.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0.0)
        q = np.clip(np.floor(blocks * inv[:, None] + 8.5), 0, 15).astype(np.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
        return np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), qs], axis=1).reshape(-1)
    if gtype == GGMLType.Q4_1:
        lo, hi = blocks.min(axis=1), blocks.max(axis=1)
        d = (hi - lo) / 15.0
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0.0)
        q = np.clip(np.floor((blocks - lo[:, None]) * inv[:, None] + 0.5), 0, 15).astype(np.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
        head = np.stack([d.astype(np.float16), lo.astype(np.float16)], axis=1).view(np.uint8)
        return np.concatenate([head, qs], axis=1).reshape(-1)
    raise ValueError(f"no quantizer for {gtype.name}")
