"""MXFP4 (gpt-oss's experts) against gguf-py's reference, bit for bit: the kernels' decoder on random
blocks over every exponent byte and nibble, and our quantizer on random values (llama.cpp's C
quantizer is ``test_quantize_k.py``'s oracle; its dot products ``test_kernels_blocks.py``'s)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from colibri.store.blocks import dequantize, dequantize_row
from colibri.store.formats import FORMATS, GGMLType, quantize
from colibri.store.lanes import lane_row

MXFP4 = GGMLType.MXFP4
NBYTES = FORMATS[MXFP4].nbytes


def random_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random bytes: every exponent from 0 (denormal scales) to 254, every nibble (255 scales to
    2^127, whose doubled values overflow to inf in float32 as in ggml)."""
    blocks = rng.integers(0, 256, (n, NBYTES), dtype=np.uint8)
    blocks[:, 0] = np.arange(n) % 255
    return blocks


def test_the_decoder_is_ggufs_dequantizer_bit_for_bit():
    raw = random_blocks(np.random.default_rng(39), 255 * 4)
    with np.errstate(over="ignore"):  # exponent 254's doubled values overflow to inf, as in ggml
        want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    got = dequantize(raw, MXFP4, raw.shape[0] * 32)
    assert np.array_equal(got.view(np.uint32), want.reshape(-1).view(np.uint32))
    row = np.empty(raw.shape[0] * 32, np.float32)
    dequantize_row(raw.reshape(-1), int(MXFP4), row)
    assert np.array_equal(row.view(np.uint32), want.reshape(-1).view(np.uint32))


def test_lanes_are_the_decoded_values():
    """Packed for the integer kernels: d * q + m is the decoded value, exactly (a power of two
    times a small integer)."""
    raw = random_blocks(np.random.default_rng(5), 64)
    raw[:, 0] = np.random.default_rng(6).integers(100, 140, 64)
    q, d, m = np.empty(64 * 32, np.uint8), np.empty(64, np.float32), np.empty(64, np.float32)
    lane_row(raw.reshape(-1), int(MXFP4), q, d, m)
    values = np.repeat(d, 32) * q.astype(np.float32) + np.repeat(m, 32)
    assert np.array_equal(values, dequantize(raw, MXFP4, 64 * 32))


@pytest.mark.parametrize("scale", [1.0, 0.02, 3e-5, 7e3])
def test_the_quantizer_is_ggufs_bit_for_bit(scale: float):
    rng = np.random.default_rng(int(scale * 1000) % 2**32)
    x = (rng.standard_normal((128, 32)) * scale).astype(np.float32)
    x[3] = 0.0  # a block of zeros: exponent byte 0
    x[5, ::2] = np.float32(scale) * 6  # ties between grid points
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)
    got = quantize(x, MXFP4)
    assert np.array_equal(got, want.reshape(-1))
    # and the round trip is within the grid's coarsest step of each value, 4 d (the scale d is
    # 2^(floor(log2 amax) - 3): the largest values, up to 16 d, clip to 12 d)
    back = dequantize(got, MXFP4, x.size).reshape(x.shape)
    d = 2.0 ** (np.floor(np.log2(np.abs(x).max(axis=1) + 1e-45)) - 3)
    assert np.all(np.abs(back - x) <= 4 * d[:, None])
