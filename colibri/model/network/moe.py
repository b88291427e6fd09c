"""The mixture-of-experts feed-forward: batched expert application, shared experts.

A MoE layer replaces the dense FFN by ``n_expert`` small SwiGLU FFNs (the routed experts) and a
router ``ffn_gate_inp`` that scores them for each token (``routing.py``). Each token (row) goes
through its top-k experts and sums their outputs, weighted. gpt-oss's experts add biases and a
clamped SwiGLU (``ExpertExtras``).

Batched routing: in a step, each distinct expert is fetched from the ``ExpertStore`` once and
applied once, to all the rows routed to it (gathered, decode rows first so the sub-batch takes the
same decode/prompt split as the step; see ``qmatmul``). Each (row, rank) pair's output lands in its
own row of the pairs' outputs, and a row's outputs are summed in the order of its experts' ids
(``sum_pairs``), whatever runs of experts computed them: the rounding of the sum depends on the row
alone, never on which other rows are in the step, nor on the budget that kept its experts resident
or streamed them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.model.kernels.int8_matmul import (
    EXPERT_LEVELS,
    RUNS,
    int8_matmul_slots,
    quantize_row,
    quantize_rows,
)
from colibri.model.kernels.ops import (
    SwiGLUScratch,
    add_bias,
    add_into,
    swiglu_clamped,
    swiglu_row,
    swiglu_scratch,
)
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.network.entry import Entry
from colibri.model.network.layers import FFN, load_ffn, swiglu_ffn
from colibri.model.network.routing import Routing, by_expert, check_routing, route_rows
from colibri.model.network.weights import load_matrix, optional_vector
from colibri.store.experts import HEAT_DECAY, ExpertStore, ExpertWeights, note_routing
from colibri.store.gguf import GGUFError, GGUFFile
from colibri.store.packed import EMPTY_WEIGHT, KIND_Q4, KIND_Q5, KIND_Q6, KIND_Q8, slot

_SLOT_0 = np.zeros(1, np.int64)  # an expert handed out alone is slot 0 of a pool of one
_NO_SHARED = FFN(EMPTY_WEIGHT, EMPTY_WEIGHT)
_DECAY = np.float32(HEAT_DECAY)

_JIT = dict(nogil=True, cache=True)
# A step's routed pairs go through the experts' two products in runs of whole experts, at most
# PAIRS_PER_CALL pairs a run (an expert with more is a run of its own): the float gate/up rows
# (2 n_ff floats a pair, 6 KB on a 768-wide expert) and the quantized inputs are a run's, not the
# step's: a 512-token step of a top-8 qwen3moe layer held 4,096 pairs' worth, 29 MB, where a
# 128-token step's 1,024 fit in 7. Each expert's weights are still read once a step.
PAIRS_PER_CALL = 1024


class ExpertExtras(NamedTuple):
    """What gpt-oss's experts add to the others': a bias on the router's logits, each expert's
    biases (its gate's then its up's, as its stacked rows; its down's), and the clamped SwiGLU
    (``ops.swiglu_clamped``). Empty arrays and ``limit`` 0 for every other family: one type, one
    compiled variant."""

    router_bias: np.ndarray  # [n_expert], or empty
    gate_up_bias: np.ndarray  # [n_expert, 2 n_ff], or [0, 0]
    down_bias: np.ndarray  # [n_expert, n_embd], or [0, 0]
    alpha: float  # the clamped SwiGLU's sigmoid gain
    limit: float  # its clamp; 0: the plain SwiGLU


NO_EXTRAS = ExpertExtras(np.zeros(0, np.float32), np.zeros((0, 0), np.float32), np.zeros((0, 0), np.float32),
                         0.0, 0.0)

# The packed kinds whose experts take integer dot products (``int8_matmul_slots``).
_INT8_KINDS = (KIND_Q4, KIND_Q5, KIND_Q6, KIND_Q8)


@nb.njit(**_JIT)
def _int8_ffn(f: FFN) -> bool:
    """Whether both matrices of a SwiGLU FFN take integer dot products."""
    return f.gate_up.kind in _INT8_KINDS and f.down.kind in _INT8_KINDS


@nb.njit(**_JIT)
def _block_values(f: FFN, h: np.ndarray) -> int:
    """Values per weight block of ``f``'s gate/up, which its rows are quantized by: 32, or Q6's 16."""
    return h.shape[1] // f.gate_up.q.shape[1]


# -- applying experts ------------------------------------------------------------------------------


@nb.njit(**_JIT)
def _gather(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``x[rows]`` of a C-contiguous ``x``, each row copied as a flat run (numba's fancy indexing
    makes no contiguous copy of several dimensions, and its subarray assignment took 20x as long
    for a prompt's quantized pairs)."""
    out = np.empty((rows.shape[0], *x.shape[1:]), x.dtype)
    src, dst = x.reshape(x.shape[0], -1), out.reshape(rows.shape[0], -1)
    for j in range(rows.shape[0]):
        a, b = src[rows[j]], dst[j]
        for i in range(src.shape[1]):
            b[i] = a[i]
    return out


@nb.njit(**_JIT)
def _quantized_rows(h: np.ndarray, d_rows: np.ndarray, per: int) -> tuple[np.ndarray, ...]:
    """The distinct rows of ``h[d_rows]`` quantized once each (a row's quants depend on the row
    alone), and for each pair its row's index among them: ``_gather`` makes the pairs' inputs."""
    unique = np.full(h.shape[0], -1, np.int64)
    n_u = 0
    for j in range(d_rows.shape[0]):
        if unique[d_rows[j]] < 0:
            unique[d_rows[j]] = n_u
            n_u += 1
    u_rows = np.empty(n_u, np.int64)
    for r in range(h.shape[0]):
        if unique[r] >= 0:
            u_rows[unique[r]] = r
    pair_u = np.empty(d_rows.shape[0], np.int64)
    for j in range(d_rows.shape[0]):
        pair_u[j] = unique[d_rows[j]]
    xq, dx, sx = quantize_rows(_gather(h, u_rows), per, EXPERT_LEVELS)
    return xq, dx, sx, pair_u


@nb.njit(parallel=True, **_JIT)
def _swiglu_quantized(gu: np.ndarray, n_ff: int, per: int, ex: ExpertExtras) -> tuple[np.ndarray, ...]:
    """``quantize_rows(swiglu(gate, up), per, EXPERT_LEVELS)`` of rows ``[gate | up]``, the gate
    halves overwritten: both steps a row at a time in one parallel region (serial, the SwiGLU of a
    prompt's pairs took 0.11 s of a 2.5 s qwen3moe prefill), the SwiGLU's scratch allocated once per
    run of rows."""
    t_rows = gu.shape[0]
    xq = np.empty((t_rows, EXPERT_LEVELS, n_ff), np.int8)
    dx = np.empty((t_rows, EXPERT_LEVELS, n_ff // per), np.float32)
    sx = np.empty((t_rows, EXPERT_LEVELS, n_ff // per), np.int32)
    if t_rows == 1:  # no parallel region for one row (an expert applied alone to a decode row)
        _swiglu_quantized_rows(gu, np.int64(0), np.int64(1), n_ff, per, xq, dx, sx, ex)
    else:
        n_runs = min(t_rows, RUNS)
        for run in nb.prange(n_runs):
            _swiglu_quantized_rows(gu, run * t_rows // n_runs, (run + 1) * t_rows // n_runs, n_ff, per,
                                   xq, dx, sx, ex)
    return xq, dx, sx


@nb.njit(**_JIT)
def _activate(gate: np.ndarray, up: np.ndarray, ex: ExpertExtras, scratch: SwiGLUScratch) -> None:
    """``gate = swiglu(gate, up)`` for rows as wide as ``scratch``, clamped as gpt-oss's where
    ``ex.limit`` is set."""
    if ex.limit > 0.0:
        swiglu_clamped(gate, up, ex.alpha, ex.limit)
    else:
        for t in range(gate.shape[0]):
            swiglu_row(gate[t], up[t], scratch)


@nb.njit(**_JIT)
def _swiglu_quantized_rows(gu: np.ndarray, start: int, stop: int, n_ff: int, per: int, xq: np.ndarray,
                           dx: np.ndarray, sx: np.ndarray, ex: ExpertExtras) -> None:
    scratch = swiglu_scratch(n_ff)
    for t in range(start, stop):
        row = gu[t : t + 1]
        _activate(row[:, :n_ff], row[:, n_ff:], ex, scratch)
        quantize_row(gu[t, :n_ff], per, xq[t], dx[t], sx[t])


@nb.njit(**_JIT)
def _add_expert_bias(y: np.ndarray, bias: np.ndarray, ids: np.ndarray, starts: np.ndarray) -> None:
    """Rows ``starts[i]:starts[i + 1]`` of ``y`` += expert ``ids[i]``'s bias (none: ``bias`` empty)."""
    if bias.shape[0] == 0:
        return
    for i in range(ids.shape[0]):
        add_bias(y[starts[i] : starts[i + 1]], bias[ids[i]])


@nb.njit(**_JIT)
def _int8_experts(xq: np.ndarray, dx: np.ndarray, sx: np.ndarray, pool: ExpertWeights, n_slots: int,
                  slots: np.ndarray, starts: np.ndarray, y: np.ndarray, ids: np.ndarray,
                  ex: ExpertExtras) -> None:
    """Expert i's SwiGLU FFN on rows ``starts[i]:starts[i + 1]`` into ``y``'s, given quantized
    (``EXPERT_LEVELS``): ``int8_matmul_slots`` for both matrices, every expert in one parallel
    region each; ``ids[i]``: expert i's id, whose biases ``ex`` holds."""
    up, down = pool.gate_up, pool.down
    n_ff = up.n_rows // n_slots // 2
    gu = np.empty((xq.shape[0], 2 * n_ff), np.float32)
    int8_matmul_slots(xq, dx, sx, up, n_slots, slots, starts, gu)
    _add_expert_bias(gu, ex.gate_up_bias, ids, starts)
    xq, dx, sx = _swiglu_quantized(gu, n_ff, n_ff // down.q.shape[1], ex)
    int8_matmul_slots(xq, dx, sx, down, n_slots, slots, starts, y)
    _add_expert_bias(y, ex.down_bias, ids, starts)


@nb.njit(**_JIT)
def _int8_run(q: tuple[np.ndarray, np.ndarray, np.ndarray], at: np.ndarray, pool: ExpertWeights,
              n_slots: int, slots: np.ndarray, starts: np.ndarray, y: np.ndarray, ids: np.ndarray,
              ex: ExpertExtras) -> None:
    """Packed experts ``slots`` on their pairs ``starts[0]:starts[-1]``, whose inputs are rows ``at``
    of the quantized rows ``q`` (``_quantized_rows``'), into ``y``'s rows (the run's own)."""
    xq, dx, sx = q
    _int8_experts(_gather(xq, at), _gather(dx, at), _gather(sx, at), pool, n_slots, slots,
                  starts - starts[0], y, ids, ex)


@nb.njit(**_JIT)
def _float_expert(x: np.ndarray, f: FFN, n_direct: int, out: np.ndarray, e: int, ex: ExpertExtras) -> None:
    """An expert of another kind (float, the file's blocks): ``swiglu_ffn``, or with expert
    ``e``'s biases and the clamped SwiGLU where ``ex`` has them."""
    if ex.limit == 0.0 and ex.gate_up_bias.shape[0] == 0:
        swiglu_ffn(x, f.gate_up, f.down, n_direct, out, np.bool_(False))
        return
    n_ff = f.gate_up.n_rows // 2
    gu = np.empty((x.shape[0], 2 * n_ff), np.float32)
    qmatmul(x, f.gate_up, gu, n_direct)
    if ex.gate_up_bias.shape[0] > 0:
        add_bias(gu, ex.gate_up_bias[e])
    _activate(gu[:, :n_ff], gu[:, n_ff:], ex, swiglu_scratch(n_ff))  # views, as the routed rows'
    qmatmul(np.ascontiguousarray(gu[:, :n_ff]), f.down, out, n_direct)
    if ex.down_bias.shape[0] > 0:
        add_bias(out, ex.down_bias[e])


@nb.njit(**_JIT)
def apply_experts(
    h: np.ndarray, n_direct: int, pool: ExpertWeights, n_slots: int, slots: np.ndarray,
    starts: np.ndarray, rows: np.ndarray, y: np.ndarray, ids: np.ndarray, ex: ExpertExtras,
) -> None:
    """Expert i (id ``ids[i]``), slot ``slots[i]`` of the ``n_slots`` stacked in ``pool``
    (``packed.slot``; an expert alone is slot 0 of 1), on its pairs: ``y[j] = expert_i(h[rows[j]])``
    for j in ``starts[i]:starts[i + 1]``. Packed Q4/Q5/Q6/Q8 experts take every pair at once,
    decode and prompt rows alike, one parallel region per matrix for all the experts
    (``_int8_experts``; ``int8_matmul_slots`` splits each expert's groups evenly between the
    threads): expert by expert, a prompt's experts took four regions each, and the whole was 7-8%
    slower on a real prefill's skewed routing (docs/performance.md). The other kinds go expert by
    expert through ``swiglu_ffn``, as in a dense layer (rows ascending: decode rows, those below
    ``n_direct``, first)."""
    if _int8_ffn(pool):
        lo, hi = starts[0], starts[-1]
        xq, dx, sx, at = _quantized_rows(h, rows[lo:hi], _block_values(pool, h))
        _int8_run((xq, dx, sx), at, pool, n_slots, slots, starts, y[lo:hi], ids, ex)
        return
    for i in range(slots.shape[0]):
        a, b = starts[i], starts[i + 1]
        if b == a:
            continue
        sub_direct = np.int64(0)
        for j in range(a, b):
            if rows[j] < n_direct:
                sub_direct += 1
        w = FFN(slot(pool.gate_up, slots[i], n_slots), slot(pool.down, slots[i], n_slots))
        _float_expert(_gather(h, rows[a:b]), w, sub_direct, y[a:b], ids[i], ex)


@nb.njit(**_JIT)
def _sum_row(y: np.ndarray, lo: int, hi: int, pair: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    first, prev = pair.min(), -1
    for _ in range(pair.shape[0]):  # the row's pairs in lo:hi, ascending (k is small: a scan each)
        r_min, p_min = -1, hi
        for r in range(pair.shape[0]):
            if lo <= pair[r] < p_min and pair[r] > prev:
                r_min, p_min = r, pair[r]
        if r_min < 0:
            return
        prev, w, src = p_min, weights[r_min], y[p_min - lo]
        if p_min == first:
            for i in range(out.shape[0]):
                out[i] = w * src[i]
        else:
            for i in range(out.shape[0]):
                out[i] += w * src[i]


@nb.njit(parallel=True, **_JIT)
def sum_pairs(y: np.ndarray, lo: int, hi: int, pair: np.ndarray, weights: np.ndarray,
              out: np.ndarray) -> None:
    """``out[t] += weights[t, r] * y[pair[t, r] - lo]`` for row t's pairs in ``lo:hi`` (``y``'s
    rows), in ascending pair order, its first pair's setting ``out[t]``: called over runs of the
    pairs from the first on, each row is summed in its experts' order (``by_expert``), whatever
    the runs; a prompt's rows in one parallel region (a decode row alone needs none)."""
    if out.shape[0] == 1:
        _sum_row(y, lo, hi, pair[0], weights[0], out[0])
        return
    for t in nb.prange(out.shape[0]):
        _sum_row(y, lo, hi, pair[t], weights[t], out[t])


@nb.njit(**_JIT)
def _resident_experts(h: np.ndarray, n_direct: int, pool: ExpertWeights, n_slots: int, experts: np.ndarray,
                      starts: np.ndarray, rows: np.ndarray, pair: np.ndarray, weights: np.ndarray,
                      out: np.ndarray, ex: ExpertExtras) -> None:
    """A resident layer's experts on their pairs, summed into ``out`` (``sum_pairs``): packed ones
    in runs of whole experts of PAIRS_PER_CALL pairs at most, each run summed before the next is
    computed (its outputs and inputs are the run's); the others at once (``apply_experts``)."""
    if not _int8_ffn(pool):
        y = np.empty((starts[-1], h.shape[1]), np.float32)
        apply_experts(h, n_direct, pool, n_slots, experts, starts, rows, y, experts, ex)
        sum_pairs(y, np.int64(0), starts[-1], pair, weights, out)
        return
    xq, dx, sx, at = _quantized_rows(h, rows, _block_values(pool, h))  # every row once a step
    n, i = experts.shape[0], 0
    while i < n:
        j = i + 1
        while j < n and starts[j + 1] - starts[i] <= PAIRS_PER_CALL:
            j += 1
        y = np.empty((starts[j] - starts[i], h.shape[1]), np.float32)
        _int8_run((xq, dx, sx), at[starts[i] : starts[j]], pool, n_slots, experts[i:j], starts[i : j + 1], y,
                  experts[i:j], ex)
        sum_pairs(y, starts[i], starts[j], pair, weights, out)
        i = j


@nb.njit(**_JIT)
def add_shared_expert(h: np.ndarray, f: FFN, gate: np.ndarray, n_direct: int, out: np.ndarray) -> None:
    """``out += g * shared(h)``, with ``g = sigmoid(gate · h)`` per row when ``gate`` is not empty
    (qwen2moe), 1 otherwise (glm4moe). Packed Q4/Q5/Q6/Q8, it is computed as the routed experts
    are, at their one level: a dense FFN's two levels made glm4moe's shared expert (an expert on
    every row) a quarter of its routed experts' dot products, for an eighth of their weights."""
    y = np.empty_like(out)
    if _int8_ffn(f):
        xq, dx, sx = quantize_rows(h, _block_values(f, h), EXPERT_LEVELS)
        # typed as the routed call's: a literal 1 or a global (read-only) array is another type to
        # numba, and another compile of everything below (150 s cold)
        slot0 = np.zeros(1, np.int64)
        _int8_experts(xq, dx, sx, f, np.int64(1), slot0, np.array([0, h.shape[0]], np.int64), y, slot0,
                      NO_EXTRAS)
    else:
        swiglu_ffn(h, f.gate_up, f.down, n_direct, y, np.bool_(False))
    if gate.shape[0] > 0:
        for t in range(h.shape[0]):
            z = np.float32(0.0)
            for i in range(h.shape[1]):
                z += gate[i] * h[t, i]
            g = np.float32(1.0) / (np.float32(1.0) + np.exp(-z))
            for i in range(y.shape[1]):
                y[t, i] *= g
    add_into(out, y)


@nb.njit(**_JIT)
def resident_ffn(
    h: np.ndarray, n_direct: int, router: np.ndarray, bias: np.ndarray, rule: Routing,
    pool: ExpertWeights, shared: FFN, shared_gate: np.ndarray, heat: np.ndarray, hits: np.ndarray,
    decay: np.float32, out: np.ndarray, ex: ExpertExtras,
) -> int:
    """A MoE layer's whole FFN when its experts are resident and stacked (``ExpertStore.
    resident_layer``), in one compiled call: routing, the heat and HITS of the experts used,
    the experts (with ``ex``'s biases), their sum and the shared expert (none: ``_NO_SHARED``).
    Returns how many distinct experts it applied. Between parallel regions there is no Python:
    OpenMP's threads spin through the gaps instead of falling asleep and waiting on a wake-up
    (docs/performance.md)."""
    t_rows, k = h.shape[0], rule.k
    ids = np.empty((t_rows, k), np.int64)
    weights = np.empty((t_rows, k), np.float32)
    route_rows(h, router, ex.router_bias, bias, rule, ids, weights)
    experts, starts, rows, pair = by_expert(ids, router.shape[0])
    note_routing(heat, hits, experts, decay)
    _resident_experts(h, n_direct, pool, router.shape[0], experts, starts, rows, pair, weights, out, ex)
    if shared.down.n_rows > 0:
        add_shared_expert(h, shared, shared_gate, n_direct, out)
    return experts.shape[0]


class MoEFFN:
    """A layer's expert feed-forward: router, routing rule, the experts (through the store) and
    the optional shared expert. ``__call__`` is the whole FFN of a MoE layer."""

    def __init__(
        self, layer: int, router: np.ndarray, bias: np.ndarray, rule: Routing, store: ExpertStore,
        shared: FFN | None = None, shared_gate: np.ndarray | None = None, predictable: bool = True,
        extras: ExpertExtras = NO_EXTRAS,
    ) -> None:
        """``predictable``: the layer before may guess its experts by its router (``predict``)."""
        self.layer, self.router, self.bias, self.rule, self.store = layer, router, bias, rule, store
        self.extras = extras
        self._bound_pool: ExpertWeights | None = None
        self._resident_ffn: Entry | None = None  # bound at the first resident call
        self.shared = shared
        self.shared_gate = shared_gate if shared_gate is not None else np.zeros(0, np.float32)
        if predictable:
            store.register_predictor(layer, self.predict)

    def select(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's experts ``ids[t, :k]`` (best first) and their weights."""
        ids = np.empty((h.shape[0], self.rule.k), np.int64)
        weights = np.empty((h.shape[0], self.rule.k), np.float32)
        route_rows(h, self.router, self.extras.router_bias, self.bias, self.rule, ids, weights)
        return ids, weights

    def predict(self, h: np.ndarray) -> np.ndarray:
        """The distinct experts this layer would route the rows of ``h`` to: applied to the
        previous layer's input, a guess good enough to read the experts ahead."""
        return np.unique(self.select(h)[0])

    def __call__(self, h: np.ndarray, n_direct: int) -> np.ndarray:
        """The FFN output for every row of ``h`` (the normed hidden state)."""
        h = np.ascontiguousarray(h, np.float32)  # (an entry point reads it as compiled)
        out = np.empty_like(h)
        resident = self.store.resident_layer(self.layer)
        if resident is not None:
            if resident.pool is not self._bound_pool:  # the stack's types, once per stack (``entry.py``)
                self._bound_pool, self._resident_ffn = resident.pool, Entry(resident_ffn)
            start = time.perf_counter()
            used = self._resident_ffn(h, int(n_direct), self.router, self.bias, self.rule, resident.pool,
                                      self.shared or _NO_SHARED, self.shared_gate, resident.heat,
                                      resident.hits, _DECAY, out, self.extras)
            self.store.note_compute(time.perf_counter() - start)
            self.store.note_resident_use(used)
            return out
        t_rows, k = h.shape[0], self.rule.k
        ids, weights = self.select(h)
        experts, starts, rows, pair = by_expert(ids, self.router.shape[0])
        self.store.note_routing(self.layer, experts)
        self.store.queue_reads(self.layer, experts)  # this step's misses asked of the disk together
        self.store.prefetch_next(self.layer, h)  # the next MoE layer's likely experts, read ahead
        y = np.empty((t_rows * k, h.shape[1]), np.float32)
        for i, e in enumerate(experts.tolist()):
            weights_e = self.store.get(self.layer, e)
            start = time.perf_counter()
            apply_experts(h, n_direct, weights_e, 1, _SLOT_0, starts[i : i + 2], rows, y, experts[i : i + 1],
                          self.extras)
            self.store.note_compute(time.perf_counter() - start)
        sum_pairs(y, 0, t_rows * k, pair, weights, out)
        if self.shared is not None:
            add_shared_expert(h, self.shared, self.shared_gate, n_direct, out)
        return out


def load_moe_ffn(gguf: GGUFFile, layer: int, rule: Routing, store: ExpertStore,
                 predictable: bool = True, clamp: tuple[float, float] = (0.0, 0.0)) -> MoEFFN:
    """Layer ``layer``'s router (``ffn_gate_inp``), selection bias (``exp_probs_b``) and shared
    expert (``ffn_*_shexp``, gated by ``ffn_gate_inp_shexp``) where the file has them, and gpt-oss's
    biases (``ExpertExtras``); ``clamp``: the clamped SwiGLU's (alpha, limit), (0, 0) for the plain."""
    p = f"blk.{layer}."
    if layer not in store.layers:
        raise GGUFError(f"{gguf.path}: layer {layer} has a router but no 3-D expert tensors "
                        f"({p}ffn_{{gate,up,down}}_exps.weight; per-expert tensors are not supported)")
    shared = load_ffn(gguf, p, "_shexp") if p + "ffn_down_shexp.weight" in gguf.tensors else None
    router, bias = load_matrix(gguf, p + "ffn_gate_inp.weight"), optional_vector(gguf, p + "exp_probs_b.bias")
    check_routing(gguf, layer, rule, router, bias, store.n_experts)
    shared_gate = optional_vector(gguf, p + "ffn_gate_inp_shexp.weight")
    extras = expert_extras(gguf, p, store.n_experts, router.shape[1], clamp)
    return MoEFFN(layer, router, bias, rule, store, shared, shared_gate, predictable, extras)


def expert_extras(gguf: GGUFFile, p: str, n_expert: int, n_embd: int,
                  clamp: tuple[float, float]) -> ExpertExtras:
    """The router's and the experts' biases of the layer at prefix ``p`` (gate's and up's stacked as
    the experts' rows are), checked against the shapes the kernels index them by."""
    names = [f"{p}ffn_{x}_exps.bias" for x in ("gate", "up", "down")]
    router_bias = optional_vector(gguf, p + "ffn_gate_inp.bias")
    if not any(n in gguf.tensors for n in names) and clamp == (0.0, 0.0) and router_bias.shape[0] == 0:
        return NO_EXTRAS
    if not all(n in gguf.tensors for n in names):
        raise GGUFError(f"{gguf.path}: {p}: expert biases must be given for gate, up and down together")
    gate, up, down = (load_matrix(gguf, n) for n in names)
    n_ff = gguf.tensors[p + "ffn_down_exps.weight"].shape[0]
    if (gate.shape != (n_expert, n_ff) or up.shape != gate.shape or down.shape != (n_expert, n_embd)
            or router_bias.shape[0] not in (0, n_expert)):
        raise GGUFError(f"{gguf.path}: {p}: expert biases of shapes {gate.shape}, {up.shape}, {down.shape} "
                        f"for {n_expert} experts of {n_ff} x {n_embd}")
    return ExpertExtras(router_bias, np.ascontiguousarray(np.concatenate([gate, up], axis=1)), down,
                        float(clamp[0]), float(clamp[1]))
