"""``out = x @ W.T`` for packed Q4, Q5, Q6 and Q8 weights: integer dot products on 8-bit activations.

Each activation row is first written as two 8-bit levels per 32 values, ``x ~ d1 q1 + d2 q2``:
``q1`` llama.cpp's Q8_0 rounding (ties to even; ``d1 = max|x|`` times float32's 1/127, an ulp from
Q8_0's ``max|x| / 127`` in a few blocks), ``q2`` the remainder rounded again on a step 254 times
finer. Every weight block is then two exact integer dot products (``simd.dpbusd``: 64 u8 x s8
products an instruction), scaled once in float32 by the blocks' scales. One level alone
(llama.cpp's way) flips the default model's top token against llama.cpp's own at a logit gap
of 0.3 or more (``tests/test_golden.py``); two pass every golden test, and a third (float32's
precision, kept until 2026-12-04) cost a third of the dot products at 16 rows, which the step is
bound by there. A packed matrix's prompt run whole, in chunks or token by token gives bitwise the
same rows (every row takes these steps, and attention is the decode loop's for all rows), so the
levels need not hide a difference between two paths.

Experts (``int8_matmul_slots``, every row an expert takes, prompt or decode) round to one level,
``EXPERT_LEVELS``: llama.cpp's precision class (its Q8_K has one scale per 256 values, this one per
32; the logits move a fifth as much as llama.cpp's own, ``tests/test_kquants_wide.py``), for half
the dot products. A MoE prompt is bound by its experts' products: one level made the qwen3moe
file's prefill 22% faster and its decode 5% (docs/performance.md). The one level's sum is kept in
two accumulators, a quad's low and high halves (``_dot_halves``): one chain of dependent dot
products would wait on each one's latency.

In the packed layout (``colibri.store.packed``) the 4 bytes of a 32-bit lane are four consecutive
quants of one weight row and a vector's 16 lanes are 16 rows: a block needs no horizontal sum,
and each weight vector is loaded and split into nibbles once for eight activation rows
(``int8_tiles``). Every row's sums take the same steps whatever the number of rows, so its result
is bitwise the same alone or batched.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.int8_tiles import QUAD_BYTES, eight_blocks, four_blocks, row_block
from colibri.model.kernels.simd import (
    LANES,
    add_int,
    fma_float,
    load_i8_floats,
    load_widened,
    mul_float,
    splat_float,
    splat_int,
    store_floats,
    to_float,
    zeros_float,
    zeros_int,
)
from colibri.store.numerics import BLOCK, KERNEL
from colibri.store.packed import (
    GROUP,
    KIND_Q4,
    KIND_Q5,
    KIND_Q6,
    OFFSET_Q4,
    OFFSET_Q5,
    OFFSET_Q6,
    OFFSET_Q8,
    Weight,
    slot,
)

# Activation rows sharing one load of a weight vector (``int8_tiles``): a tile of 8 keeps 16
# integer sums (one per row and level) and 8 float accumulators, the weights, their bytes and the
# block's scales in the rest of AVX-512's 32 registers; the rows left over go 4, then 1 at a time.
# Eight rows split each weight vector into bytes and scale each block's weights once for twice the
# dot products of four: a prompt's Q4_K expert products (one level) ran 14-23% faster, Q6_K's
# 18-34%, the attention's projections (two levels) 10-19% (docs/performance.md).
TILE_ROWS, ROWS = 8, 4
# The fixed offsets of Q4_0 and Q8_0 (m = OFFSET d) as integers: applied in the integer sum.
_OFF_Q4, _OFF_Q5, _OFF_Q6, _OFF_Q8 = int(OFFSET_Q4), int(OFFSET_Q5), int(OFFSET_Q6), int(OFFSET_Q8)
assert _OFF_Q4 == OFFSET_Q4 and _OFF_Q5 == OFFSET_Q5 and _OFF_Q6 == OFFSET_Q6 and _OFF_Q8 == OFFSET_Q8
# The quant range of every level, and how much finer each level's step is than the one before:
# a remainder is within half a step, so 2 x 127 finer steps span it.
Q_MAX = np.float32(127.0)
FINER = np.float32(254.0)
INV_Q_MAX, INV_FINER = np.float32(1.0) / Q_MAX, np.float32(1.0) / FINER
# Levels of 8-bit activation quants: two (127 x 254 steps per block's range, ~15 bits). One
# failed the golden tests against llama.cpp, three cost half as many dot products again (see
# above). The kernels below are written out for two or one (``two``, a constant of each caller).
LEVELS = 2
# The experts' levels (``int8_matmul_slots``): one, llama.cpp's precision class, for half the dot
# products that bound a MoE prompt (see above).
EXPERT_LEVELS = 1
assert EXPERT_LEVELS in (1, 2) and LEVELS == 2
# Runs of the experts' work items (``int8_matmul_slots``): numba's threads take equal shares of
# them in order, so any thread count up to a few dozen gets shares within a run of even.
RUNS = 64
# An item's cost beyond its rows, in rows: reading its group's weights, which bounds a decode
# row's item (one row: the weights' bytes are the work).
ITEM_COST = 4


@nb.njit(**KERNEL)
def quantize_row(x: np.ndarray, per: int, xq: np.ndarray, dx: np.ndarray, sx: np.ndarray) -> None:
    """A row ``x`` into LEVELS levels of 8-bit quants ``xq[level]`` per 32 values, each rounding
    the remainder of the one before; per weight block of ``per`` values (32 or 16), ``dx[level]``
    the level's scale and ``sx[level]`` the sum of its quants.

    One block of 32 at a time, every level of it while its remainder is in registers. The inner
    loops index views from 0 (an index numba cannot prove non-negative costs a wraparound select
    per element, and the loop then stops vectorizing), and the steps are multiplied by constant
    reciprocals, so the bits do not hang on how LLVM happens to lower a division: 1.9 -> 0.9-1.3
    us for 576 values, 4.9 -> 2.4 for 1536."""
    assert per <= BLOCK and BLOCK % per == 0
    subs, levels = BLOCK // per, xq.shape[0]
    rest = np.empty(BLOCK, np.float32)
    q = np.empty(BLOCK, np.float32)
    for b in range(x.shape[0] // BLOCK):
        xb = x[b * BLOCK : (b + 1) * BLOCK]
        amax = np.float32(0.0)
        for i in range(BLOCK):
            amax = max(amax, abs(xb[i]))
            rest[i] = xb[i]
        step = amax * INV_Q_MAX
        for level in range(levels):
            inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
            xqb = xq[level, b * BLOCK : (b + 1) * BLOCK]
            for i in range(BLOCK):
                q[i] = min(Q_MAX, max(-Q_MAX, np.rint(rest[i] * inv)))
                rest[i] -= q[i] * step
                xqb[i] = np.int8(q[i])
            for j in range(subs):
                qs = q[j * per : (j + 1) * per]
                total = 0  # an integer sum: exact, and it vectorizes without reassociating floats
                for i in range(per):
                    total += np.int32(qs[i])
                dx[level, b * subs + j], sx[level, b * subs + j] = step, np.int32(total)
            step = step * INV_FINER


@nb.njit(inline="always", **KERNEL)
def _level(acc, isum, dw, dl: float):  # noqa: ANN001, ANN202
    """``acc + isum d dl``: one level's integer sums, scaled by the weights' and its own scale."""
    return fma_float(to_float(isum), mul_float(dw, splat_float(dl)), acc)


@nb.njit(inline="always", **KERNEL)
def _scaled(acc, i1, i2, dw, mw, stored_m: bool, dx: np.ndarray, sx: np.ndarray, xs: np.ndarray,  # noqa: ANN001, ANN202
            t: int, b: int, off: int, two: bool):
    """``acc`` plus one block's integer sums of row ``t``, one per level, scaled by the block's
    weight scales ``dw`` and offsets ``mw``: ``d dl (il + off sl)`` per level l where the offset is
    derived (not ``stored_m``), else ``d dl il`` per level and ``m xs`` (``offset_terms``)."""
    if not two:  # one level: its sum split in two (``_dot_halves``)
        return _scaled_one(acc, add_int(i1, i2), dw, mw, stored_m, dx, sx, xs, t, b, off)
    if not stored_m:
        acc = _level(acc, add_int(i1, splat_int(off * sx[t, 0, b])), dw, dx[t, 0, b])
        return _level(acc, add_int(i2, splat_int(off * sx[t, 1, b])), dw, dx[t, 1, b])
    acc = _level(_level(acc, i1, dw, dx[t, 0, b]), i2, dw, dx[t, 1, b])
    return fma_float(mw, splat_float(xs[t, b]), acc)


@nb.njit(inline="always", **KERNEL)
def _scaled_one(acc, i, dw, mw, stored_m: bool, dx: np.ndarray, sx: np.ndarray, xs: np.ndarray,  # noqa: ANN001, ANN202
                t: int, b: int, off: int):
    """``_scaled`` at one level, its sum ``i`` whole."""
    if not stored_m:
        return _level(acc, add_int(i, splat_int(off * sx[t, 0, b])), dw, dx[t, 0, b])
    return fma_float(mw, splat_float(xs[t, b]), _level(acc, i, dw, dx[t, 0, b]))


@nb.njit(**KERNEL)
def offset_terms(dx: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """``xs[t, b] = d1 s1 (+ d2 s2)``: each row's factor of a block's stored offsets (K-quants'
    mins), once a call, where the scaling multiplied it out for every weight vector (a scalar
    multiply and conversion per block and row, on the float pipes the dot products need)."""
    t_rows, levels, n_blocks = dx.shape
    xs = np.empty((t_rows, n_blocks), np.float32)
    for t in range(t_rows):
        for b in range(n_blocks):
            v = dx[t, 0, b] * np.float32(sx[t, 0, b])
            if levels == 2:
                v += dx[t, 1, b] * np.float32(sx[t, 1, b])
            xs[t, b] = v
    return xs


@nb.njit(inline="always", **KERNEL)
def _scales(df, mf, sdf, smf, s: int, at: int, stored_m: bool, subbed: bool):  # noqa: ANN001, ANN202
    """A block's scales and offsets for 16 weight rows: ``d`` and ``m`` at ``s``, each times its
    block's integer multiple at ``at`` where the weight is sub-scaled (``packed.SUB_SCALED``: the
    decoder's float32 product, bit for bit); ``m`` is ``d`` where the offset is derived."""
    dw = load_widened(df, s)
    if subbed:
        dw = mul_float(dw, load_i8_floats(sdf, at))
    if not stored_m:
        return dw, dw
    mw = load_widened(mf, s)
    if subbed:
        mw = mul_float(mw, load_i8_floats(smf, at))
    return dw, mw


