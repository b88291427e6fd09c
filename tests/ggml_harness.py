"""llama.cpp's own CPU arithmetic, through ctypes on the libraries llama-cpp-python ships: the
activation quantizer and dot product ggml-cpu uses for each block type (its type traits), as an
oracle for colibri's kernels on the same blocks."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
import pytest

_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _TypeTraitsCpu(ctypes.Structure):
    """ggml-cpu.h's ``struct ggml_type_traits_cpu``."""

    _fields_ = [("from_float", _FROM_FLOAT), ("vec_dot", _VEC_DOT), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


@lru_cache(maxsize=1)
def _cpu() -> ctypes.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle (make peer)")
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init()
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    return lib


def _traits(gtype: int) -> _TypeTraitsCpu:
    return _cpu().ggml_get_type_traits_cpu(gtype).contents


def llama_matmul(raw_rows: np.ndarray, gtype: int, x: np.ndarray) -> np.ndarray:
    """out[t, r] as llama.cpp computes it: row r's blocks (raw_rows[r]) dotted with activation row
    t after ggml-cpu rounds it to the row type's ``vec_dot_type``."""
    traits = _traits(gtype)
    dot_type = traits.vec_dot_type
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(dot_type)]
    k = x.shape[1]
    out = np.empty((x.shape[0], raw_rows.shape[0]), np.float32)
    s = ctypes.c_float()
    rows = np.ascontiguousarray(raw_rows)
    for t in range(x.shape[0]):
        xt = np.ascontiguousarray(x[t], dtype=np.float32)
        xq = np.zeros(k // block * nbytes, np.uint8)
        _traits(dot_type).from_float(xt.ctypes.data, xq.ctypes.data, k)
        for r in range(rows.shape[0]):
            traits.vec_dot(k, ctypes.addressof(s), 0, rows[r].ctypes.data, 0, xq.ctypes.data, 0, 1)
            out[t, r] = s.value
    return out
