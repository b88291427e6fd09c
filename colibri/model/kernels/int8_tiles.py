"""The integer sums of one packed weight block (``colibri.store.packed``) against 1, 4 or 8
activation rows of 8-bit quants: the inner loops of ``int8_matmul``, one function per tile shape.

A block's quants are read a 64-byte vector at a time (a quad: 4 quants of 16 weight rows) and
split once into bytes (Q4's nibbles, Q5's and Q6's with their high bits from the block's last
quad), then multiplied with each row's activation quad broadcast (``simd.dpbusd``). Integer sums
are exact, so a row's sums are the same whatever tile it is in: which tile a row takes depends on
how many rows the call has, never its result.
"""

from __future__ import annotations

import numba as nb

from colibri.model.kernels.simd import (
    LANES,
    dpbusd,
    high_fives,
    high_nibbles,
    high_sixes,
    load_bytes,
    load_quad,
    low_fives,
    low_nibbles,
    low_sixes,
)
from colibri.store.numerics import BLOCK, KERNEL
from colibri.store.packed import GROUP, Q5_BYTES, Q6_BYTES, QUAD

# Bytes of a packed block's quad p, across a group's rows: GROUP rows x 4 bytes.
QUAD_BYTES = 4 * GROUP


@nb.njit(inline="always", **KERNEL)
def _dot(i1, i2, w, xqf, at: int, k: int, two: bool):  # noqa: ANN001, ANN202
    """Each level's sum plus one weight vector times that level's activation quad at ``at``
    (levels ``k`` bytes apart); ``i2`` as it is with one level."""
    i1 = dpbusd(i1, w, load_quad(xqf, at))
    return i1, dpbusd(i2, w, load_quad(xqf, at + k)) if two else i2


@nb.njit(inline="always", **KERNEL)
def _dot_halves(i1, i2, lo, hi, xqf, at: int, ah: int, k: int, two: bool):  # noqa: ANN001, ANN202
    """A quad's two weight vectors ``lo`` and ``hi`` (activations at ``at`` and ``ah``): with two
    levels each into both levels' sums; with one, ``lo`` into ``i1`` and ``hi`` into ``i2`` (summed
    in ``_scaled``: two chains of dot products, where one would wait on each one's latency)."""
    if two:
        i1, i2 = _dot(i1, i2, lo, xqf, at, k, two)
        return _dot(i1, i2, hi, xqf, ah, k, two)
    return dpbusd(i1, lo, load_quad(xqf, at)), dpbusd(i2, hi, load_quad(xqf, ah))


@nb.njit(inline="always", **KERNEL)
def _halves(v, h, p: int, bits: int):  # noqa: ANN001, ANN202
    """The quants of weight vector ``v`` (quad ``p`` of a block) as bytes: Q4's low and high
    nibbles (quants 4p.. and 16 + 4p..), Q5's with their fifth bits from ``h``, Q6's (quants 4p..
    and 8 + 4p.. of 16) with their two high bits from ``h``."""
    if bits == 5:
        return low_fives(v, h, p), high_fives(v, h, p)
    if bits == 6:
        return low_sixes(v, h, p), high_sixes(v, h, p)
    return low_nibbles(v), high_nibbles(v)


@nb.njit(inline="always", **KERNEL)
def _half_values(bits: int) -> int:
    """Values of a block's first half, whose quants are the low nibbles: Q6's blocks are of 16."""
    return 8 if bits == 6 else BLOCK // 2


@nb.njit(inline="always", **KERNEL)
def _row_block_of(z, qf, base: int, quads: int, xqf, x0: int, k: int, bits: int, two: bool):  # noqa: ANN001, ANN202
    """One block of one activation row against a group's 32 weight rows, two vectors of 16: each
    level's integer sum per vector, from zero sums ``z``. Both vectors take the same steps as in
    ``four_blocks``; here they share the activation loads and read the group's bytes in order.
    ``bits``: 4, 5 or 6 (two quants a byte, Q5's fifth bits or Q6's high bits in the block's last
    quad) or 8."""
    a1 = a2 = c1 = c2 = z
    hv = hu = z
    planed = bits == 5 or bits == 6  # the high bits in the block's last quad
    if planed:
        hv = load_bytes(qf, base + (quads - 1) * QUAD_BYTES)
        hu = load_bytes(qf, base + (quads - 1) * QUAD_BYTES + 4 * LANES)
    for p in range(quads - 1 if planed else quads):
        v = load_bytes(qf, base + p * QUAD_BYTES)
        u = load_bytes(qf, base + p * QUAD_BYTES + 4 * LANES)
        if bits != 8:
            at, ah = x0 + 4 * p, x0 + _half_values(bits) + 4 * p
            lo, hi = _halves(v, hv, p, bits)
            a1, a2 = _dot_halves(a1, a2, lo, hi, xqf, at, ah, k, two)
            lo, hi = _halves(u, hu, p, bits)
            c1, c2 = _dot_halves(c1, c2, lo, hi, xqf, at, ah, k, two)
        else:
            a1, a2 = _dot(a1, a2, v, xqf, x0 + 4 * p, k, two)
            c1, c2 = _dot(c1, c2, u, xqf, x0 + 4 * p, k, two)
    return a1, a2, c1, c2


