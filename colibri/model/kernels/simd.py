"""512-bit vectors as numba values: the few operations the integer matmul and attention need, each
one LLVM instruction (or a short generic sequence), written as numba intrinsics.

numba's auto-vectorizer never emits the integer dot products that make 4-bit matmuls fast
(AVX-512 VNNI's ``vpdpbusd``: 64 u8 x s8 products summed in fours, one instruction), and it
widens small-integer arithmetic to int64. Here a vector is a numba value of its own type, held in
a register, so a kernel reads as a loop over blocks calling these functions and compiles to the
instructions it names.

``dpbusd`` is the CPU's instruction where the compile target has it (numba's target: the host,
or ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``) and a generic widening multiply-add elsewhere:
integer arithmetic, so both give the same bits (``tests/test_kernels.py`` checks it in a process
compiled without VNNI).
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.errors import TypingError
from numba.extending import intrinsic, models, overload, register_model

LANES = 16  # 32-bit lanes of one vector: 64 bytes, one AVX-512 register
_I8, _I32 = ir.IntType(8), ir.IntType(32)
_VI = ir.VectorType(_I32, LANES)
_VF = ir.VectorType(ir.FloatType(), LANES)
_VB = ir.VectorType(_I8, 4 * LANES)


def target_has_vnni() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI (its own feature string, as it caches)."""
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+avx512vnni" in features.split(",")


class I32x16Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="I32x16")


class F32x16Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="F32x16")


i32x16 = I32x16Type()
f32x16 = F32x16Type()


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001 (numba's signature)
        super().__init__(dmm, fe_type, _VI)


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, _VF)


def _address(context, builder, arrty, arr, idx, vty):  # noqa: ANN001, ANN202
    """Pointer to element ``idx`` of a C-contiguous array, as a pointer to ``vty``."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [idx]), vty.as_pointer())


def _check_c(arr: types.Type) -> None:
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        raise TypingError(f"simd: needs a C-contiguous array, got {arr}")


def _splat(builder, value, vty):  # noqa: ANN001, ANN202
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))


def _vector_load(vty: ir.Type, align: int, result: types.Type, finish=None):  # noqa: ANN001, ANN202
    """An intrinsic ``load(arr, idx)``: a ``vty`` from element ``idx`` of a C-contiguous array,
    then ``finish(builder, value)`` (a broadcast, a widening) where given."""
    def load(typingctx, arr, idx):  # noqa: ANN001, ANN202
        _check_c(arr)

        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            value = builder.load(_address(context, builder, sig.args[0], args[0], args[1], vty), align=align)
            return value if finish is None else finish(builder, value)
        return result(arr, idx), codegen
    return intrinsic(load)


# The 64 bytes of a uint8 array from element ``idx``, as 16 lanes of 4 bytes.
load_bytes = _vector_load(_VI, 1, i32x16)
# Bytes ``idx..idx+3`` of an int8 array as one 32-bit lane, repeated in all 16.
load_quad = _vector_load(_I32, 1, i32x16, lambda builder, v: _splat(builder, v, _VI))
# 16 float32 of an array from element ``idx``.
load_floats = _vector_load(_VF, 4, f32x16)
# 16 IEEE halves (the bits, in a uint16 array) from element ``idx``, widened to float32 (one
# ``vcvtph2ps``).
load_halves = _vector_load(ir.VectorType(ir.HalfType(), LANES), 2, f32x16,
                           lambda builder, v: builder.fpext(v, _VF))


def load_widened(arr: object, idx: int) -> object:
    """16 float32 from a float32 array, or 16 halves widened from a uint16 one (chosen when the
    caller is compiled: a kernel passes whichever array its weight or KV cache keeps)."""
    raise NotImplementedError("numba only")


@overload(load_widened, inline="always")
def _load_widened(arr, idx):  # noqa: ANN001, ANN202
    if isinstance(arr, types.Array) and arr.dtype == types.uint16:
        return lambda arr, idx: load_halves(arr, idx)
    return lambda arr, idx: load_floats(arr, idx)


def _first_lanes(builder, count):  # noqa: ANN001, ANN202
    """The mask of lanes below ``count`` (an i32): a masked load's or store's first lanes."""
    return builder.icmp_signed("<", ir.Constant(_VI, list(range(LANES))), _splat(builder, count, _VI))


@intrinsic
def store_floats(typingctx, arr, row, col, v, n):  # noqa: ANN001, ANN201
    """The first ``n`` lanes of ``v`` into ``arr[row, col:]`` (a 2-D float32 array whose rows
    are contiguous; a masked store, the lanes past ``n`` untouched: a matrix's last group may end
    mid-vector)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 2 and arr.layout in "CA"):
        raise TypingError(f"simd.store_floats: needs a 2-D array, got {arr}")

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        arr_v, row_v, col_v, vec, count = args
        ary = context.make_array(sig.args[0])(context, builder, arr_v)
        idx = [context.cast(builder, row_v, sig.args[1], types.intp),
               context.cast(builder, col_v, sig.args[2], types.intp)]
        item = cgutils.get_item_pointer(context, builder, sig.args[0], ary, idx)
        ptr = builder.bitcast(item, _VF.as_pointer())
        mask = _first_lanes(builder, context.cast(builder, count, sig.args[4], types.int32))
        fnty = ir.FunctionType(ir.VoidType(), [_VF, ptr.type, _I32, mask.type])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.masked.store.v16f32.p0")
        builder.call(fn, [vec, ptr, ir.Constant(_I32, 4), mask])
        return context.get_dummy_value()
    return types.none(arr, row, col, v, n), codegen


