"""The numbers the store and kernels share (``colibri.store.numerics``, ``colibri.store.halves``), and
the import graph they sit at the bottom of."""

from __future__ import annotations

import subprocess
import sys

import grimp
import numba as nb
import numpy as np

from colibri.store.halves import from_half, half, loaded, stored, to_half
from colibri.store.numerics import EXACT, FASTMATH, KERNEL


def test_no_import_cycle() -> None:
    """No module of colibri imports, directly or through others, a module that imports it back.

    Every import counts, a function's local import and a ``TYPE_CHECKING`` one too: deferring an
    import hides a cycle from import time, not from the reader, and a cycle makes neither side the
    one below. Each cycle is named by one of its edges and the chain that closes it."""
    graph = grimp.build_graph("colibri", cache_dir=None)
    cycles, seen = [], set()
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back and frozenset(back) not in seen:
                seen.add(frozenset(back))
                cycles.append(" -> ".join((importer, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_numerics_imports_nothing_compiled() -> None:
    """The block table and the quantizers build on ``numerics``, and the HTTP server imports the
    table: it must not bring numba (nor llvmlite) in."""
    code = ("import sys, colibri.store.numerics, colibri.store.formats; "
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_policy_keeps_infinities_and_nans() -> None:
    """The kernels compare with -inf and test for NaN (a softmax's start, masked logits, a draw's
    depth): the policy must not let the compiler assume them away."""
    assert not FASTMATH & {"nnan", "ninf", "fast"}
    assert KERNEL["fastmath"] is FASTMATH and "fastmath" not in EXACT


@nb.njit(**KERNEL)
def _masked_peak(x: np.ndarray) -> tuple[float, int]:
    """A masked row's peak and its count of -inf and NaN, compiled with the kernels' options."""
    peak, odd = np.float32(-np.inf), 0
    for v in x:
        peak = max(peak, v)
        if v == -np.inf or v != v:
            odd += 1
    return peak, odd


def test_kernel_options_compare_with_infinities() -> None:
    x = np.array([-np.inf, -3.0, np.nan, -np.inf, -2.5], np.float32)
    peak, odd = _masked_peak(x)
    assert odd == 3 and peak == np.float32(-2.5)
    assert _masked_peak(np.full(4, -np.inf, np.float32)) == (-np.inf, 4)


@nb.njit(**KERNEL)
def _widen_bytes(raw: np.ndarray, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        out[i] = half(raw[2 * i], raw[2 * i + 1])


@nb.njit(**KERNEL)
def _round_trip(x: np.ndarray, bits: np.ndarray, back: np.ndarray) -> None:
    for i in range(x.shape[0]):
        bits[i] = to_half(x[i])
        back[i] = from_half(bits[i])


def test_halves_match_numpy_for_every_bit_pattern() -> None:
    """Every one of the 65,536 halves widens to numpy's float32 (NaN stays NaN), and a float32 rounds
    to numpy's half: the one conversion is exact both ways."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.empty(65536, np.float32)
    _widen_bytes(bits.view(np.uint8), got)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))

    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 100,
                        np.array([65504.0, 65520.0, -1e-8, 6e-8, 0.0, -0.0, np.inf], np.float32)])
    out_bits, back = np.empty(x.shape, np.uint16), np.empty(x.shape, np.float32)
    _round_trip(x, out_bits, back)
    with np.errstate(over="ignore"):  # 65520 and inf round to inf, as they should
        want_bits = x.astype(np.float16)
    assert np.array_equal(out_bits, want_bits.view(np.uint16))
    assert np.array_equal(back.view(np.uint32), want_bits.astype(np.float32).view(np.uint32))


@nb.njit(**KERNEL)
def _through_cache(cache: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        cache[i] = stored(cache, x[i])
        out[i] = loaded(cache[i])


def test_kv_cache_elements_take_the_cache_type() -> None:
    x = np.array([1.0 / 3.0, -2.5e-3, 70000.0], np.float32)
    halves, out = np.empty(3, np.uint16), np.empty(3, np.float32)
    _through_cache(halves, x, out)
    with np.errstate(over="ignore"):  # 70000 is beyond the halves: inf
        want = x.astype(np.float16)
    assert np.array_equal(halves, want.view(np.uint16))
    assert np.array_equal(out, want.astype(np.float32))
    floats = np.empty(3, np.float32)
    _through_cache(floats, x, out)
    assert np.array_equal(floats, x) and np.array_equal(out, x)
