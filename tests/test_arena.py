"""The lifetime arena (``colibri/store/arena.py``): its arrays are zeroed, aligned, writable and
apart; a mapping goes when its last array does; a model's packed weights land in it, in memory
advised for huge pages, with the same bits as in NumPy's heap."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import numpy as np
import pytest

from colibri import settings
from colibri.model.loader import Model
from colibri.store.arena import ALIGN, CHUNK, Arena
from colibri.store.gguf import GGUFFile
from colibri.store.packed import make_weight

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mappings() -> list[tuple[int, int]]:
    out = []
    for line in open("/proc/self/maps"):
        lo, hi = line.split()[0].split("-")
        out.append((int(lo, 16), int(hi, 16)))
    return out


def _mapped(address: int) -> bool:
    return any(lo <= address < hi for lo, hi in _mappings())


def test_arrays_are_zeroed_aligned_writable_and_apart():
    arena = Arena()
    shapes = [((3, 5), np.float32), ((1000,), np.uint16), ((7, 9, 11), np.uint8), ((64,), np.float64)]
    arrays = [arena.empty(shape, dtype) for shape, dtype in shapes]
    for a, (shape, dtype) in zip(arrays, shapes, strict=True):
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % ALIGN == 0 and not a.any()
        a[...] = 7
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # apart
    assert all((a == 7).all() for a in arrays)  # each write stayed in its own array


def test_a_full_chunk_starts_another_and_a_big_array_maps_its_own():
    arena = Arena()
    first = arena.empty((CHUNK // 2,), np.uint8)
    second = arena.empty((CHUNK // 2 + 1,), np.uint8)  # does not fit beside the first
    assert abs(second.ctypes.data - first.ctypes.data) >= CHUNK // 2
    big = arena.empty((CHUNK + 1,), np.uint8)
    big[-1] = 1
    assert big.nbytes == CHUNK + 1 and big[-1] == 1


def test_a_mapping_goes_with_its_last_array():
    arena = Arena()
    big = arena.empty((CHUNK * 2,), np.uint8)
    address = big.ctypes.data
    assert _mapped(address)
    del big
    gc.collect()
    assert not _mapped(address)


def test_packing_into_the_arena_gives_the_same_bits():
    g = GGUFFile(settings.default_model_path())
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        parts, n_cols = [(g.raw(name), int(g.tensors[name].gtype))], g.tensors[name].shape[0]
        heap, arena = make_weight(parts, n_cols), make_weight(parts, n_cols, arena=Arena())
        for field in ("q", "d", "m", "dh", "mh", "f"):
            assert np.array_equal(getattr(heap, field), getattr(arena, field)), (name, field)


def test_a_models_weights_are_in_huge_page_memory_where_the_kernel_gives_it():
    """The mapping holding a model's packed weights is advised for huge pages (``hg``) and
    eligible for them: whether the kernel finds free 2 MiB pages at that moment is its business
    (it compacts for advised mappings; docs/performance.md measures the pages it gave)."""
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip(f"this kernel gives no transparent huge pages ({THP}: "
                    f"{THP.read_text().strip() if THP.exists() else 'absent'})")
    model = Model(settings.default_model_path())
    q = model.decoder.attn[0].wqkv.q
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= q.ctypes.data < int(m[2], 16)
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    assert "hg" in fields["VmFlags"], fields["VmFlags"]
    if "THPeligible" in fields:
        assert fields["THPeligible"] == ["1"]
