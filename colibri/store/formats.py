"""Block formats: one table entry each (geometry, kind, packing layout), and plain numpy
(de)quantizers that serve as the reference.

The packed layout (``colibri.store.packed``) and the kernels (``colibri.model.kernels``) compute on
these blocks; the functions here are the slow, obviously-correct definition their tests compare
against, and what ``coli convert`` writes with. A format computed on in place has no numpy
dequantizer: the kernels' decoder is its definition, and ``blocks.dequantize`` dequantizes every
format. The geometry ggml fixes (``BLOCK``, ``QK_K``) is ``numerics``'.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from colibri.store.numerics import BLOCK, QK_K
from colibri.store.quantize_k import (
    quantize_mxfp4,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q4_k,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q5_k,
    quantize_q6_k,
    quantize_q8_0,
)


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
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


class Kind(enum.IntEnum):
    """How the kernels compute on a format's packed copy (``colibri.store.packed``)."""

    FLOAT = 0  # widened to float32 rows, multiplied by BLAS
    Q4 = 1  # 4-bit quants, two per byte, with a float32 scale and offset per block
    Q8 = 2  # 8-bit quants (stored biased, q + 128), with a float32 scale and offset per block
    BLOCKS = 3  # the file's own blocks, decoded a few rows at a time (``colibri.store.blocks``)
    Q5 = 4  # 5-bit quants: Q4's nibbles and a plane of fifth bits (only the Q5 formats, packed)
    Q6 = 5  # 6-bit quants: Q4's nibbles and a plane of two high bits, 16-value blocks (Q6_K, packed)


class PackLayout(NamedTuple):
    """Where a quantized block keeps its parts, for packing: ``value = d * q + m``."""

    quants_at: int  # byte offset of the quants in the block (after the f16 scale, and min if any)
    min_at: int  # byte offset of an f16 min (Q4_1), or -1: the offset is ``offset_scale * d``
    offset_scale: float  # m = offset_scale * d when there is no stored min (Q4_0: -8, Q8_0: -128)
    flip: int  # XOR applied to each quant byte (Q8_0: 0x80, so a signed quant becomes q + 128)


Dequantize = Callable[[np.ndarray], np.ndarray]  # raw blocks [n, bytes] -> float32 values [n * block]
Quantize = Callable[[np.ndarray], np.ndarray]  # float32 values [n, block] -> raw blocks [n, bytes]


class BlockFormat(NamedTuple):
    """One block format. ``kind`` None: a file holding it opens, lists and bounds-checks, but the
    kernels cannot compute on it; ``dequantize``/``quantize`` are the numpy reference."""

    gtype: GGMLType
    block: int  # elements per block
    nbytes: int  # bytes per block
    kind: Kind | None = None
    pack: PackLayout | None = None  # the quantized formats the kernels compute on
    dequantize: Dequantize | None = None
    quantize: Quantize | None = None


# -- the reference (de)quantizers, one pair per format ---------------------------------------------


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of every block, as a float32 column."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Quants j (low nibble of byte j) and j + 16 (high nibble) of each block, in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:18]) - 8.0)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:20]) + _f16(blocks, 2)


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.reshape(-1).view(np.float32)


def _quantize_f32(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, 1).view(np.uint8)


def _dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.reshape(-1).view(np.float16).astype(np.float32)


