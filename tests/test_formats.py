"""The block-format table: one source for geometry, kind and packing, and no silent fallback for a
type the kernels do not compute on."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from colibri.store.blocks import dequantize, dequantize_row
from colibri.store.formats import FORMATS, SUPPORTED, GGMLType, Kind, computed_format, quantize
from colibri.store.packed import make_weight, packed_nbytes

UNSUPPORTED = [t for t in GGMLType if t not in SUPPORTED]


def test_every_type_has_its_geometry_and_the_computed_ones_everything():
    assert set(FORMATS) == set(GGMLType)
    for t, fmt in FORMATS.items():
        assert fmt.gtype == t and fmt.block >= 1 and fmt.nbytes >= 1
        if t in SUPPORTED and fmt.kind != Kind.BLOCKS:
            assert fmt.dequantize and fmt.quantize
        if t in SUPPORTED:  # packing layouts exactly for the packed kinds
            assert (fmt.pack is not None) == (fmt.kind in (Kind.Q4, Kind.Q8))


def test_geometry_is_ggmls():
    """Block sizes as the gguf package (ggml's own table) has them, for every type it knows."""
    for t, fmt in FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))] == (fmt.block, fmt.nbytes), t.name


@pytest.mark.parametrize("gtype", UNSUPPORTED, ids=lambda t: t.name)
def test_a_type_the_kernels_do_not_compute_on_raises_everywhere(gtype: GGMLType):
    fmt = FORMATS[gtype]
    raw = np.zeros((32, 4 * fmt.nbytes), np.uint8)
    with pytest.raises(ValueError):
        computed_format(int(gtype))
    with pytest.raises(ValueError):
        make_weight([(raw, int(gtype))], 4 * fmt.block)
    with pytest.raises(ValueError):
        packed_nbytes([(32, int(gtype))], 4 * fmt.block)
    with pytest.raises(ValueError):
        dequantize_row(raw[0], int(gtype), np.empty(4 * fmt.block, np.float32))
    with pytest.raises(ValueError):
        dequantize(raw, gtype, 4 * fmt.block)
    with pytest.raises(ValueError):
        quantize(np.zeros(4 * fmt.block, np.float32), gtype)


def test_an_id_that_is_no_type_raises():
    with pytest.raises(ValueError):
        computed_format(99)