@intrinsic
def splat_int(typingctx, v):  # noqa: ANN001, ANN201
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.int32), _VI)
    return i32x16(v), codegen


@intrinsic
def splat_float(typingctx, v):  # noqa: ANN001, ANN201
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)
    return f32x16(v), codegen


@intrinsic
def zeros_int(typingctx):  # noqa: ANN001, ANN201
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return ir.Constant(_VI, [0] * LANES)
    return i32x16(), codegen


@intrinsic
def zeros_float(typingctx):  # noqa: ANN001, ANN201
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return ir.Constant(_VF, [0.0] * LANES)
    return f32x16(), codegen


_NIBBLE = ir.Constant(_VI, [0x0F0F0F0F] * LANES)


def _lanewise(result: types.Type, op):  # noqa: ANN001, ANN202
    """An intrinsic ``f(a)``, or ``f(a, b)`` where ``op`` takes two vectors after the builder:
    ``op(builder, a[, b])`` on whole vectors, one LLVM instruction."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return op(builder, *args)

    def unary(typingctx, a):  # noqa: ANN001, ANN202
        return result(a), codegen

    def binary(typingctx, a, b):  # noqa: ANN001, ANN202
        return result(a, b), codegen
    return intrinsic(binary if op.__code__.co_argcount == 3 else unary)


_FOUR = ir.Constant(_VI, [4] * LANES)
# Each byte's low nibble, as a byte; each byte's high nibble, as a byte.
low_nibbles = _lanewise(i32x16, lambda builder, v: builder.and_(v, _NIBBLE))
high_nibbles = _lanewise(i32x16, lambda builder, v: builder.and_(builder.lshr(v, _FOUR), _NIBBLE))


_FIFTH = ir.Constant(_VI, [0x10101010] * LANES)


@intrinsic
def low_fives(typingctx, v, h, p):  # noqa: ANN001, ANN201
    """Q5 lanes (``colibri.store.packed``): each byte's low nibble of ``v`` with its fifth bit, bit
    ``p`` of the same byte of ``h``, above it (the quants of a block's first half)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        shift = builder.sub(ir.Constant(_I32, 4), context.cast(builder, args[2], sig.args[2], types.int32))
        fifth = builder.and_(builder.shl(args[1], _splat(builder, shift, _VI)), _FIFTH)
        return builder.or_(builder.and_(args[0], _NIBBLE), fifth)
    return i32x16(v, h, p), codegen


@intrinsic
def high_fives(typingctx, v, h, p):  # noqa: ANN001, ANN201
    """Each byte's high nibble of ``v`` with its fifth bit, bit ``4 + p`` of ``h``'s byte (the
    quants of a block's second half)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        shift = context.cast(builder, args[2], sig.args[2], types.int32)
        fifth = builder.and_(builder.lshr(args[1], _splat(builder, shift, _VI)), _FIFTH)
        nibble = builder.and_(builder.lshr(args[0], _FOUR), _NIBBLE)
        return builder.or_(nibble, fifth)
    return i32x16(v, h, p), codegen


_SIXTH = ir.Constant(_VI, [0x30303030] * LANES)


@intrinsic
def low_sixes(typingctx, v, h, p):  # noqa: ANN001, ANN201
    """Q6 lanes (``colibri.store.packed``): each byte's low nibble of ``v`` with its two high
    bits, bits ``2p`` and ``2p + 1`` of the same byte of ``h``, above it (a block's first half)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        p2 = builder.shl(context.cast(builder, args[2], sig.args[2], types.int32), ir.Constant(_I32, 1))
        shift = builder.sub(ir.Constant(_I32, 4), p2)
        high = builder.and_(builder.shl(args[1], _splat(builder, shift, _VI)), _SIXTH)
        return builder.or_(builder.and_(args[0], _NIBBLE), high)
    return i32x16(v, h, p), codegen


@intrinsic
def high_sixes(typingctx, v, h, p):  # noqa: ANN001, ANN201
    """Each byte's high nibble of ``v`` with its two high bits, bits ``4 + 2p`` and ``5 + 2p`` of
    ``h``'s byte (a block's second half)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        shift = builder.shl(context.cast(builder, args[2], sig.args[2], types.int32), ir.Constant(_I32, 1))
        high = builder.and_(builder.lshr(args[1], _splat(builder, shift, _VI)), _SIXTH)
        nibble = builder.and_(builder.lshr(args[0], _FOUR), _NIBBLE)
        return builder.or_(nibble, high)
    return i32x16(v, h, p), codegen


def _dpbusd_generic(builder, acc, u8, s8):  # noqa: ANN001, ANN202
    """vpdpbusd's arithmetic in plain IR: lane i += sum over k < 4 of u8[4i+k] * s8[4i+k]."""
    wide = ir.VectorType(_I32, 4 * LANES)
    prod = builder.mul(builder.zext(builder.bitcast(u8, _VB), wide),
                       builder.sext(builder.bitcast(s8, _VB), wide))
    for k in range(4):
        lanes = ir.Constant(ir.VectorType(_I32, LANES), [4 * i + k for i in range(LANES)])
        acc = builder.add(acc, builder.shuffle_vector(prod, ir.Constant(wide, ir.Undefined), lanes))
    return acc


@intrinsic
def dpbusd(typingctx, acc, u8, s8):  # noqa: ANN001, ANN201
    """``acc`` plus, per 32-bit lane, the four products of its unsigned bytes in ``u8`` and
    signed bytes in ``s8`` (exact: no saturation)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        if not target_has_vnni():
            return _dpbusd_generic(builder, *args)
        fnty = ir.FunctionType(_VI, [_VI, _VI, _VI])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, list(args))
    return i32x16(acc, u8, s8), codegen


add_int = _lanewise(i32x16, lambda builder, a, b: builder.add(a, b))
to_float = _lanewise(f32x16, lambda builder, a: builder.sitofp(a, _VF))
mul_float = _lanewise(f32x16, lambda builder, a, b: builder.fmul(a, b))
add_float = _lanewise(f32x16, lambda builder, a, b: builder.fadd(a, b))


@intrinsic
def fma_float(typingctx, a, b, c):  # noqa: ANN001, ANN201
    """``a * b + c`` rounded once, lane by lane."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32")
        return builder.call(fn, list(args))
    return f32x16(a, b, c), codegen


# 16 signed bytes of a byte array from element ``idx``, as float32 lanes.
load_i8_floats = _vector_load(ir.VectorType(_I8, LANES), 1, f32x16,
                              lambda builder, v: builder.sitofp(v, _VF))


def _masked_load(elem: ir.Type, align: int):  # noqa: ANN202
    """An intrinsic ``load(arr, idx, n)``: the first ``n`` (0..16) elements from element ``idx``
    as float32 lanes, zeros past them (an AVX-512 masked load: nothing past ``n`` is read)."""
    vty = ir.VectorType(elem, LANES)

    def load(typingctx, arr, idx, n):  # noqa: ANN001, ANN202
        _check_c(arr)

        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            ptr = _address(context, builder, sig.args[0], args[0], args[1], vty)
            mask = _first_lanes(builder, context.cast(builder, args[2], sig.args[2], types.int32))
            suffix = "v16f16" if elem == ir.HalfType() else "v16f32"
            fnty = ir.FunctionType(vty, [ptr.type, _I32, mask.type, vty])
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.load.{suffix}.p0")
            value = builder.call(fn, [ptr, ir.Constant(_I32, align), mask, ir.Constant(vty, [0.0] * LANES)])
            return value if elem == ir.FloatType() else builder.fpext(value, _VF)
        return f32x16(arr, idx, n), codegen
    return intrinsic(load)


_load_floats_part = _masked_load(ir.FloatType(), 4)
_load_halves_part = _masked_load(ir.HalfType(), 2)


def load_part(arr: object, idx: int, n: int) -> object:
    """``load_widened``'s first ``n`` lanes, the rest zeros: a row's last, partial vector."""
    raise NotImplementedError("numba only")


@overload(load_part, inline="always")
def _load_part(arr, idx, n):  # noqa: ANN001, ANN202
    if isinstance(arr, types.Array) and arr.dtype == types.uint16:
        return lambda arr, idx, n: _load_halves_part(arr, idx, n)
    return lambda arr, idx, n: _load_floats_part(arr, idx, n)


def _added(builder, x, y, lanes: list[int], step: int):  # noqa: ANN001, ANN202
    """Lanes ``lanes`` of x:y (x's then y's, as ``shufflevector`` numbers them) plus the lanes
    ``step`` after each: one step of a sum's tree."""
    def pick(idx: list[int]):  # noqa: ANN202
        return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(idx)), idx))
    return builder.fadd(pick(lanes), pick([i + step for i in lanes]))


