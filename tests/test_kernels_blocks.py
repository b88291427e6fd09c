"""The formats computed on in place (Q5_0/Q5_1, the K-quants, IQ4): the kernels' decoder against
gguf's dequantizer (llama.cpp's own Python package) on the same blocks; the matmul's direct and
tiled paths against the float product of those values, and against llama.cpp's CPU dot products
themselves (``ggml_harness``) within what its 8-bit activations move; batch invariance, stacks of
mixed types, and the bytes kept: the file's own, nothing widened."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from ggml_harness import llama_matmul
from test_kernels import T_ROWS, assert_direct_rows_alone_equal_batched, check_matmul

from colibri.model.kernels.quant_matmul import qmatmul
from colibri.store import packers
from colibri.store.blocks import IN_PLACE, dequantize, dequantize_row
from colibri.store.formats import BLOCK, FORMATS, GGMLType
from colibri.store.lanes import FIVE_BIT, FOUR_BIT, lane_row, lane_row16
from colibri.store.numerics import QK_K
from colibri.store.packed import (
    GROUP,
    KIND_BLOCKS,
    KIND_Q4,
    KIND_Q5,
    KIND_Q6,
    KIND_Q8,
    OFFSETS_Q5,
    OFFSETS_Q8,
    Q6_BYTES,
    make_weight,
    packed_nbytes,
    weight_nbytes,
)

# llama.cpp rounds each activation to 8 bits in blocks of 32 (Q8_0, Q8_1) or 256 (Q8_K): at most
# half a step, amax / 127 / 2, per value; plus float32 rounding of the sums.
Q8_STEPS = 127.0
DOT_RTOL = 2e-5

TYPES = sorted(IN_PLACE)
# Byte offsets of each format's f16 fields (ggml-common.h): set to sane scales, so that random
# bytes elsewhere make valid blocks covering every quant, scale and high-bit pattern.
HALVES = {
    GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,), GGMLType.MXFP4: (),
}
# Byte offsets of E8M0 scales (MXFP4's): set to 2^-9 .. 2^-3, as real weights' blocks have.
EXPONENTS = {GGMLType.MXFP4: (0,)}


def random_rows(rng: np.random.Generator, n: int, k: int, gtype: GGMLType) -> tuple[np.ndarray, np.ndarray]:
    """(raw rows [n, row bytes], gguf's dequantization of them, float32 [n, k])."""
    fmt = FORMATS[gtype]
    blocks = rng.integers(0, 256, (n * k // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in HALVES[gtype]:
        scales = (rng.uniform(0.002, 0.02, len(blocks)) * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    for at in EXPONENTS.get(gtype, ()):
        blocks[:, at] = rng.integers(119, 126, len(blocks))
    raw = blocks.reshape(n, -1)
    ref = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(int(gtype)))
    return raw, ref.astype(np.float32).reshape(n, k)


def width(gtype: GGMLType, blocks: int) -> int:
    return FORMATS[gtype].block * blocks


def check_against_llama(x: np.ndarray, parts: list[tuple[np.ndarray, int]], ref_w: np.ndarray) -> None:
    """Our product against llama.cpp's ``vec_dot`` on the same blocks: apart by no more than its
    activation rounding can move it (|w| times half a quant step of each value's block)."""
    weight = make_weight(parts, x.shape[1])
    ours = np.empty((x.shape[0], ref_w.shape[0]), np.float32)
    qmatmul(x, weight, ours, x.shape[0])
    theirs = np.concatenate([llama_matmul(raw, t, x) for raw, t in parts], axis=1)
    block = 256 if x.shape[1] % 256 == 0 else 32  # the coarser rounding bounds both
    amax = np.abs(x).reshape(x.shape[0], -1, block).max(-1)
    half_step = np.repeat(amax / Q8_STEPS / 2, block, axis=1)
    bound = half_step @ np.abs(ref_w).T + DOT_RTOL * (np.abs(x) @ np.abs(ref_w).T) + 1e-5
    assert np.all(np.abs(ours - theirs) <= bound), float((np.abs(ours - theirs) / bound).max())


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_decoder_equals_ggufs_dequantizer(gtype: GGMLType):
    rng = np.random.default_rng(int(gtype))
    k = width(gtype, 12)
    raw, ref = random_rows(rng, 5, k, gtype)
    for r in range(5):
        out = np.full(k, np.nan, np.float32)
        dequantize_row(raw[r], int(gtype), out)
        np.testing.assert_allclose(out, ref[r], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dequantize(raw, gtype, raw.shape[0] * k).reshape(ref.shape), ref,
                               rtol=1e-6, atol=1e-7)


# Every format in place, and packed into lanes.
PATHS = [(t, False) for t in TYPES] + [(t, True) for t in TYPES]
PATH_IDS = [f"{t.name}-{'lanes' if lanes else 'in_place'}" for t, lanes in PATHS]


def expected_kind(gtype: GGMLType, lanes: bool) -> int:
    """In place, or (``lanes``) packed into Q4, Q5, Q6 or Q8 lanes."""
    if not lanes:
        return KIND_BLOCKS
    if gtype == GGMLType.Q6_K:
        return KIND_Q6
    return KIND_Q4 if gtype in FOUR_BIT else KIND_Q5 if gtype in FIVE_BIT else KIND_Q8


@pytest.mark.parametrize("gtype,lanes", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("n,blocks", [(16, 1), (40, 3), (300, 2), (33, 6)])
def test_qmatmul_matches_the_dequantized_product_and_llama_cpp(gtype: GGMLType, n: int, blocks: int,
                                                               lanes: bool):
    rng = np.random.default_rng(n * 100 + blocks + int(gtype))
    k = width(gtype, blocks)
    raw, ref_w = random_rows(rng, n, k, gtype)
    weight = make_weight([(raw, int(gtype))], k, lanes=lanes)
    assert weight.kind == expected_kind(gtype, lanes) and weight.n_rows == n
    assert packed_nbytes([(n, int(gtype))], k, lanes=lanes) == weight_nbytes(weight)
    for t in T_ROWS:
        check_matmul(rng.standard_normal((t, k)).astype(np.float32), weight, ref_w)
    check_against_llama(rng.standard_normal((3, k)).astype(np.float32), [(raw, int(gtype))], ref_w)


@pytest.mark.parametrize("gtype,lanes", PATHS, ids=PATH_IDS)
def test_direct_rows_are_batch_independent(gtype: GGMLType, lanes: bool):
    """A decode row's result is bitwise the same alone or batched, on both sides of a group edge."""
    rng = np.random.default_rng(50 + int(gtype))
    k = width(gtype, 2)
    raw, _ = random_rows(rng, 70, k, gtype)
    weight = make_weight([(raw, int(gtype))], k, lanes=lanes)
    assert weight.kind == expected_kind(gtype, lanes)
    x = rng.standard_normal((9, k)).astype(np.float32)
    batched = np.empty((9, 70), np.float32)
    qmatmul(x, weight, batched, 9)
    assert_direct_rows_alone_equal_batched(x, weight, batched, (0, 4, 8))


@pytest.mark.parametrize("lanes", [False, True], ids=["in_place", "lanes"])
def test_a_stack_mixing_types_is_the_concatenation_and_keeps_the_files_bytes(lanes: bool):
    """q, k and v of a ``_K_M`` file: Q5_0, Q8_0 and Q6_K rows in one matmul, no widening: in place
    the file's bytes, in lanes one Q8 packing of 16-value blocks."""
    rng = np.random.default_rng(7)
    k = 512
    raw0, w0 = random_rows(rng, 40, k, GGMLType.Q5_0)
    raw2, w2 = random_rows(rng, 24, k, GGMLType.Q6_K)
    x8 = rng.standard_normal((8, k)).astype(np.float32)
    raw1 = gguf.quants.quantize(x8, gguf.GGMLQuantizationType.Q8_0)
    w1 = gguf.quants.dequantize(raw1, gguf.GGMLQuantizationType.Q8_0)
    parts = [(raw0, int(GGMLType.Q5_0)), (raw1, int(GGMLType.Q8_0)), (raw2, int(GGMLType.Q6_K))]
    weight = make_weight(parts, k, lanes=lanes)
    assert weight.n_rows == 72 and weight.f.size == 0
    if lanes:
        assert weight.kind == KIND_Q8 and weight.q.shape[1:] == (k // 16, 4, 128)
    else:
        assert weight.kind == KIND_BLOCKS and weight.q.size == 0
        assert weight.raw.nbytes == raw0.nbytes + raw1.nbytes + raw2.nbytes
    assert packed_nbytes([(p.shape[0], t) for p, t in parts], k, lanes=lanes) == weight_nbytes(weight)
    ref = np.concatenate([w0, w1, w2])
    for t in T_ROWS:
        check_matmul(rng.standard_normal((t, k)).astype(np.float32), weight, ref)
    check_against_llama(rng.standard_normal((3, k)).astype(np.float32), parts, ref)


def test_one_part_is_a_view_of_the_file_unless_copied():
    """In place, a weight computes on the mmap itself; the expert store's resident tier owns a copy."""
    raw, _ = random_rows(np.random.default_rng(3), 8, 256, GGMLType.Q6_K)
    raw.setflags(write=False)
    assert np.shares_memory(make_weight([(raw, int(GGMLType.Q6_K))], 256, lanes=False).raw, raw)
    assert not np.shares_memory(make_weight([(raw, int(GGMLType.Q6_K))], 256, copy=True, lanes=False).raw,
                                raw)


@pytest.mark.parametrize("types,kind", [
    ((GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.IQ4_XS), KIND_Q8),
    ((GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q4_1), KIND_Q4),
    ((GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.IQ4_NL), KIND_Q8),
    ((GGMLType.Q2_K, GGMLType.Q4_0, GGMLType.Q3_K, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.Q5_K), KIND_Q8),
    ((GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.IQ4_NL, GGMLType.IQ4_XS), KIND_Q8),
    ((GGMLType.Q5_0, GGMLType.Q5_0), KIND_Q5),
    ((GGMLType.Q5_1, GGMLType.Q5_1), KIND_Q5),
    ((GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q5_K, GGMLType.Q4_K, GGMLType.Q5_1, GGMLType.Q4_1), KIND_Q5),
], ids=["q5_q8_q4k_iq4xs", "q4_q4k", "q4_q5_q5k_iq4nl", "per16_with_per32", "offsets_derived", "q5_0_halves",
        "q5_1_halves", "q4_with_q5"])
def test_a_stack_of_lane_formats_packs_to_one_kind_and_is_the_concatenation(types: tuple, kind: int):
    """q, k and v of a ``_K_M`` file whose parts all scale per 32 values: one packed matmul."""
    rng = np.random.default_rng(11)
    k = 512
    parts, refs = [], []
    for i, gtype in enumerate(types):
        if gtype in HALVES:
            raw, ref = random_rows(rng, 20 + 7 * i, k, gtype)
        else:  # the packed formats: through gguf's quantizer
            x = rng.standard_normal((20 + 7 * i, k)).astype(np.float32)
            raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(gtype)))
            ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(gtype)))
        parts.append((raw, int(gtype)))
        refs.append(ref.astype(np.float32))
    weight = make_weight(parts, k)
    assert weight.kind == kind and weight.n_rows == sum(r.shape[0] for r in refs)
    # Q5_0, Q8_0 and IQ4 all have m = -128 d in Q8 lanes, Q5_0 -16 d in Q5: none is stored, and
    # the sizes agree; one Q5 format keeps the file's halves, bit for bit
    assert (weight.m.size == 0 and weight.mh.size == 0) == set(types).issubset(
        OFFSETS_Q5 if kind == KIND_Q5 else OFFSETS_Q8)
    if len(set(types)) == 1:
        size = FORMATS[types[0]].nbytes
        words = np.concatenate([p for p, _ in parts]).reshape(weight.n_rows, -1, size)
        by_row = weight.dh.transpose(0, 2, 1).reshape(-1, weight.dh.shape[1])[: weight.n_rows]
        assert np.array_equal(by_row, words[:, :, :2].copy().view(np.uint16)[:, :, 0])
    assert packed_nbytes([(p.shape[0], t) for p, t in parts], k) == weight_nbytes(weight)
    ref = np.concatenate(refs)
    for t in T_ROWS:
        check_matmul(rng.standard_normal((t, k)).astype(np.float32), weight, ref)
    x = rng.standard_normal((9, k)).astype(np.float32)
    batched = np.empty((9, weight.n_rows), np.float32)
    qmatmul(x, weight, batched, 9)
    assert_direct_rows_alone_equal_batched(x, weight, batched, (0, 4, 8))


@pytest.mark.parametrize("types", [
    (GGMLType.Q4_K,), (GGMLType.Q5_K,), (GGMLType.Q6_K,), (GGMLType.Q4_K, GGMLType.Q5_K),
    (GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q4_K),
], ids=["q4_k", "q5_k", "q6_k", "q4_k_q5_k", "q4_k_q6_k", "q6_k_q5_k_q4_k"])
def test_k_quant_lanes_keep_the_files_scales_and_compute_the_same_bits(types: tuple):
    """K-quants in lanes keep a scale per super-block, the file's half (a float32 where a mix
    stores Q6_K's m, -128 d: ``packed._sub_halves``), and an integer per block (``SUB_SCALED``),
    as the file does: their products are the scales a float32 per block held (``lane_row``'s,
    bit for bit), so the kernel computes the same bits from fewer bytes."""
    rng = np.random.default_rng(17)
    k = 512
    parts = [(random_rows(rng, 20 + 13 * i, k, t)[0], int(t)) for i, t in enumerate(types)]
    weight = make_weight(parts, k)
    per = k // weight.q.shape[1]  # values per block: 16 with Q6_K in the stack
    ratio = QK_K // per
    halves = GGMLType.Q6_K not in types or types == (GGMLType.Q6_K,)
    widen = lambda a: a.view(np.float16).astype(np.float32)  # noqa: E731
    sup_d, sup_m = (widen(weight.dh), widen(weight.mh)) if halves else (weight.d, weight.m)
    assert weight.sd.shape == (weight.q.shape[0], k // per, GROUP) and sup_d.shape[1] == k // QK_K
    assert (weight.d.size == 0) == halves
    assert (weight.sm.size == 0) == (types == (GGMLType.Q6_K,))  # Q6_K alone: its offset is derived
    assert packed_nbytes([(p.shape[0], t) for p, t in parts], k) == weight_nbytes(weight)
    d_full = np.repeat(sup_d, ratio, axis=1) * weight.sd.astype(np.float32)
    m_full = np.repeat(sup_m, ratio, axis=1) * weight.sm.astype(np.float32) if weight.sm.size else weight.m
    # the products are lane_row's scales and offsets, row by row
    row = 0
    for raw, t in parts:
        q, d, m = np.empty(k, np.uint8), np.empty(k // per, np.float32), np.empty(k // per, np.float32)
        for r in range(raw.shape[0]):
            if per == BLOCK:
                lane_row(raw[r], t, q, d, m)
            else:
                scratch = np.empty(k // BLOCK, np.float32)
                lane_row16(raw[r], t, q, d, m, scratch, scratch.copy())
            g, lane = divmod(row, GROUP)
            assert np.array_equal(d_full[g, :, lane], d)
            if weight.sm.size:
                assert np.array_equal(m_full[g, :, lane], m)
            row += 1
    # and the kernel on them gives the bits of the same weight with a float32 scale per block
    widened = weight._replace(d=np.ascontiguousarray(d_full), m=np.ascontiguousarray(m_full),
                              dh=weight.dh[:0], mh=weight.mh[:0], sd=weight.sd[:0], sm=weight.sm[:0])
    for t in (1, 3, 4, 7, 16):
        x = rng.standard_normal((t, k)).astype(np.float32)
        ours, wide = (np.full((t, weight.n_rows), np.nan, np.float32) for _ in range(2))
        qmatmul(x, weight, ours, t)
        qmatmul(x, widened, wide, t)
        assert np.array_equal(ours, wide)
    # the bytes: a block's quants, an int8 d (and m) per block, a half or float32 per super-block
    n_scales = 1 if weight.sm.size == 0 else 2
    per_row = (k // per) * (weight.q.shape[2] * 4 + n_scales) + n_scales * (2 if halves else 4) * (k // QK_K)
    assert weight_nbytes(weight) == weight.q.shape[0] * GROUP * per_row


def test_q4_k_packs_word_by_word_as_value_by_value():
    """``packers.pack_q4_k`` (the expert store packs every K-quant miss with it) writes the bits of the
    generic path (``lane_row`` and ``sub_scales``, value by value), whole and in parts that start
    and end inside a group."""
    rng = np.random.default_rng(23)
    k, n = 512, 100
    raw, _ = random_rows(rng, n, k, GGMLType.Q4_K)
    t = int(GGMLType.Q4_K)
    fast = make_weight([(raw, t)], k)
    assert fast.kind == KIND_Q4 and fast.sd.size and fast.d.size == 0  # the file's halves
    q, d, m, dh, mh, sd, sm = (np.zeros_like(a) for a in (fast.q, fast.d, fast.m, fast.dh, fast.mh, fast.sd,
                                                          fast.sm))
    packers.pack_sub_scales(raw, t, BLOCK, 0, d, m, dh, mh, sd, sm)
    packers.pack_lanes(raw, t, k, 0, q, d, m)
    for ours, generic in zip((fast.q, fast.dh, fast.mh, fast.sd, fast.sm), (q, dh, mh, sd, sm), strict=True):
        assert np.array_equal(ours, generic)
    split = make_weight([(raw[:40], t), (raw[40:77], t), (raw[77:], t)], k)
    for name in ("q", "dh", "mh", "sd", "sm"):
        assert np.array_equal(getattr(split, name), getattr(fast, name)), name


def test_q6_lanes_hold_q6_k_quants_and_scales():
    """Q6 lanes are Q6_K's own 6-bit quants (``lanes.lane_row16``'s, unshifted) in nibbles and a
    plane of high bits, with its int8 scale per 16 values and its d per super-block: 1.01x the
    file's bytes, where Q8's lanes took 1.31x."""
    rng = np.random.default_rng(29)
    k, n = 512, 45
    raw, _ = random_rows(rng, n, k, GGMLType.Q6_K)
    w = make_weight([(raw, int(GGMLType.Q6_K))], k)
    assert w.kind == KIND_Q6 and w.q.shape[1:] == (k // 16, Q6_BYTES // 4, 4 * GROUP) and w.mh.size == 0
    assert weight_nbytes(w) <= 1.02 * raw.nbytes / n * (-(-n // GROUP) * GROUP)  # whole groups of rows
    qs, ds, ms = np.empty(k, np.uint8), np.empty(k // 16, np.float32), np.empty(k // 16, np.float32)
    for r in range(n):
        g, lane = divmod(r, GROUP)
        lane_row16(raw[r], int(GGMLType.Q6_K), qs, ds, ms, np.empty(k // 32, np.float32),
                   np.empty(k // 32, np.float32))
        nib = w.q[g, :, :2, 4 * lane : 4 * lane + 4].reshape(k // 16, 8).astype(np.int64)
        high = w.q[g, :, 2, 4 * lane : 4 * lane + 4].astype(np.int64)
        vals = np.empty((k // 16, 16), np.int64)
        for j in range(8):
            p, kk = divmod(j, 4)
            vals[:, j] = (nib[:, j] & 15) | (((high[:, kk] >> (2 * p)) & 3) << 4)
            vals[:, 8 + j] = (nib[:, j] >> 4) | (((high[:, kk] >> (4 + 2 * p)) & 3) << 4)
        assert np.array_equal(vals.reshape(-1), qs.astype(np.int64) - 96)
        d_sup = w.dh[g, :, lane].view(np.float16).astype(np.float32)
        scales = np.repeat(d_sup, QK_K // 16) * w.sd[g, :, lane]
        assert np.array_equal(scales, ds)
