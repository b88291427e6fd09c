"""The packed layout: a matrix as the kernels read it, which is also the RAM tier's format.

GGUF stores a matrix row by row, each row a run of blocks with their own scale. A kernel walking a
row must reduce every block horizontally, which SIMD does badly, so each quantized matrix is
*packed* once (at load, or when an expert is fetched): GROUP rows are interleaved block by block,
four quant bytes of a row together,

    q[g, b, p, 4 r + k]   quant byte 4 p + k of block b of row GROUP*g + r  (Q4: a byte of two
                          nibbles, quants j and j + 16, as in the file; Q8: q + 128; Q5:
                          Q4's nibbles in quads 0-3, the fifth bits in quad 4, FIFTH_BYTES;
                          Q6, 16-value blocks: nibbles of quants j and j + 8 in quads 0-1,
                          the two high bits in quad 2, SIX_HIGH_BYTES)
    d[g, b, r]            that block's scale;  m[g, b, r] its offset (Q4_1's min; none kept where
                          every part's offset is its kind's fixed multiple of d: OFFSETS_Q4,
                          OFFSETS_Q5, OFFSETS_Q8)
    dh, mh                the same as the file's halves (uint16), instead of d and m, where every
                          part is one format whose scales are halves (HALF_SCALES)
    sd[g, b, r], sm       the block's int8 multiple of d[g, b // (blocks a super-block), r] (and
                          of m), where every part is a K-quant (SUB_SCALED): its scales as the
                          file keeps them

so that one 64-byte vector holds four consecutive quants of each of 16 rows: the 32-bit lanes of
an integer dot product (``colibri.model.kernels.int8_matmul``), one lane per row, and no
horizontal sums. The bits stay 4-, 5-, 6- or 8-bit, the scales of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
the file's halves (a packed matrix is its file bytes), the K-quants' the file's half per
super-block and integer per block; others' scales, computed, are float32. Float formats,
and stacks that mix kinds, are widened to float32 rows. Packing is deterministic, so a resident
copy and one packed from the file on a miss give the same bits. The formats themselves are the
table in ``formats.py``. The other formats (Q5, the K-quants, IQ4) are
re-expressed as ``d q + m`` into these lanes (``colibri.store.lanes``: the Q5 formats into Q5's
5.5 bits a weight, no longer Q8's 8.5; Q6_K into Q6's 6.5), or, where ``lanes`` leaves them out (the
expert store packs only Q4_K and Q6_K: ``experts.STORE_LANES``), keep the file's blocks
(``Kind.BLOCKS``, decoded by ``colibri.store.blocks``), no bigger than the file.

Q8_0's quants are kept *biased* (``q + 128``, an unsigned byte, with ``m = -128 d``): the integer
dot product multiplies unsigned weight bytes by signed activation bytes. Float formats are
widened by ``blocks.dequantize_row``.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.store.arena import Arena
from colibri.store.blocks import Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE, _scale_min_k4, dequantize_row
from colibri.store.formats import FORMATS, GGMLType, Kind, computed_format, row_nbytes
from colibri.store.halves import half
from colibri.store.lanes import (
    FIVE_BIT,
    FOUR_BIT,
    LANE_TYPES,
    SIXTEEN,
    lane_row,
    lane_row16,
    sub_scales,
)
from colibri.store.numerics import BLOCK, KERNEL, QK_K

# Rows interleaved by packing: the SIMD lanes of the direct path. 32, not 16 (one AVX-512
# vector): LLVM leaves the 16-trip lane loops scalar and vectorizes the 32-trip ones.
GROUP = 32
# Quant bytes per block per row in the packed layout: Q4 keeps two nibbles a byte, Q8 one quant.
Q4_BYTES = BLOCK // 2
Q8_BYTES = BLOCK
# Quant bytes of one row side by side in the layout: one 32-bit lane of the integer dot product.
QUAD = 4
# Q5: Q4's 16 bytes of nibbles, then one quad of the block's 32 fifth bits, byte k of a row's
# quad bit p the fifth bit of quant 4 p + k, bit 4 + p that of quant 16 + 4 p + k: a nibble
# vector's fifth bits are then one shift and mask of the quad away (``simd.low_fives``).
FIFTH_BYTES = BLOCK // 8
Q5_BYTES = Q4_BYTES + FIFTH_BYTES
# Q6 (Q6_K's 6-bit quants, scaled every 16 values): per 16-value block, 8 bytes of nibbles (quants
# j and j + 8) in quads 0-1, then one quad of high bits, byte k of a row's quad bits 2p, 2p + 1
# the high bits of quant 4 p + k and bits 4 + 2p, 5 + 2p those of quant 8 + 4 p + k
# (``simd.low_sixes``): 12 bytes per 16 values, where Q8's lanes took 16 (Q6_K's packed row 1.31x
# its file bytes in Q8, 1.01x here).
Q6_VALUES = BLOCK // 2
SIX_HIGH_BYTES = Q6_VALUES // 4
Q6_BYTES = Q6_VALUES // 2 + SIX_HIGH_BYTES

# The offset m of Q4_0 and Q8_0 blocks, a fixed multiple of d: a matrix of only those keeps no m
# (a fifth fewer bytes to read per Q4_0 weight, a tenth per Q8_0 one) and the kernels derive it.
OFFSET_Q4 = np.float32(FORMATS[GGMLType.Q4_0].pack.offset_scale)
OFFSET_Q8 = np.float32(FORMATS[GGMLType.Q8_0].pack.offset_scale)
OFFSET_Q5 = np.float32(-16.0)  # Q5_0's: value = d (q - 16)
OFFSET_Q6 = np.float32(-32.0)  # Q6_K's: value = d sc (q - 32)

# The kinds as plain ints, for numba (``Weight.kind``).
KIND_F32, KIND_Q4, KIND_Q8, KIND_BLOCKS = int(Kind.FLOAT), int(Kind.Q4), int(Kind.Q8), int(Kind.BLOCKS)
KIND_Q5, KIND_Q6 = int(Kind.Q5), int(Kind.Q6)

T_Q5_0, T_Q4_K, T_Q6_K = int(GGMLType.Q5_0), int(GGMLType.Q4_K), int(GGMLType.Q6_K)
# A half's sign bit: m = -dmin is dmin's half with it flipped.
_SIGN = np.uint16(0x8000)


class Weight(NamedTuple):
    """A matrix in the packed layout. One type for every format, so that a layer's weights form a
    homogeneous tuple for numba; the arrays a kind does not use are empty."""

    kind: int
    n_rows: int
    q: np.ndarray  # uint8 [G, nb, quant bytes per block / 4, 4 GROUP]
    d: np.ndarray  # float32 [G, nb, GROUP]
    m: np.ndarray  # float32 [G, nb, GROUP]
    f: np.ndarray  # float32 [N, K], for the float formats
    raw: np.ndarray  # read-only uint8 [bytes]: Kind.BLOCKS, the rows' file blocks end to end
    parts: np.ndarray  # int64 [P, 4]: Kind.BLOCKS, per stacked part (first row, byte offset in
    #                   ``raw``, bytes per row, block type): parts may differ in type
    dh: np.ndarray  # uint16 [G, nb, GROUP]: d as halves (HALF_SCALES; d is then empty)
    mh: np.ndarray  # uint16 [G, nb, GROUP]: m as halves
    sd: np.ndarray  # int8 [G, nb, GROUP]: a block's multiple of its super-block's d (SUB_SCALED;
    #                 d and m, or dh and mh, are then [G, nb / blocks per super-block, GROUP])
    sm: np.ndarray  # int8 [G, nb, GROUP]: the same for m


class SwiGLUWeights(NamedTuple):
    """A SwiGLU feed-forward, ``down(silu(gate · h) * (up · h))``: a dense layer's FFN, a shared
    expert, and a routed expert as the expert store hands it out."""

    gate_up: Weight  # gate and up stacked by rows: one matmul
    down: Weight


_EMPTY_Q = np.zeros((0, 0, 0, 0), np.uint8)
_EMPTY_S = np.zeros((0, 0, 0), np.float32)
_EMPTY_H = np.zeros((0, 0, 0), np.uint16)
_EMPTY_I = np.zeros((0, 0, 0), np.int8)
_EMPTY_F = np.zeros((0, 0), np.float32)
_EMPTY_PARTS = np.zeros((0, 4), np.int64)
# Read-only, as the file's mmap is: every Weight's ``raw`` has one numba type, so a layer's weights
# stay a homogeneous tuple whichever kinds they hold.
_EMPTY_RAW = np.zeros(0, np.uint8)
_EMPTY_RAW.setflags(write=False)
# No matrix (a layer without a shared expert), typed as every other weight.
EMPTY_WEIGHT = Weight(KIND_F32, 0, _EMPTY_Q, _EMPTY_S, _EMPTY_S, _EMPTY_F, _EMPTY_RAW, _EMPTY_PARTS, _EMPTY_H,
                      _EMPTY_H, _EMPTY_I, _EMPTY_I)


def weight_nbytes(w: Weight) -> int:
    """Bytes of every array a weight holds (what ``packed_nbytes`` predicts, with the part table)."""
    return sum(a.nbytes for a in w if isinstance(a, np.ndarray))


def packed_kind(types: list[int], lanes: bool | frozenset[GGMLType] = True) -> int:
    """The kind a stack of tensors computes as: their common packed kind (Q4 or Q8); with
    ``lanes`` (True: every format of ``LANE_TYPES``; or the set of those to take), Q4, Q5 or Q8
    too for the in-place formats that fit (``lanes.py``: Q4 when every part is 4-bit, Q5 when
    every part is 4- or 5-bit); else the file's blocks in place when any part is of an in-place
    format (any mix, row by row); else float32. An unknown type raises."""
    kinds = {int(computed_format(t).kind) for t in types}
    if len(kinds) == 1 and kinds <= {KIND_Q4, KIND_Q8}:
        return kinds.pop()
    allowed = LANE_TYPES if lanes is True else lanes or frozenset()
    if allowed and KIND_F32 not in kinds and all(GGMLType(t) in allowed or
                                     int(computed_format(t).kind) != KIND_BLOCKS for t in types):
        if all(GGMLType(t) in FOUR_BIT for t in types):
            return KIND_Q4
        if all(GGMLType(t) == GGMLType.Q6_K for t in types):
            return KIND_Q6
        return KIND_Q5 if all(GGMLType(t) in FOUR_BIT | FIVE_BIT for t in types) else KIND_Q8
    return KIND_BLOCKS if KIND_BLOCKS in kinds else KIND_F32


def packed_nbytes(parts: list[tuple[int, int]], n_cols: int, lanes: bool | frozenset[GGMLType] = True) -> int:
    """Bytes ``make_weight`` will allocate for parts of (rows, block type), without reading them:
    the expert store budgets experts it has not packed yet."""
    kind, n_rows = packed_kind([t for _, t in parts], lanes), sum(rows for rows, _ in parts)
    if kind == KIND_F32:
        return n_rows * n_cols * 4
    if kind == KIND_BLOCKS:  # the file's bytes, and a line of the part table per part
        return sum(rows * row_nbytes(GGMLType(t), n_cols) + 32 for rows, t in parts)
    types = [t for _, t in parts]
    per = _quant_bytes(kind, types)  # quant bytes per block
    values = _block_values(kind, per)
    n_scales = 1 if _derived_offsets(types, kind) else 2  # d, and m unless derived
    n_blocks = n_cols // values
    if _sub_scaled(types):  # a half (or float32) per super-block and an int8 per block, each
        sup = 2 if _sub_halves(types, _derived_offsets(types, kind)) else 4
        scales = n_scales * (n_cols // QK_K * sup + n_blocks)
    else:
        scales = n_scales * n_blocks * (2 if _half_scales(types) else 4)
    return -(-n_rows // GROUP) * GROUP * (n_blocks * per + scales)


# The formats whose offset m is OFFSET_Q4 d as Q4, OFFSET_Q5 d as Q5, and OFFSET_Q8 d as Q8 (Q5_0,
# IQ4 and Q6_K through their lanes: ``lanes._legacy`` shifts Q5_0's quants to it, ``lanes._q6_k``
# Q6_K's by 96, IQ4's grid is stored +128).
OFFSETS_Q4 = frozenset({GGMLType.Q4_0})
OFFSETS_Q5 = frozenset({GGMLType.Q5_0})
OFFSETS_Q6 = frozenset({GGMLType.Q6_K})
OFFSETS_Q8 = frozenset({GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.Q6_K})


# The formats whose packed scales are the file's halves, bit for bit: their own kind's blocks (Q5's
# for Q5_0 and Q5_1), scale (and the min) one f16 each. A stack keeps halves when all its parts are
# one of them.
HALF_SCALES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q5_1})


# The formats whose block scales are their super-block's half times a small integer per block
# (``lanes.sub_scales``): a stack of only these keeps that integer per block (``sd``, ``sm``) and
# the super-block's half (``_sub_halves``; float32 for a mix that stores Q6_K's m), ~1.1 bytes a
# scale per block and row where a float32 per block took 4: Q4_K's packed row (d and m) 24 -> 18.5
# bytes per 32 values (its file's 18), Q6_K's in Q6 lanes 12 + 1.125 per 16 (its file's 13.1).
# The kernels multiply them back (the same float32 product the decoder makes).
SUB_SCALED = frozenset({GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})


def _sub_scaled(types: list[int]) -> bool:
    return all(GGMLType(t) in SUB_SCALED for t in types)


def _sub_halves(types: list[int], derived: bool) -> bool:
    """Whether a sub-scaled stack keeps its super-blocks' scales as the file's halves: d is one,
    and m is (-dmin, Q4_K's and Q5_K's) or is derived (Q6_K alone); a mix storing Q6_K's m,
    -128 d, would overflow a half where d > 511, and keeps float32."""
    minned = all(GGMLType(t) in (GGMLType.Q4_K, GGMLType.Q5_K) for t in types)
    return _sub_scaled(types) and (derived or minned)


def _half_scales(types: list[int]) -> bool:
    return len(set(types)) == 1 and GGMLType(types[0]) in HALF_SCALES


def _derived_offsets(types: list[int], kind: int) -> bool:
    """Whether every part's offset is its kind's fixed multiple of d, so that m is not stored."""
    own = {KIND_Q4: OFFSETS_Q4, KIND_Q5: OFFSETS_Q5, KIND_Q6: OFFSETS_Q6}.get(kind, OFFSETS_Q8)
    return all(GGMLType(t) in own for t in types)


def _quant_bytes(kind: int, types: list[int]) -> int:
    """Quant bytes per block per row of a packing of ``kind``."""
    return {KIND_Q4: Q4_BYTES, KIND_Q5: Q5_BYTES, KIND_Q6: Q6_BYTES}.get(kind) or _q8_block(types)


def _block_values(kind: int, per: int) -> int:
    """Values per block of a packing of ``kind`` with ``per`` quant bytes per block."""
    return {KIND_Q4: BLOCK, KIND_Q5: BLOCK, KIND_Q6: Q6_VALUES}.get(kind, per)


def _q8_block(types: list[int]) -> int:
    """Values per block of a Q8 packing: 16 when any part scales every 16 values, else 32."""
    return BLOCK // 2 if any(GGMLType(t) in SIXTEEN for t in types) else Q8_BYTES


def make_weight(parts: list[tuple[np.ndarray, int]], n_cols: int, copy: bool = False,
                lanes: bool | frozenset[GGMLType] = True, arena: Arena | None = None) -> Weight:
    """One matrix from the raw GGUF rows of one or more tensors stacked by rows (q, k and v
    become one matmul). Parts of one packed kind pack to it, and so (``lanes``) do the in-place
    formats that fit (``packed_kind``); other parts of an in-place format keep their bytes (a view
    of the file when there is one part and not ``copy``: the expert store copies, so that its
    resident tier owns its bytes); anything else is widened to float32. ``arena``: where the
    packed or widened arrays go (a model's lifetime weights: ``arena.py``), else NumPy's heap."""
    kind, n_rows = packed_kind([t for _, t in parts], lanes), sum(raw.shape[0] for raw, _ in parts)
    if kind == KIND_BLOCKS:
        return _blocks_weight(parts, copy)
    if kind != KIND_F32:
        types = [t for _, t in parts]
        per = _quant_bytes(kind, types)
        groups, n_blocks = -(-n_rows // GROUP), n_cols // _block_values(kind, per)
        halves, derived, subbed = _half_scales(types), _derived_offsets(types, kind), _sub_scaled(types)
        sub_halves = _sub_halves(types, derived)
        # Every byte is written when the rows fill whole groups: no zeroing pass (a miss packs an
        # expert into fresh memory on every use); else zeros, for the last group's empty rows.
        new = arena.empty if arena is not None else np.empty if n_rows % GROUP == 0 else np.zeros
        q = new((groups, n_blocks, per // QUAD, QUAD * GROUP), np.uint8)
        n_scales = n_cols // QK_K if subbed else n_blocks  # scales per row
        kept = halves or sub_halves  # the scales as the file's halves
        d = _EMPTY_S if kept else new((groups, n_scales, GROUP), np.float32)
        m = _EMPTY_S if derived or kept else new((groups, n_scales, GROUP), np.float32)
        dh = new((groups, n_scales, GROUP), np.uint16) if kept else _EMPTY_H
        mh = new((groups, n_scales, GROUP), np.uint16) if kept and not derived else _EMPTY_H
        sd = new((groups, n_blocks, GROUP), np.int8) if subbed else _EMPTY_I
        sm = new((groups, n_blocks, GROUP), np.int8) if subbed and not derived else _EMPTY_I
        row = 0
        for raw, t in parts:
            fmt = FORMATS[GGMLType(t)]
            layout = fmt.pack
            if subbed and kind == KIND_Q4 and t == T_Q4_K:
                _pack_q4_k(np.ascontiguousarray(raw), row, q, dh, mh, sd, sm)
                row += raw.shape[0]
                continue
            if kind == KIND_Q6:
                _pack_q6_k(np.ascontiguousarray(raw), row, q, dh, sd)
                row += raw.shape[0]
                continue
            if subbed:
                _pack_sub_scales(raw, t, n_cols // n_blocks, row, d, m, dh, mh, sd, sm)
            if kind == KIND_Q5:
                _pack_fives(raw, t, fmt.nbytes, row, q, d, m, dh, mh)
            elif fmt.kind == kind and n_blocks * BLOCK == n_cols and halves:  # the file's bytes, moved
                _pack_words(np.ascontiguousarray(raw), fmt.nbytes, layout.quants_at, layout.min_at,
                            np.uint32(layout.flip * 0x01010101), row, q, dh, mh)
            elif fmt.kind == kind and n_blocks * BLOCK == n_cols:  # its own kind, scales widened
                _pack_rows(raw, fmt.nbytes, layout.quants_at, layout.min_at, layout.offset_scale,
                           np.uint8(layout.flip), row, q, d, m)
            else:
                _pack_lanes(raw, t, n_cols, row, q, d, m)
            row += raw.shape[0]
        return Weight(kind, n_rows, q, d, m, _EMPTY_F, _EMPTY_RAW, _EMPTY_PARTS, dh, mh, sd, sm)
    f = (np.empty if arena is None else arena.empty)((n_rows, n_cols), np.float32)
    row = 0
    for raw, t in parts:
        computed_format(t)  # an unknown type raises here, not in the compiled loop
        for r in range(raw.shape[0]):
            dequantize_row(raw[r], t, f[row])
            row += 1
    return Weight(KIND_F32, n_rows, _EMPTY_Q, _EMPTY_S, _EMPTY_S, f, _EMPTY_RAW, _EMPTY_PARTS, _EMPTY_H,
                  _EMPTY_H, _EMPTY_I, _EMPTY_I)


def _blocks_weight(parts: list[tuple[np.ndarray, int]], copy: bool) -> Weight:
    if len(parts) == 1 and not copy:
        raw = np.ascontiguousarray(parts[0][0]).reshape(-1)
    else:
        raw = np.concatenate([np.ascontiguousarray(p).reshape(-1) for p, _ in parts])
    return blocks_weight(raw, parts)


def blocks_weight(raw: np.ndarray, parts: list[tuple[np.ndarray, int]]) -> Weight:
    """An in-place weight over ``raw``, which holds the rows of ``parts`` (rows, block type) end to
    end (the expert store reads an expert's rows straight into it)."""
    raw.setflags(write=False)
    table = np.empty((len(parts), 4), np.int64)
    row, at = 0, 0
    for i, (part, t) in enumerate(parts):
        rows, size = part.shape
        table[i] = (row, at, size, t)
        row, at = row + rows, at + rows * size
    assert at == raw.nbytes, "the parts must fill the buffer"
    return Weight(KIND_BLOCKS, row, _EMPTY_Q, _EMPTY_S, _EMPTY_S, _EMPTY_F, raw, table, _EMPTY_H, _EMPTY_H,
                  _EMPTY_I, _EMPTY_I)


@nb.njit(inline="always", **KERNEL)
def slot(w: Weight, i: int, n_slots: int) -> Weight:
    """Matrix ``i`` of ``n_slots`` of one shape stacked end to end (the expert store's resident
    layer: every expert's copy, expert after expert): packed Q4/Q5/Q8 by groups, each matrix filling
    whole groups; in-place blocks by bytes, every matrix with the same part table. A weight is its
    own slot 0 of 1, whatever its kind; float32 weights are never stacked."""
    g = w.q.shape[0] // n_slots
    s = w.d.shape[0] // n_slots
    h = w.dh.shape[0] // n_slots
    u = w.sd.shape[0] // n_slots
    b = w.raw.shape[0] // n_slots
    return Weight(w.kind, w.n_rows // n_slots, w.q[i * g : (i + 1) * g], w.d[i * s : (i + 1) * s],
                  w.m[i * s : (i + 1) * s], w.f, w.raw[i * b : (i + 1) * b], w.parts,
                  w.dh[i * h : (i + 1) * h], w.mh[i * h : (i + 1) * h],  # an empty array's slice is empty
                  w.sd[i * u : (i + 1) * u], w.sm[i * u : (i + 1) * u])


@nb.njit(inline="always", **KERNEL)
def block_row(w: Weight, r: int) -> tuple[int, int]:
    """(byte offset in ``w.raw``, block type) of row ``r`` of an in-place weight."""
    p = 0
    while p + 1 < w.parts.shape[0] and w.parts[p + 1, 0] <= r:
        p += 1
    return w.parts[p, 1] + (r - w.parts[p, 0]) * w.parts[p, 2], w.parts[p, 3]


@nb.njit(**KERNEL)
def _pack_rows(raw: np.ndarray, size: int, quants_at: int, min_at: int, offset_scale: float,
               flip: np.uint8, row0: int, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Raw GGUF rows of one quantized format (its ``PackLayout``: block ``size`` in bytes, where
    the quants and the min are) into rows ``row0..`` of the packed layout with float32 scales
    (a stack mixing Q4_0 and Q4_1, say); one format alone keeps its halves (``_pack_words``)."""
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        row = raw[r]
        for b in range(q.shape[1]):
            base = b * size
            scale = half(row[base], row[base + 1])
            d[g, b, lane] = scale
            if min_at >= 0:
                m[g, b, lane] = half(row[base + min_at], row[base + min_at + 1])
            elif m.size:  # else derived by the kernels (OFFSET_Q4, OFFSET_Q8)
                m[g, b, lane] = np.float32(offset_scale) * scale
            qs = q[g, b]
            for j in range(q.shape[2] * QUAD):
                qs[j // QUAD, QUAD * lane + j % QUAD] = row[base + quants_at + j] ^ flip


@nb.njit(parallel=True, **KERNEL)
def _pack_words(raw: np.ndarray, size: int, quants_at: int, min_at: int, flip: np.uint32, row0: int,
                q: np.ndarray, dh: np.ndarray, mh: np.ndarray) -> None:
    """``_pack_rows`` for a format whose packed scales are the file's halves (Q4_0, Q4_1, Q8_0):
    a block's scale, min and quants moved as 16- and 32-bit words (every offset in a block is
    even), a group's rows at a time, written in the layout's order, the groups in parallel. A miss
    packs an expert on every use: this pass is what it costs beside the read (a byte at a time,
    row by row, ran at 1.7 GB/s). A part may start and end inside a group (``row0``, its rows)."""
    h = raw.reshape(-1).view(np.uint16)
    row_h, size_h, quants_h = raw.shape[1] // 2, size // 2, quants_at // 2
    n_blocks, quads = q.shape[1], q.shape[2]
    words = q.reshape(-1).view(np.uint32)
    dhf, mhf = dh.reshape(-1), mh.reshape(-1)
    g0, lane0 = divmod(row0, GROUP)
    n_rows = raw.shape[0]
    for gi in nb.prange((lane0 + n_rows + GROUP - 1) // GROUP):
        g = g0 + gi
        first = max(0, gi * GROUP - lane0)  # the part's rows in this group: [first, last)
        last = min(n_rows, (gi + 1) * GROUP - lane0)
        base_lane = first + lane0 - gi * GROUP
        for b in range(n_blocks):
            blk = g * n_blocks + b
            for r in range(first, last):
                dhf[blk * GROUP + base_lane + r - first] = h[r * row_h + b * size_h]
            if min_at >= 0:
                for r in range(first, last):
                    mhf[blk * GROUP + base_lane + r - first] = h[r * row_h + b * size_h + min_at // 2]
            for p in range(quads):
                dst = (blk * quads + p) * GROUP + base_lane - first
                for r in range(first, last):
                    at = r * row_h + b * size_h + quants_h + 2 * p
                    words[dst + r] = (np.uint32(h[at]) | (np.uint32(h[at + 1]) << np.uint32(16))) ^ flip


@nb.njit(parallel=True, **KERNEL)
def _pack_q4_k(raw: np.ndarray, row0: int, q: np.ndarray, dh: np.ndarray, mh: np.ndarray, sd: np.ndarray,
               sm: np.ndarray) -> None:
    """Raw Q4_K rows into rows ``row0..`` of sub-scaled Q4 lanes, the groups in parallel: what
    ``_pack_lanes`` and ``_pack_sub_scales`` write, bit for bit, as moves of 32-bit words. A
    super-block's 32 quant bytes ``j64`` hold sub-blocks ``2 j64`` (low nibbles) and ``2 j64 + 1``
    (high), and a Q4 lane byte j is quants j and j + 16 of its block: one mask and shift per word.
    The expert store packs every miss of a K-quant expert so (they compute on the lanes in every
    tier): 0.64 ms an expert matrix of 768 x 1024 by way of ``lane_row``, 0.08 ms here (5-6 GB/s)."""
    words = q.reshape(-1).view(np.uint32)
    n_blocks, n_sup = q.shape[1], dh.shape[1]
    row_words = raw.shape[1] // 4
    src = raw.reshape(-1).view(np.uint32)
    g0, lane0 = divmod(row0, GROUP)
    n_rows = raw.shape[0]
    low, high = np.uint32(0x0F0F0F0F), np.uint32(0xF0F0F0F0)
    four = np.uint32(4)
    for gi in nb.prange((lane0 + n_rows + GROUP - 1) // GROUP):
        g = g0 + gi
        first = max(0, gi * GROUP - lane0)
        last = min(n_rows, (gi + 1) * GROUP - lane0)
        for r in range(first, last):
            lane = r + lane0 - gi * GROUP
            row = raw[r]
            for s in range(n_sup):
                base = s * Q4_K_SIZE
                dh[g, s, lane] = _half_bits(row, base)
                mh[g, s, lane] = _half_bits(row, base + 2) ^ _SIGN  # m = -dmin
                for j in range(QK_K // BLOCK):
                    sc, mn = _scale_min_k4(row, base + 4, j)
                    sd[g, s * (QK_K // BLOCK) + j, lane] = sc
                    sm[g, s * (QK_K // BLOCK) + j, lane] = mn
                qs = r * row_words + (base + 16) // 4  # the super-block's quants, in words
                for j64 in range(4):
                    b = s * (QK_K // BLOCK) + 2 * j64
                    for p in range(Q4_BYTES // QUAD):
                        w0 = src[qs + 8 * j64 + p]  # bytes 4p.. of the 32: quants 4p.. of both blocks
                        w1 = src[qs + 8 * j64 + 4 + p]  # bytes 16 + 4p..
                        lo_at = ((g * n_blocks + b) * (Q4_BYTES // QUAD) + p) * GROUP + lane
                        hi_at = lo_at + (Q4_BYTES // QUAD) * GROUP
                        words[lo_at] = (w0 & low) | ((w1 & low) << four)
                        words[hi_at] = ((w0 >> four) & low) | (w1 & high)


@nb.njit(parallel=True, **KERNEL)
def _pack_q6_k(raw: np.ndarray, row0: int, q: np.ndarray, dh: np.ndarray, sd: np.ndarray) -> None:
    """Raw Q6_K rows into rows ``row0..`` of Q6 lanes (``Q6_BYTES``), the groups in parallel: per
    super-block its d (the offset -32 d is derived: ``OFFSET_Q6``), per 16 values its int8 scale,
    and the quants unshifted, 0..63, as ``lanes._q6_k`` reads them from ``ql`` and ``qh``."""
    n_sup = dh.shape[1]
    per_sup = QK_K // Q6_VALUES
    g0, lane0 = divmod(row0, GROUP)
    n_rows = raw.shape[0]
    for gi in nb.prange((lane0 + n_rows + GROUP - 1) // GROUP):
        g = g0 + gi
        first = max(0, gi * GROUP - lane0)
        last = min(n_rows, (gi + 1) * GROUP - lane0)
        v = np.empty(QK_K, np.int64)  # a super-block's quants
        for r in range(first, last):
            lane = r + lane0 - gi * GROUP
            row = raw[r]
            for s in range(n_sup):
                base = s * Q6_K_SIZE
                dh[g, s, lane] = _half_bits(row, base + 208)
                for n in range(2):
                    ql, qh, y = base + 64 * n, base + 128 + 32 * n, 128 * n
                    for i in range(32):
                        lo0, lo1, h = np.int64(row[ql + i]), np.int64(row[ql + i + 32]), np.int64(row[qh + i])
                        v[y + i] = (lo0 & 15) | ((h & 3) << 4)
                        v[y + i + 32] = (lo1 & 15) | (((h >> 2) & 3) << 4)
                        v[y + i + 64] = (lo0 >> 4) | (((h >> 4) & 3) << 4)
                        v[y + i + 96] = (lo1 >> 4) | ((h >> 6) << 4)
                for j in range(per_sup):
                    b = s * per_sup + j
                    sd[g, b, lane] = np.int8(row[base + 192 + j])
                    qb, x = q[g, b], Q6_VALUES * j
                    for k in range(QUAD):
                        high = 0
                        for p in range(2):
                            lo, hi = v[x + QUAD * p + k], v[x + Q6_VALUES // 2 + QUAD * p + k]
                            qb[p, QUAD * lane + k] = (lo & 15) | ((hi & 15) << 4)
                            high |= ((lo >> 4) << (2 * p)) | ((hi >> 4) << (4 + 2 * p))
                        qb[2, QUAD * lane + k] = high


@nb.njit(**KERNEL)
def _pack_lanes(raw: np.ndarray, gtype: int, n_cols: int, row0: int, q: np.ndarray, d: np.ndarray,
                m: np.ndarray) -> None:
    """Raw rows of a format that fits the layout but is not its kind's own (``lanes.py``) into
    rows ``row0..``: Q4 takes two 4-bit quants a byte (j and j + 16), Q8 one, in blocks of 32
    values or (``q.shape[2]`` 4 quads) of 16."""
    qs = np.empty(n_cols, np.uint8)
    ds = np.empty(q.shape[1], np.float32)
    ms = np.empty(q.shape[1], np.float32)
    d32 = np.empty(n_cols // BLOCK, np.float32)
    m32 = np.empty(n_cols // BLOCK, np.float32)
    four_bit = q.shape[1] * BLOCK == n_cols and q.shape[2] * QUAD == Q4_BYTES
    per_block = d.shape[1] == q.shape[1]  # a float32 scale per block, not per super-block
    per = BLOCK if four_bit else q.shape[2] * QUAD  # values per block
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        if per == BLOCK:
            lane_row(raw[r], gtype, qs, ds, ms)
        else:
            lane_row16(raw[r], gtype, qs, ds, ms, d32, m32)
        for b in range(q.shape[1]):
            if per_block:  # else one per super-block (``_pack_sub_scales``)
                d[g, b, lane] = ds[b]
                if m.size:  # else derived by the kernels (OFFSETS_Q8)
                    m[g, b, lane] = ms[b]
            at = b * per
            if four_bit:
                for j in range(Q4_BYTES):
                    byte = qs[at + j] | (qs[at + Q4_BYTES + j] << np.uint8(4))
                    q[g, b, j // QUAD, QUAD * lane + j % QUAD] = byte
            else:
                for j in range(per):
                    q[g, b, j // QUAD, QUAD * lane + j % QUAD] = qs[at + j]


@nb.njit(**KERNEL)
def _pack_sub_scales(raw: np.ndarray, gtype: int, per: int, row0: int, d: np.ndarray, m: np.ndarray,
                     dh: np.ndarray, mh: np.ndarray, sd: np.ndarray, sm: np.ndarray) -> None:
    """The scales of raw rows of a SUB_SCALED format into rows ``row0..``: d and m per super-block,
    float32 (``d``, ``m``) or the file's halves (``dh``, ``mh``: ``_sub_halves``), and their integer
    multiples per block of ``per`` values (``m``, ``mh`` and ``sm`` empty where the offset is
    derived)."""
    n_sup = max(d.shape[1], dh.shape[1])
    q6 = gtype == T_Q6_K
    size = Q6_K_SIZE if q6 else Q4_K_SIZE if gtype == T_Q4_K else Q5_K_SIZE
    d_sup = np.empty(n_sup, np.float32)
    m_sup = np.empty(n_sup, np.float32)
    sd_row = np.empty(sd.shape[1], np.int8)
    sm_row = np.empty(sd.shape[1], np.int8)
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        sub_scales(raw[r], gtype, per, d_sup, m_sup, sd_row, sm_row)
        for s in range(n_sup):
            if dh.size:  # d, and m = -dmin (Q6_K's is derived), bit for bit
                dh[g, s, lane] = _half_bits(raw[r], s * size + (208 if q6 else 0))
                if mh.size:
                    mh[g, s, lane] = _half_bits(raw[r], s * size + 2) ^ _SIGN
                continue
            d[g, s, lane] = d_sup[s]
            if m.size:
                m[g, s, lane] = m_sup[s]
        for b in range(sd.shape[1]):
            sd[g, b, lane] = sd_row[b]
            if sm.size:
                sm[g, b, lane] = sm_row[b]


@nb.njit(inline="always", **KERNEL)
def _half_bits(row: np.ndarray, at: int) -> np.uint16:
    return np.uint16(row[at]) | (np.uint16(row[at + 1]) << np.uint16(8))


@nb.njit(**KERNEL)
def _pack_fives(raw: np.ndarray, gtype: int, size: int, row0: int, q: np.ndarray, d: np.ndarray,
                m: np.ndarray, dh: np.ndarray, mh: np.ndarray) -> None:
    """Raw rows of a Q5 or 4-bit format (``lanes.py``) into rows ``row0..`` of Q5 lanes
    (``Q5_BYTES``): the scales the file's halves where every part is one Q5_0 or Q5_1 (their d,
    and Q5_1's min, at the block's start), else float32. Q5_0's lane quants are Q8's (``+112``):
    moved back to 0..31, m = OFFSET_Q5 d."""
    n_cols = q.shape[1] * BLOCK
    qs = np.empty(n_cols, np.uint8)
    ds = np.empty(q.shape[1], np.float32)
    ms = np.empty(q.shape[1], np.float32)
    shift = np.uint8(112) if gtype == T_Q5_0 else np.uint8(0)
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        lane_row(raw[r], gtype, qs, ds, ms)
        for b in range(q.shape[1]):
            base = b * size
            if dh.shape[1] == q.shape[1]:  # the file's halves per block, bit for bit
                dh[g, b, lane] = _half_bits(raw[r], base)
                if mh.size:
                    mh[g, b, lane] = _half_bits(raw[r], base + 2)
            elif d.shape[1] == q.shape[1]:  # else one per super-block (``_pack_sub_scales``)
                d[g, b, lane] = ds[b]
                if m.size:  # else derived (OFFSETS_Q5)
                    m[g, b, lane] = ms[b] + np.float32(112.0) * ds[b] if shift else ms[b]
            at = b * BLOCK
            for k in range(QUAD):
                fifth = np.uint8(0)
                for p in range(Q4_BYTES // QUAD):
                    lo, hi = qs[at + QUAD * p + k] - shift, qs[at + Q4_BYTES + QUAD * p + k] - shift
                    q[g, b, p, QUAD * lane + k] = (lo & np.uint8(15)) | ((hi & np.uint8(15)) << np.uint8(4))
                    fifth |= ((lo >> np.uint8(4)) << np.uint8(p)) | ((hi >> np.uint8(4)) << np.uint8(4 + p))
                q[g, b, Q4_BYTES // QUAD, QUAD * lane + k] = fifth
