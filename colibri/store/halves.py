"""IEEE halves in compiled code, stored as their bits (uint16, or two bytes of a GGUF block): the one
conversion between halves and float32 that the decoders and kernels use.

numba has no float16 on the CPU, so each conversion is one LLVM instruction written as an intrinsic
(``vcvtph2ps``/``vcvtps2ph`` on x86, vectorized in a loop): every half widens exactly, and rounding
to half is to nearest, ties to even, as numpy's ``astype``. The scales of the file's blocks are
halves (``half``); so are the KV cache's keys and values by default, llama.cpp's default cache
type: half float32's bytes, which bound decode attention at long contexts. ``stored``/``loaded``
let one kernel serve a float32 cache (``--kv-type f32``) too: numba picks the conversion, or none,
from the cache's dtype when it compiles.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from colibri.store.numerics import KERNEL


@intrinsic
def to_half(typingctx, value):  # noqa: ANN001, ANN201
    """A float32 rounded to a half: its 16 bits."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def from_half(typingctx, bits):  # noqa: ANN001, ANN201
    """The float32 value of a half's 16 bits (exact: every half is a float32)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@nb.njit(inline="always", **KERNEL)
def half(lo: np.uint8, hi: np.uint8) -> np.float32:
    """The IEEE half whose little-endian bytes are (lo, hi), as float32."""
    return from_half(np.uint16(np.int64(lo) | (np.int64(hi) << 8)))


def stored(cache: object, value: float) -> object:
    """``value`` as ``cache`` (a KV array) holds it: a half's bits, or the float32 itself."""
    raise NotImplementedError("numba only")


def loaded(element: object) -> float:
    """A KV array's element as float32: widened from a half's bits, or the float32 itself."""
    raise NotImplementedError("numba only")


@overload(stored, inline="always")
def _stored(cache, value):  # noqa: ANN001, ANN202
    if isinstance(cache, types.Array) and cache.dtype == types.uint16:
        return lambda cache, value: to_half(value)
    return lambda cache, value: value


@overload(loaded, inline="always")
def _loaded(element):  # noqa: ANN001, ANN202
    if element == types.uint16:
        return lambda element: from_half(element)
    return lambda element: element