def _quantize_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _quantize_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as ggml does."""
    bits = x.reshape(-1).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.reshape(-1, 1).view(np.uint8)


# -- the table -------------------------------------------------------------------------------------


def _table(*entries: BlockFormat) -> dict[GGMLType, BlockFormat]:
    return {f.gtype: f for f in entries}


# Every type whose size we know, so that a file holding a type we cannot compute on can still be
# opened, listed and bounds-checked. Adding a format: docs/architecture.md, "Adding a block format".
FORMATS: dict[GGMLType, BlockFormat] = _table(
    BlockFormat(GGMLType.F32, 1, 4, Kind.FLOAT, None, _dequantize_f32, _quantize_f32),
    BlockFormat(GGMLType.F16, 1, 2, Kind.FLOAT, None, _dequantize_f16, _quantize_f16),
    BlockFormat(GGMLType.BF16, 1, 2, Kind.FLOAT, None, _dequantize_bf16, _quantize_bf16),
    BlockFormat(GGMLType.Q4_0, BLOCK, 18, Kind.Q4,
                PackLayout(quants_at=2, min_at=-1, offset_scale=-8.0, flip=0),
                _dequantize_q4_0, quantize_q4_0),
    BlockFormat(GGMLType.Q4_1, BLOCK, 20, Kind.Q4,
                PackLayout(quants_at=4, min_at=2, offset_scale=0.0, flip=0),
                _dequantize_q4_1, quantize_q4_1),
    BlockFormat(GGMLType.Q8_0, BLOCK, 34, Kind.Q8,
                PackLayout(quants_at=2, min_at=-1, offset_scale=-128.0, flip=0x80),
                _dequantize_q8_0, quantize_q8_0),
    # Computed on in place (Kind.BLOCKS): their reference dequantizer is the kernels' decoder (``blocks``).
    BlockFormat(GGMLType.Q5_0, BLOCK, 22, Kind.BLOCKS, quantize=quantize_q5_0),
    BlockFormat(GGMLType.Q5_1, BLOCK, 24, Kind.BLOCKS, quantize=quantize_q5_1),
    BlockFormat(GGMLType.Q2_K, QK_K, 84, Kind.BLOCKS),
    BlockFormat(GGMLType.Q3_K, QK_K, 110, Kind.BLOCKS),
    BlockFormat(GGMLType.Q4_K, QK_K, 144, Kind.BLOCKS, quantize=quantize_q4_k),
    BlockFormat(GGMLType.Q5_K, QK_K, 176, Kind.BLOCKS, quantize=quantize_q5_k),
    BlockFormat(GGMLType.Q6_K, QK_K, 210, Kind.BLOCKS, quantize=quantize_q6_k),
    BlockFormat(GGMLType.IQ4_NL, BLOCK, 18, Kind.BLOCKS),
    BlockFormat(GGMLType.IQ4_XS, QK_K, 136, Kind.BLOCKS),
    # gpt-oss's experts: an E8M0 scale byte, then 16 bytes of E2M1 nibbles (OCP microscaling).
    BlockFormat(GGMLType.MXFP4, BLOCK, 17, Kind.BLOCKS, quantize=quantize_mxfp4),
    # Known sizes only: listed and bounds-checked, not computed on.
    BlockFormat(GGMLType.Q8_1, BLOCK, 40),
    BlockFormat(GGMLType.Q8_K, QK_K, 292),
    BlockFormat(GGMLType.IQ2_XXS, QK_K, 66),
    BlockFormat(GGMLType.IQ2_XS, QK_K, 74),
    BlockFormat(GGMLType.IQ3_XXS, QK_K, 98),
    BlockFormat(GGMLType.IQ1_S, QK_K, 50),
    BlockFormat(GGMLType.IQ3_S, QK_K, 110),
    BlockFormat(GGMLType.IQ2_S, QK_K, 82),
    BlockFormat(GGMLType.IQ1_M, QK_K, 56),
    BlockFormat(GGMLType.TQ1_0, QK_K, 54),
    BlockFormat(GGMLType.TQ2_0, QK_K, 66),
    BlockFormat(GGMLType.I8, 1, 1),
    BlockFormat(GGMLType.I16, 1, 2),
    BlockFormat(GGMLType.I32, 1, 4),
    BlockFormat(GGMLType.I64, 1, 8),
    BlockFormat(GGMLType.F64, 1, 8),
)

# (elements per block, bytes per block), derived from the table.
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {t: (f.block, f.nbytes) for t, f in FORMATS.items()}

# The formats the kernels compute on.
SUPPORTED: frozenset[GGMLType] = frozenset(t for t, f in FORMATS.items() if f.kind is not None)


def computed_format(gtype: int) -> BlockFormat:
    """The table entry of a type the kernels compute on; ValueError for any other (never a silent
    fallback to another format's layout)."""
    fmt = FORMATS.get(GGMLType(gtype)) if gtype in GGMLType._value2member_map_ else None
    if fmt is None or fmt.kind is None:
        raise ValueError(f"block type {gtype} is not one the kernels compute on")
    return fmt


def row_nbytes(gtype: GGMLType, n_elements: int) -> int:
    """Bytes of one row of ``n_elements`` values (rows are whole blocks in GGUF)."""
    per_block, block_bytes = BLOCK_GEOMETRY[gtype]
    if n_elements % per_block:
        raise ValueError(f"{gtype.name} rows must be a multiple of {per_block} values")
    return n_elements // per_block * block_bytes


def quantize(values: np.ndarray, gtype: GGMLType) -> np.ndarray:
    """Reference quantization to the bytes of ``gtype``, bit-exact with ggml's ``quantize_row_*_ref``
    for the quantized formats (``quantize_k``)."""
    fmt = FORMATS.get(gtype)
    if fmt is None or fmt.quantize is None:
        raise ValueError(f"no quantizer for {GGMLType(gtype).name}")
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, fmt.block)
    return np.ascontiguousarray(fmt.quantize(x)).reshape(-1).copy()