# Q5's (and Q6's) loops in a copy of their own, its width and its quads per block constants: the quad
# loop then unrolls and the fifth bits' shifts (by the quad's index) become immediates, where a
# run-time width kept a test, a variable shift and the masks' loads in every quad. The default
# model's Q4_K_M (mostly Q5_0 where its rows of 576 take no K-quant) decodes 10% faster at one
# row and 6% at 16 (docs/performance.md); Q4's and Q8's copies (tried) gave nothing measurable
# and cost compile time, so they keep the shared loop.
Q5_QUADS = Q5_BYTES // QUAD
Q6_QUADS = Q6_BYTES // QUAD


@nb.njit(inline="always", **KERNEL)
def row_block(z, qf, base: int, quads: int, xqf, x0: int, k: int, bits: int, two: bool):  # noqa: ANN001, ANN202
    """``_row_block_of``, Q5's and Q6's copies with their widths and quads constants."""
    if bits == 5:
        return _row_block_of(z, qf, base, Q5_QUADS, xqf, x0, k, 5, two)
    if bits == 6:
        return _row_block_of(z, qf, base, Q6_QUADS, xqf, x0, k, 6, two)
    return _row_block_of(z, qf, base, quads, xqf, x0, k, bits, two)


@nb.njit(inline="always", **KERNEL)
def _four_blocks_of(z, qf, base: int, quads: int, xqf, x0: int, k: int, bits: int, two: bool):  # noqa: ANN001, ANN202
    """``row_block`` for four activation rows (``levels k`` apart in ``xqf``), each weight vector
    loaded and split once. Each row's sums take ``row_block``'s steps."""
    a1 = a2 = b1 = b2 = c1 = c2 = e1 = e2 = z
    r = (2 if two else 1) * k
    planed = bits == 5 or bits == 6
    h = load_bytes(qf, base + (quads - 1) * QUAD_BYTES) if planed else z
    for p in range(quads - 1 if planed else quads):
        v = load_bytes(qf, base + p * QUAD_BYTES)
        if bits != 8:
            lo, hi = _halves(v, h, p, bits)
            at, ah = x0 + 4 * p, x0 + _half_values(bits) + 4 * p
            a1, a2 = _dot_halves(a1, a2, lo, hi, xqf, at, ah, k, two)
            b1, b2 = _dot_halves(b1, b2, lo, hi, xqf, at + r, ah + r, k, two)
            c1, c2 = _dot_halves(c1, c2, lo, hi, xqf, at + 2 * r, ah + 2 * r, k, two)
            e1, e2 = _dot_halves(e1, e2, lo, hi, xqf, at + 3 * r, ah + 3 * r, k, two)
        else:
            at = x0 + 4 * p
            a1, a2 = _dot(a1, a2, v, xqf, at, k, two)
            b1, b2 = _dot(b1, b2, v, xqf, at + r, k, two)
            c1, c2 = _dot(c1, c2, v, xqf, at + 2 * r, k, two)
            e1, e2 = _dot(e1, e2, v, xqf, at + 3 * r, k, two)
    return a1, a2, b1, b2, c1, c2, e1, e2


@nb.njit(inline="always", **KERNEL)
def four_blocks(z, qf, base: int, quads: int, xqf, x0: int, k: int, bits: int, two: bool):  # noqa: ANN001, ANN202
    """``_four_blocks_of``, Q5's and Q6's copies with their widths and quads constants."""
    if bits == 5:
        return _four_blocks_of(z, qf, base, Q5_QUADS, xqf, x0, k, 5, two)
    if bits == 6:
        return _four_blocks_of(z, qf, base, Q6_QUADS, xqf, x0, k, 6, two)
    return _four_blocks_of(z, qf, base, quads, xqf, x0, k, bits, two)


@nb.njit(inline="always", **KERNEL)
def _pair(s, lo, hi, xqf, at: int, ah: int):  # noqa: ANN001, ANN202
    """``s`` plus both halves of a quad against their activation quads at ``at`` and ``ah``."""
    return dpbusd(dpbusd(s, lo, load_quad(xqf, at)), hi, load_quad(xqf, ah))


