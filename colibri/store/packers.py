"""The compiled passes that write raw GGUF rows into the packed layout (``packed.py``, whose
``make_weight`` picks one per part of a stack), and the layout's byte geometry they write.

The file's words are moved where a format is its kind's own (Q4_0, Q4_1, Q8_0: ``pack_words``;
Q4_K into sub-scaled Q4 lanes: ``pack_q4_k``; Q6_K into Q6: ``pack_q6_k``), groups of rows in
parallel: the expert store packs every miss of such an expert, beside its read, so these passes
run at several GB/s. The other formats go value by value through ``lanes.py`` (``pack_lanes``,
``pack_fives``), their K-quant scales through ``pack_sub_scales``. Every pass is deterministic: a
resident copy and one packed on a miss are the same bits.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.store.blocks import Q4_K_SIZE, Q6_K_SIZE, _scale_min_k4
from colibri.store.formats import GGMLType
from colibri.store.halves import half, to_half
from colibri.store.lanes import lane_row, lane_row16, sub_scales
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
# its file bytes in Q8, 1.00x here with its d the file's half).
Q6_VALUES = BLOCK // 2
SIX_HIGH_BYTES = Q6_VALUES // 4
Q6_BYTES = Q6_VALUES // 2 + SIX_HIGH_BYTES

T_Q5_0, T_MXFP4 = int(GGMLType.Q5_0), int(GGMLType.MXFP4)
# A half's sign bit: m = -dmin is dmin's half with it flipped.
_SIGN = np.uint16(0x8000)


@nb.njit(**KERNEL)
def pack_rows(raw: np.ndarray, size: int, quants_at: int, min_at: int, offset_scale: float,
              flip: np.uint8, row0: int, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
    """Raw GGUF rows of one quantized format (its ``PackLayout``: block ``size`` in bytes, where
    the quants and the min are) into rows ``row0..`` of the packed layout with float32 scales
    (a stack mixing Q4_0 and Q4_1, say); one format alone keeps its halves (``pack_words``)."""
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
def pack_words(raw: np.ndarray, size: int, quants_at: int, min_at: int, flip: np.uint32, row0: int,
               q: np.ndarray, dh: np.ndarray, mh: np.ndarray) -> None:
    """``pack_rows`` for a format whose packed scales are the file's halves (Q4_0, Q4_1, Q8_0):
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
def pack_q4_k(raw: np.ndarray, row0: int, q: np.ndarray, dh: np.ndarray, mh: np.ndarray, sd: np.ndarray,
              sm: np.ndarray) -> None:
    """Raw Q4_K rows into rows ``row0..`` of sub-scaled Q4 lanes, the groups in parallel: what
    ``pack_lanes`` and ``pack_sub_scales`` write, bit for bit, as moves of 32-bit words. A
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
def pack_q6_k(raw: np.ndarray, row0: int, q: np.ndarray, dh: np.ndarray, sd: np.ndarray) -> None:
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
def pack_lanes(raw: np.ndarray, gtype: int, n_cols: int, row0: int, q: np.ndarray, d: np.ndarray,
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
            if per_block:  # else one per super-block (``pack_sub_scales``)
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
def pack_sub_scales(raw: np.ndarray, gtype: int, per: int, row0: int, d: np.ndarray, m: np.ndarray,
                    dh: np.ndarray, mh: np.ndarray, sd: np.ndarray, sm: np.ndarray) -> None:
    """The scales of raw rows of a SUB_SCALED format into rows ``row0..``: d and m per super-block,
    float32 (``d``, ``m``) or the file's halves (``dh``, ``mh``: ``packed._sub_halves``), and their integer
    multiples per block of ``per`` values (``m``, ``mh`` and ``sm`` empty where the offset is
    derived)."""
    n_sup = max(d.shape[1], dh.shape[1])
    d_sup = np.empty(n_sup, np.float32)
    m_sup = np.empty(n_sup, np.float32)
    sd_row = np.empty(sd.shape[1], np.int8)
    sm_row = np.empty(sd.shape[1], np.int8)
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        sub_scales(raw[r], gtype, per, d_sup, m_sup, sd_row, sm_row)
        for s in range(n_sup):
            if dh.size:  # halves widened (d) and negated (m = -dmin): rounded back, the same bits
                dh[g, s, lane] = to_half(d_sup[s])
                if mh.size:
                    mh[g, s, lane] = to_half(m_sup[s])
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
def pack_fives(raw: np.ndarray, gtype: int, size: int, row0: int, q: np.ndarray, d: np.ndarray,
               m: np.ndarray, dh: np.ndarray, mh: np.ndarray) -> None:
    """Raw rows of a Q5 or 4-bit format (``lanes.py``) into rows ``row0..`` of Q5 lanes
    (``Q5_BYTES``): the scales the file's halves where every part is one Q5_0 or Q5_1 (their d,
    and Q5_1's min, at the block's start), else float32. Q5_0's and MXFP4's lane quants are Q8's
    (``+112``): moved back to 0..31 (MXFP4's 4..28), m = OFFSET_Q5 d."""
    n_cols = q.shape[1] * BLOCK
    qs = np.empty(n_cols, np.uint8)
    ds = np.empty(q.shape[1], np.float32)
    ms = np.empty(q.shape[1], np.float32)
    shift = np.uint8(112) if gtype == T_Q5_0 or gtype == T_MXFP4 else np.uint8(0)
    for r in range(raw.shape[0]):
        g, lane = divmod(row0 + r, GROUP)
        lane_row(raw[r], gtype, qs, ds, ms)
        for b in range(q.shape[1]):
            base = b * size
            if dh.shape[1] == q.shape[1]:  # the file's halves per block, bit for bit
                dh[g, b, lane] = _half_bits(raw[r], base)
                if mh.size:
                    mh[g, b, lane] = _half_bits(raw[r], base + 2)
            elif d.shape[1] == q.shape[1]:  # else one per super-block (``pack_sub_scales``)
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