@intrinsic
def sum_lanes(typingctx, v):  # noqa: ANN001, ANN201
    """The sum of ``v``'s 16 lanes, by halves (lane i plus lane i + 8, then + 4, + 2, + 1): a fixed
    order, the same bits in every caller."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        x, n = args[0], LANES
        while n > 1:
            n //= 2
            x = _added(builder, x, x, list(range(n)), n)
        return builder.extract_element(x, ir.Constant(_I32, 0))
    return types.float32(v), codegen


@intrinsic
def sum_lanes4(typingctx, a, b, c, d):  # noqa: ANN001, ANN201
    """``sum_lanes`` of four vectors, each added in ``sum_lanes``'s order (so a sum's bits do not
    depend on the others), by a transposing tree: 9 additions and their shuffles, not 16."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        a, b, c, d = args
        halves = [*range(8), *range(16, 24)]  # a's 8 sums then b's (the lanes 8 on: + 8)
        x, y = _added(builder, a, b, halves, 8), _added(builder, c, d, halves, 8)
        z = _added(builder, x, y, [q + i for q in range(0, 32, 8) for i in range(4)], 4)  # 4 each
        z = _added(builder, z, z, [q + i for q in range(0, 16, 4) for i in range(2)], 2)  # 2 each
        z = _added(builder, z, z, [0, 2, 4, 6], 1)
        parts = [builder.extract_element(z, ir.Constant(_I32, i)) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, parts)
    return types.UniTuple(types.float32, 4)(a, b, c, d), codegen


