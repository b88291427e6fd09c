"""``colibri.store.quantize_k`` against llama.cpp's own reference quantizers, byte for byte.

The oracle is ``quantize_row_*_ref`` in the ggml library llama-cpp-python ships (called through
ctypes): what ``llama-quantize`` runs when it has no importance matrix. Skipped only when
llama_cpp is not importable.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from colibri.store import quantize_k

# ggml's name -> (values per block, bytes per block, ours)
TYPES: dict[str, tuple[int, int, Callable[[np.ndarray], np.ndarray]]] = {
    "q8_0": (32, 34, quantize_k.quantize_q8_0),
    "q4_0": (32, 18, quantize_k.quantize_q4_0),
    "q4_1": (32, 20, quantize_k.quantize_q4_1),
    "q5_0": (32, 22, quantize_k.quantize_q5_0),
    "q5_1": (32, 24, quantize_k.quantize_q5_1),
    "q4_K": (256, 144, quantize_k.quantize_q4_k),
    "q5_K": (256, 176, quantize_k.quantize_q5_k),
    "q6_K": (256, 210, quantize_k.quantize_q6_k),
    "mxfp4": (32, 17, quantize_k.quantize_mxfp4),
}
BLOCKS = 64  # blocks of 256 values per distribution (8x as many 32-blocks)


@pytest.fixture(scope="module")
def ggml() -> ctypes.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) not installed")
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    for name in TYPES:
        f = getattr(lib, f"quantize_row_{name}_ref")
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return lib


def reference(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    block, nbytes, _ = TYPES[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.size // block, nbytes), np.uint8)
    getattr(lib, f"quantize_row_{name}_ref")(x.ctypes.data, out.ctypes.data, x.size)
    return out


def ours(name: str, x: np.ndarray) -> np.ndarray:
    block, nbytes, fn = TYPES[name]
    out = fn(np.ascontiguousarray(x, dtype=np.float32).reshape(-1, block))
    assert out.dtype == np.uint8 and out.shape == (x.size // block, nbytes)
    return out


def assert_same(lib: ctypes.CDLL, name: str, x: np.ndarray) -> None:
    want, got = reference(lib, name, x), ours(name, x)
    bad = np.nonzero((want != got).any(axis=1))[0]
    assert len(bad) == 0, (f"{name}: {len(bad)}/{len(want)} blocks differ, first block {bad[0]}: "
                           f"bytes {np.nonzero(want[bad[0]] != got[bad[0]])[0][:8].tolist()}")


def distributions(n: int) -> Iterator[tuple[str, np.ndarray]]:
    """``n`` values of each kind that has tripped a quantizer: signs, ranges, ties, degenerate."""
    rng = np.random.default_rng(14)
    normal = rng.standard_normal(n).astype(np.float32)
    yield "normal", normal
    yield "weights", normal * np.float32(0.02)
    yield "uniform", rng.uniform(-1, 1, n).astype(np.float32)
    yield "positive", rng.uniform(0.1, 1, n).astype(np.float32)
    yield "negative", -rng.uniform(0.1, 1, n).astype(np.float32)
    yield "cauchy", rng.standard_cauchy(n).astype(np.float32)
    yield "tiny", normal * np.float32(1e-6)
    yield "subnormal-scale", normal * np.float32(1e-9)
    yield "denormal", normal * np.float32(1e-40)
    yield "huge", normal * np.float32(3e4)
    yield "overflowing", normal * np.float32(1e30)  # x**2 overflows: NaN scales in Q6_K's search
    zeros = np.zeros(n, np.float32)
    zeros[1::3] = -0.0
    yield "zero", zeros
    yield "constant", np.where(np.arange(n) // 256 % 2, np.float32(0.37), np.float32(-2.5))
    outlier = normal * np.float32(0.01)
    outlier[7::256] = 5.0
    yield "outlier", outlier
    yield "grid", np.round(normal * 8) / np.float32(8)  # many ties of nearest_int and roundf
    yield "two-levels", rng.choice(np.array([-1.0, 0.5], np.float32), n)
    sparse = np.where(rng.random(n) < 0.05, normal, np.float32(0))
    yield "sparse", sparse.astype(np.float32)
    yield "narrow", (1 + rng.random(n) * 1e-6).astype(np.float32)
    yield "bit-patterns", np.nan_to_num(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
                                        .view(np.float32), nan=0.0, posinf=0.0, neginf=0.0)


CASES = list(distributions(BLOCKS * 256))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bit_exact(ggml: ctypes.CDLL, name: str, case: tuple[str, np.ndarray]) -> None:
    with np.errstate(all="ignore"):
        assert_same(ggml, name, case[1])


finite = st.floats(min_value=-1e6, max_value=1e6, width=32, allow_subnormal=True)
scales = st.sampled_from([1.0, 1e-3, 1e-7, 1e3])


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, 256, elements=finite), scale=scales, name=st.sampled_from(list(TYPES)))
def test_bit_exact_any_block(ggml: ctypes.CDLL, x: np.ndarray, scale: float, name: str) -> None:
    """A super-block of arbitrary values (hypothesis shrinks a mismatch to its simplest block)."""
    with np.errstate(all="ignore"):
        assert_same(ggml, name, x * np.float32(scale))


@pytest.mark.parametrize("name", TYPES)
def test_blocks_are_independent(ggml: ctypes.CDLL, name: str) -> None:
    """A block's bytes depend on its values only: quantizing one alone gives the same bytes."""
    block = TYPES[name][0]
    x = np.random.default_rng(1).standard_normal((8, block)).astype(np.float32)
    whole = ours(name, x)
    assert all((ours(name, x[i : i + 1]) == whole[i]).all() for i in range(len(x)))


def test_numba_not_imported_by_the_module() -> None:
    """The block table imports this module, and the HTTP server the table: numba stays out until a
    K-quant is actually computed."""
    import subprocess
    import sys

    code = "import sys, colibri.store.quantize_k; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