@nb.njit(inline="always", **KERNEL)
def _group(w: Weight, g: int, xq: np.ndarray, dx: np.ndarray, sx: np.ndarray, xs: np.ndarray,
           out: np.ndarray, ds: np.ndarray, ms: np.ndarray, two: bool) -> None:
    """Rows ``GROUP g ..`` of W against every activation row: eight rows at a time, then four, one
    vector of 16 weight rows after the other, then the rest of the rows one at a time, both vectors
    at once (``int8_tiles``). ``ds``, ``ms``: scales and offsets, float32 or
    halves; ``xs``: ``offset_terms``; ``two``: two levels (an entry's constant). One copy of the
    loops for every kind, its bit width decided at run time (a copy per kind made 16 rows 12% faster
    but compiled 3.5-4x slower), but Q5's and Q6's block loops (``int8_tiles.Q5_QUADS``).

    Kept whole: the three tile loops index the same dozen derived values (the kind's width and
    offset, the flat views, the super-block shift), and read as one kernel beside each other; a
    loop apart would take them all as arguments."""
    bits = 4 if w.kind == KIND_Q4 else 5 if w.kind == KIND_Q5 else 6 if w.kind == KIND_Q6 else 8
    off = _OFF_Q4 if bits == 4 else _OFF_Q5 if bits == 5 else _OFF_Q6 if bits == 6 else _OFF_Q8
    quads = w.q.shape[2]
    t_rows, levels, k = xq.shape  # ``two``: levels == 2, a constant of the caller's
    n_blocks = w.q.shape[1]
    per = k // n_blocks  # values per weight block: 32, or 16
    qf, xqf = w.q.reshape(-1), xq.reshape(-1)
    df, mf = ds.reshape(-1), ms.reshape(-1)
    sdf, smf = w.sd.reshape(-1), w.sm.reshape(-1)
    stored_m, subbed = mf.size > 0, sdf.size > 0
    n_sup = ds.shape[1]  # scales per row: one a block, or (sub-scaled) one a super-block
    sup_shift = 0  # blocks per super-block, a power of two: 2 ** sup_shift (a shift, not a division)
    while n_sup << sup_shift < n_blocks:
        sup_shift += 1
    r0, z = g * GROUP, zeros_int()
    n_lo, n_hi = min(LANES, w.n_rows - r0), min(LANES, w.n_rows - r0 - LANES)  # rows each vector writes
    t = 0
    while t + TILE_ROWS <= t_rows:
        for lane0 in range(0, GROUP, LANES):
            n_out = n_lo if lane0 == 0 else n_hi
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zeros_float()
            for b in range(n_blocks):
                blk = g * n_blocks + b
                s0, s1, s2, s3, s4, s5, s6, s7, u0, u1, u2, u3, u4, u5, u6, u7 = eight_blocks(
                    z, qf, blk * quads * QUAD_BYTES + 4 * lane0, quads, xqf, levels * t * k + b * per, k,
                    bits, two)
                dw, mw = _scales(df, mf, sdf, smf, (g * n_sup + (b >> sup_shift)) * GROUP + lane0,
                                 blk * GROUP + lane0, stored_m, subbed)
                a0 = _scaled(a0, s0, u0, dw, mw, stored_m, dx, sx, xs, t, b, off, two)
                a1 = _scaled(a1, s1, u1, dw, mw, stored_m, dx, sx, xs, t + 1, b, off, two)
                a2 = _scaled(a2, s2, u2, dw, mw, stored_m, dx, sx, xs, t + 2, b, off, two)
                a3 = _scaled(a3, s3, u3, dw, mw, stored_m, dx, sx, xs, t + 3, b, off, two)
                a4 = _scaled(a4, s4, u4, dw, mw, stored_m, dx, sx, xs, t + 4, b, off, two)
                a5 = _scaled(a5, s5, u5, dw, mw, stored_m, dx, sx, xs, t + 5, b, off, two)
                a6 = _scaled(a6, s6, u6, dw, mw, stored_m, dx, sx, xs, t + 6, b, off, two)
                a7 = _scaled(a7, s7, u7, dw, mw, stored_m, dx, sx, xs, t + 7, b, off, two)
            for j, acc in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
                store_floats(out, t + j, r0 + lane0, acc, n_out)
        t += TILE_ROWS
    while t + ROWS <= t_rows:
        for lane0 in range(0, GROUP, LANES):
            n_out = n_lo if lane0 == 0 else n_hi
            a, b_, c, e = zeros_float(), zeros_float(), zeros_float(), zeros_float()
            for b in range(n_blocks):
                blk = g * n_blocks + b
                at = blk * GROUP + lane0
                a1, a2, b1, b2, c1, c2, e1, e2 = four_blocks(
                    z, qf, blk * quads * QUAD_BYTES + 4 * lane0, quads, xqf, levels * t * k + b * per, k,
                    bits, two)
                sa = (g * n_sup + (b >> sup_shift)) * GROUP + lane0
                dw, mw = _scales(df, mf, sdf, smf, sa, at, stored_m, subbed)
                a = _scaled(a, a1, a2, dw, mw, stored_m, dx, sx, xs, t, b, off, two)
                b_ = _scaled(b_, b1, b2, dw, mw, stored_m, dx, sx, xs, t + 1, b, off, two)
                c = _scaled(c, c1, c2, dw, mw, stored_m, dx, sx, xs, t + 2, b, off, two)
                e = _scaled(e, e1, e2, dw, mw, stored_m, dx, sx, xs, t + 3, b, off, two)
            store_floats(out, t, r0 + lane0, a, n_out)
            store_floats(out, t + 1, r0 + lane0, b_, n_out)
            store_floats(out, t + 2, r0 + lane0, c, n_out)
            store_floats(out, t + 3, r0 + lane0, e, n_out)
        t += ROWS
    while t < t_rows:
        a, c = zeros_float(), zeros_float()
        for b in range(n_blocks):
            blk = g * n_blocks + b
            a1, a2, c1, c2 = row_block(z, qf, blk * quads * QUAD_BYTES, quads,
                                       xqf, levels * t * k + b * per, k, bits, two)
            at, sa = blk * GROUP, (g * n_sup + (b >> sup_shift)) * GROUP
            dw, mw = _scales(df, mf, sdf, smf, sa, at, stored_m, subbed)
            du, mu = _scales(df, mf, sdf, smf, sa + LANES, at + LANES, stored_m, subbed)
            a = _scaled(a, a1, a2, dw, mw, stored_m, dx, sx, xs, t, b, off, two)
            c = _scaled(c, c1, c2, du, mu, stored_m, dx, sx, xs, t, b, off, two)
        store_floats(out, t, r0, a, n_lo)
        store_floats(out, t, r0 + LANES, c, n_hi)
        t += 1


