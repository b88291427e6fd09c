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
expert store packs only ``experts.STORE_LANES``), keep the file's blocks
(``Kind.BLOCKS``, decoded by ``colibri.store.blocks``), no bigger than the file.

Q8_0's quants are kept *biased* (``q + 128``, an unsigned byte, with ``m = -128 d``): the integer
dot product multiplies unsigned weight bytes by signed activation bytes. Float formats are
widened by ``blocks.dequantize_row``.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.store import packers
from colibri.store.arena import Arena
from colibri.store.blocks import dequantize_row
from colibri.store.formats import FORMATS, GGMLType, Kind, computed_format, row_nbytes
from colibri.store.lanes import (
    FIVE_BIT,
    FOUR_BIT,
    LANE_TYPES,
    SIXTEEN,
)
from colibri.store.numerics import BLOCK, KERNEL, QK_K
from colibri.store.packers import (  # the layout's byte geometry, as the packers write it
    GROUP,
    Q4_BYTES,
    Q5_BYTES,
    Q6_BYTES,
    Q6_VALUES,
    Q8_BYTES,
    QUAD,
)

# The offset m of Q4_0 and Q8_0 blocks, a fixed multiple of d: a matrix of only those keeps no m
# (a fifth fewer bytes to read per Q4_0 weight, a tenth per Q8_0 one) and the kernels derive it.
OFFSET_Q4 = np.float32(FORMATS[GGMLType.Q4_0].pack.offset_scale)
OFFSET_Q8 = np.float32(FORMATS[GGMLType.Q8_0].pack.offset_scale)
OFFSET_Q5 = np.float32(-16.0)  # Q5_0's: value = d (q - 16)
OFFSET_Q6 = np.float32(-32.0)  # Q6_K's: value = d sc (q - 32)

# The kinds as plain ints, for numba (``Weight.kind``).
KIND_F32, KIND_Q4, KIND_Q8, KIND_BLOCKS = int(Kind.FLOAT), int(Kind.Q4), int(Kind.Q8), int(Kind.BLOCKS)
KIND_Q5, KIND_Q6 = int(Kind.Q5), int(Kind.Q6)

T_Q4_K = int(GGMLType.Q4_K)


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


# The formats whose offset m is OFFSET_Q4 d as Q4, OFFSET_Q5 d as Q5, OFFSET_Q6 d as Q6 (Q6_K's
# own quants, unshifted) and OFFSET_Q8 d as Q8 (Q5_0, IQ4, MXFP4 and Q6_K through their lanes:
# ``lanes._legacy`` shifts Q5_0's quants to it, ``lanes._q6_k`` Q6_K's by 96, IQ4's and MXFP4's
# grids are stored +128; MXFP4's +16 in Q5).
OFFSETS_Q4 = frozenset({GGMLType.Q4_0})
OFFSETS_Q5 = frozenset({GGMLType.Q5_0, GGMLType.MXFP4})
OFFSETS_Q6 = frozenset({GGMLType.Q6_K})
OFFSETS_Q8 = frozenset({GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.Q6_K,
                        GGMLType.MXFP4})


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
        w = Weight(kind, n_rows, q, d, m, _EMPTY_F, _EMPTY_RAW, _EMPTY_PARTS, dh, mh, sd, sm)
        row = 0
        for raw, t in parts:
            _pack_part(raw, t, row, w, n_cols, halves)
            row += raw.shape[0]
        return w
    f = (np.empty if arena is None else arena.empty)((n_rows, n_cols), np.float32)
    row = 0
    for raw, t in parts:
        computed_format(t)  # an unknown type raises here, not in the compiled loop
        for r in range(raw.shape[0]):
            dequantize_row(raw[r], t, f[row])
            row += 1
    return Weight(KIND_F32, n_rows, _EMPTY_Q, _EMPTY_S, _EMPTY_S, f, _EMPTY_RAW, _EMPTY_PARTS, _EMPTY_H,
                  _EMPTY_H, _EMPTY_I, _EMPTY_I)


def _pack_part(raw: np.ndarray, t: int, row: int, w: Weight, n_cols: int, halves: bool) -> None:
    """One part's rows into rows ``row..`` of ``w``'s arrays, by the pass its format and ``w``'s
    kind call for (``packers.py``): the file's words moved where they can be, else value by value."""
    fmt = FORMATS[GGMLType(t)]
    layout, kind, n_blocks = fmt.pack, w.kind, w.q.shape[1]
    if w.sd.size and kind == KIND_Q4 and t == T_Q4_K:
        packers.pack_q4_k(np.ascontiguousarray(raw), row, w.q, w.dh, w.mh, w.sd, w.sm)
        return
    if kind == KIND_Q6:
        packers.pack_q6_k(np.ascontiguousarray(raw), row, w.q, w.dh, w.sd)
        return
    if w.sd.size:
        packers.pack_sub_scales(raw, t, n_cols // n_blocks, row, w.d, w.m, w.dh, w.mh, w.sd, w.sm)
    if kind == KIND_Q5:
        packers.pack_fives(raw, t, fmt.nbytes, row, w.q, w.d, w.m, w.dh, w.mh)
    elif fmt.kind == kind and n_blocks * BLOCK == n_cols and halves:  # the file's bytes, moved
        packers.pack_words(np.ascontiguousarray(raw), fmt.nbytes, layout.quants_at, layout.min_at,
                           np.uint32(layout.flip * 0x01010101), row, w.q, w.dh, w.mh)
    elif fmt.kind == kind and n_blocks * BLOCK == n_cols:  # its own kind, scales widened
        packers.pack_rows(raw, fmt.nbytes, layout.quants_at, layout.min_at, layout.offset_scale,
                          np.uint8(layout.flip), row, w.q, w.d, w.m)
    else:
        packers.pack_lanes(raw, t, n_cols, row, w.q, w.d, w.m)


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