def _fold(builder, x, y, width: int):  # noqa: ANN001, ANN202
    """One step of ``sum_lanes``'s tree on two vectors each holding ``LANES // width`` partial sums
    of ``width`` lanes: the result holds twice as many, of half the width, x's then y's."""
    lanes = [q + i for q in range(0, 2 * LANES, width) for i in range(width // 2)]
    return _added(builder, x, y, lanes, width // 2)


@intrinsic
def sum_lanes16(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """The 16 vectors stored from element ``idx`` of a float32 array (vector i at ``idx + 16 i``),
    each summed in ``sum_lanes``'s order, lane i holding vector i's sum: a transposing tree of 15
    additions (and their shuffles) for 16 sums, where ``sum_lanes`` takes 4 for one."""
    _check_c(arr)
    if arr.dtype != types.float32:
        raise TypingError(f"simd.sum_lanes16: needs float32, got {arr}")

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        vs = [builder.load(_address(context, builder, sig.args[0], args[0],
                                    builder.add(idx, ir.Constant(idx.type, LANES * i)), _VF), align=4)
              for i in range(LANES)]
        width = LANES
        while len(vs) > 1:
            vs = [_fold(builder, vs[i], vs[i + 1], width) for i in range(0, len(vs), 2)]
            width //= 2
        return vs[0]
    return f32x16(arr, idx), codegen