@nb.njit(parallel=True, **KERNEL)
def int8_matmul(x: np.ndarray, w: Weight, out: np.ndarray) -> None:
    """``out[T, N] = x[T, K] @ W.T`` for a packed weight (``out``'s rows contiguous), ``x`` at
    LEVELS."""
    t_rows, k = x.shape
    n_blocks = w.q.shape[1]
    per = k // n_blocks
    xq = np.empty((t_rows, LEVELS, k), np.int8)
    dx = np.empty((t_rows, LEVELS, n_blocks), np.float32)
    sx = np.empty((t_rows, LEVELS, n_blocks), np.int32)
    if t_rows == 1:  # decode of one stream: no second parallel region
        quantize_row(x[0], per, xq[0], dx[0], sx[0])
    else:
        for t in nb.prange(t_rows):
            quantize_row(x[t], per, xq[t], dx[t], sx[t])
    xs = offset_terms(dx, sx)
    if w.dh.size:  # one item: a group's 32 weight rows, all activation rows
        for g in nb.prange(w.q.shape[0]):
            _group(w, g, xq, dx, sx, xs, out, w.dh, w.mh, True)
    else:
        for g in nb.prange(w.q.shape[0]):
            _group(w, g, xq, dx, sx, xs, out, w.d, w.m, True)