@nb.njit(inline="always", **KERNEL)
def _eight_blocks_of(z, qf, base: int, quads: int, xqf, x0: int, k: int, bits: int, two: bool):  # noqa: ANN001, ANN202
    """Eight activation rows' sums (``levels k`` apart in ``xqf``) against one vector of 16 weight
    rows, each weight vector loaded and split once for all eight: ``s`` the first level's, ``u``
    the second's (zero at one level). A row's low and high halves go into one sum per level: eight
    rows are eight chains of dot products or more, enough to hide each one's latency where four
    rows at one level needed two chains a row (``_dot_halves``)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = z
    u0 = u1 = u2 = u3 = u4 = u5 = u6 = u7 = z
    r = (2 if two else 1) * k
    planed = bits == 5 or bits == 6
    h = load_bytes(qf, base + (quads - 1) * QUAD_BYTES) if planed else z
    for p in range(quads - 1 if planed else quads):
        v = load_bytes(qf, base + p * QUAD_BYTES)
        if bits != 8:
            lo, hi = _halves(v, h, p, bits)
            at, ah = x0 + 4 * p, x0 + _half_values(bits) + 4 * p
            s0 = _pair(s0, lo, hi, xqf, at, ah)
            s1 = _pair(s1, lo, hi, xqf, at + r, ah + r)
            s2 = _pair(s2, lo, hi, xqf, at + 2 * r, ah + 2 * r)
            s3 = _pair(s3, lo, hi, xqf, at + 3 * r, ah + 3 * r)
            s4 = _pair(s4, lo, hi, xqf, at + 4 * r, ah + 4 * r)
            s5 = _pair(s5, lo, hi, xqf, at + 5 * r, ah + 5 * r)
            s6 = _pair(s6, lo, hi, xqf, at + 6 * r, ah + 6 * r)
            s7 = _pair(s7, lo, hi, xqf, at + 7 * r, ah + 7 * r)
            if two:
                u0 = _pair(u0, lo, hi, xqf, at + k, ah + k)
                u1 = _pair(u1, lo, hi, xqf, at + r + k, ah + r + k)
                u2 = _pair(u2, lo, hi, xqf, at + 2 * r + k, ah + 2 * r + k)
                u3 = _pair(u3, lo, hi, xqf, at + 3 * r + k, ah + 3 * r + k)
                u4 = _pair(u4, lo, hi, xqf, at + 4 * r + k, ah + 4 * r + k)
                u5 = _pair(u5, lo, hi, xqf, at + 5 * r + k, ah + 5 * r + k)
                u6 = _pair(u6, lo, hi, xqf, at + 6 * r + k, ah + 6 * r + k)
                u7 = _pair(u7, lo, hi, xqf, at + 7 * r + k, ah + 7 * r + k)
        else:
            at = x0 + 4 * p
            s0 = dpbusd(s0, v, load_quad(xqf, at))
            s1 = dpbusd(s1, v, load_quad(xqf, at + r))
            s2 = dpbusd(s2, v, load_quad(xqf, at + 2 * r))
            s3 = dpbusd(s3, v, load_quad(xqf, at + 3 * r))
            s4 = dpbusd(s4, v, load_quad(xqf, at + 4 * r))
            s5 = dpbusd(s5, v, load_quad(xqf, at + 5 * r))
            s6 = dpbusd(s6, v, load_quad(xqf, at + 6 * r))
            s7 = dpbusd(s7, v, load_quad(xqf, at + 7 * r))
            if two:
                u0 = dpbusd(u0, v, load_quad(xqf, at + k))
                u1 = dpbusd(u1, v, load_quad(xqf, at + r + k))
                u2 = dpbusd(u2, v, load_quad(xqf, at + 2 * r + k))
                u3 = dpbusd(u3, v, load_quad(xqf, at + 3 * r + k))
                u4 = dpbusd(u4, v, load_quad(xqf, at + 4 * r + k))
                u5 = dpbusd(u5, v, load_quad(xqf, at + 5 * r + k))
                u6 = dpbusd(u6, v, load_quad(xqf, at + 6 * r + k))
                u7 = dpbusd(u7, v, load_quad(xqf, at + 7 * r + k))
    return s0, s1, s2, s3, s4, s5, s6, s7, u0, u1, u2, u3, u4, u5, u6, u7


@nb.njit(inline="always", **KERNEL)
def eight_blocks(z, qf, base: int, quads: int, xqf, x0: int, k: int, bits: int, two: bool):  # noqa: ANN001, ANN202
    """``_eight_blocks_of``, Q5's and Q6's copies with their widths and quads constants."""
    if bits == 5:
        return _eight_blocks_of(z, qf, base, Q5_QUADS, xqf, x0, k, 5, two)
    if bits == 6:
        return _eight_blocks_of(z, qf, base, Q6_QUADS, xqf, x0, k, 6, two)
    return _eight_blocks_of(z, qf, base, quads, xqf, x0, k, bits, two)
