"""IEEE half-precision values stored as their bits in uint16 arrays, converted one scalar at a time.

The KV cache keeps keys and values as halves by default (as llama.cpp does): half the bytes of
float32, and at long contexts decode attention is bound by those bytes, not by its arithmetic.
numba has no float16 arrays on the CPU, so a cache of halves is ``uint16`` and the kernels convert
here: each function is one LLVM conversion, which LLVM vectorizes in a loop (``vcvtph2ps`` and
``vcvtps2ph`` on x86). Rounding to half is to nearest, ties to even, as numpy's ``astype``.
``stored``/``loaded`` let one kernel serve a float32 cache (``--kv-type f32``) too: numba picks
the conversion, or none, from the cache's dtype when it compiles.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


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