@nb.njit(parallel=True, **KERNEL)
def quantize_rows(x: np.ndarray, per: int, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_row`` of every row of ``x``: (xq, dx, sx), as ``int8_matmul`` makes them."""
    t_rows, k = x.shape
    n_blocks = k // per
    xq = np.empty((t_rows, levels, k), np.int8)
    dx = np.empty((t_rows, levels, n_blocks), np.float32)
    sx = np.empty((t_rows, levels, n_blocks), np.int32)
    if t_rows == 1:  # no parallel region for one row
        quantize_row(x[0], per, xq[0], dx[0], sx[0])
    else:
        for t in nb.prange(t_rows):
            quantize_row(x[t], per, xq[t], dx[t], sx[t])
    return xq, dx, sx


@nb.njit(**KERNEL)
def _runs(starts: np.ndarray, n_groups: int) -> np.ndarray:
    """RUNS + 1 bounds that cut the items (expert i's groups, expert after expert) into runs of
    about equal cost, an item ``ITEM_COST`` plus its expert's rows (none where it has none)."""
    n_exp = starts.shape[0] - 1
    cost = np.zeros(n_exp, np.int64)  # of one of expert i's items
    for i in range(n_exp):
        rows = starts[i + 1] - starts[i]
        cost[i] = rows + ITEM_COST if rows > 0 else 0
    total = n_groups * cost.sum()
    bounds = np.full(RUNS + 1, n_exp * n_groups, np.int64)
    bounds[0] = 0
    r, done = 1, 0
    for i in range(n_exp):
        for g in range(n_groups):
            done += cost[i]
            while r < RUNS and done * RUNS >= r * total:
                bounds[r] = i * n_groups + g + 1
                r += 1
    return bounds


@nb.njit(parallel=True, **KERNEL)
def int8_matmul_slots(xq: np.ndarray, dx: np.ndarray, sx: np.ndarray, w: Weight, n_slots: int,
                      slots: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
    """``out[a:b] = x[a:b] @ slot(w, slots[i]).T`` for ``a, b = starts[i], starts[i + 1]``, the
    rows ``x`` given quantized (``quantize_rows``): a step's experts, each on the rows routed to
    it, in one parallel region whose work item is a group of one expert's rows. Expert by expert,
    a decode token's top-k made 2k regions a layer, each a barrier of two threads over a ~1 MB
    matrix. The items go expert-major, cut into RUNS runs of equal cost (``_runs``) that the
    threads take in order: each thread reads its experts' weights front to back, and the threads'
    shares are even whatever the routing's skew. Expert-major in equal runs of items, one thread
    took the busiest experts of a prompt's skewed routing (group-major items then were 15% faster
    on a real prefill's gate/up products); group-major, each thread jumped to another expert's
    weights every group, and decode rows ran 20-25% slower (docs/performance.md). The rows are at
    ``EXPERT_LEVELS``; a row's result takes the same steps whatever the other rows and experts."""
    assert xq.shape[1] == EXPERT_LEVELS  # the loops below are compiled for that many
    n_groups = w.q.shape[0] // n_slots
    bounds = _runs(starts, n_groups)
    xs = offset_terms(dx, sx)
    for run in nb.prange(RUNS):
        for item in range(bounds[run], bounds[run + 1]):
            i = item // n_groups
            g = item - i * n_groups
            a, b = starts[i], starts[i + 1]
            if b > a:
                v = slot(w, slots[i], n_slots)
                if v.dh.size:
                    _group(v, g, xq[a:b], dx[a:b], sx[a:b], xs[a:b], out[a:b], v.dh, v.mh, EXPERT_LEVELS == 2)
                else:
                    _group(v, g, xq[a:b], dx[a:b], sx[a:b], xs[a:b], out[a:b], v.d, v.m, EXPERT_LEVELS == 2)
