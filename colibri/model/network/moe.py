"""The mixture-of-experts feed-forward: routing, batched expert application, shared experts.

A MoE layer replaces the dense FFN by ``n_expert`` small SwiGLU FFNs (the routed experts) and a
router ``ffn_gate_inp`` that scores them for each token. Each token (row) goes through its top-k
experts and sums their outputs, weighted. The gating styles (see ``docs/architecture.md``):

- softmax (mixtral, qwen2moe, qwen3moe): ``p = softmax(router · h)`` over all experts, the k best,
  their weights ``p``, renormalised to sum 1 or not (``norm``).
- sigmoid (glm4moe): ``s = sigmoid(router · h)``; the experts are *chosen* by ``s + bias`` (the
  score-correction bias ``exp_probs_b``), optionally within the ``topk_group`` best of ``n_group``
  groups (a group ranked by the sum of its two best corrected scores), and *weighted* by the
  uncorrected ``s``, renormalised, then multiplied by the routed scaling factor.

Batched routing: in a step, each distinct expert is fetched from the ``ExpertStore`` once and
applied once, to all the rows routed to it (gathered, decode rows first so the sub-batch takes the
same decode/prompt split as the step; see ``qmatmul``). Each (row, rank) pair's output lands in its
own row of the pairs' outputs, and a row's outputs are summed in the row's own top-k rank order
afterwards: the rounding of the sum depends on the row alone, never on which other rows are in the
step or in what order the experts ran.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.int8_matmul import EXPERT_LEVELS, int8_matmul_slots, quantize_row, quantize_rows
from colibri.model.kernels.ops import add_into, swiglu
from colibri.model.network.layers import FFN, load_ffn, swiglu_ffn
from colibri.model.network.weights import load_matrix, optional_vector
from colibri.store.experts import HEAT_DECAY, ExpertStore, ExpertWeights, note_routing
from colibri.store.gguf import GGUFError, GGUFFile
from colibri.store.packed import EMPTY_WEIGHT, KIND_Q4, KIND_Q5, KIND_Q6, KIND_Q8, slot

GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
_SLOT_0 = np.zeros(1, np.int64)  # an expert handed out alone is slot 0 of a pool of one
_NO_SHARED = FFN(EMPTY_WEIGHT, EMPTY_WEIGHT)
_DECAY = np.float32(HEAT_DECAY)

_JIT = dict(nogil=True, cache=True)
_JIT_FAST = dict(nogil=True, cache=True, fastmath=True)

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


class Routing(NamedTuple):
    """How a layer's router turns scores into (expert, weight) pairs."""

    gating: int  # GATING_SOFTMAX or GATING_SIGMOID
    k: int  # experts per token
    norm: bool  # renormalise the k weights to sum 1
    scale: float  # multiply the weights by this (0 or 1: no scaling)
    n_group: int  # grouped selection when > 1 (glm4moe, deepseek)
    topk_group: int  # groups kept


def routing(hp: HParams, gating: int, norm: bool) -> Routing:
    """The rule of a model: the architecture's gating and renormalisation unless the file says
    otherwise (``expert_gating_func``, ``expert_weights_norm``), and the file's k, scale, groups."""
    return Routing(
        gating=hp.expert_gating_func or gating,
        k=hp.n_expert_used,
        norm=norm if hp.expert_weights_norm is None else hp.expert_weights_norm,
        scale=hp.expert_weights_scale,
        n_group=hp.n_expert_groups,
        topk_group=hp.n_group_used,
    )


# -- routing ---------------------------------------------------------------------------------------


@nb.njit(parallel=True, **_JIT_FAST)
def router_logits(h: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``out[t, e] = w[e] · h[t]``, each logit on its own (no BLAS: a row's logits do not depend
    on how many rows the step has). A work item is one logit, so that a decode token's router is
    read by both threads, not one."""
    n_exp = w.shape[0]
    for item in nb.prange(h.shape[0] * n_exp):
        t = item // n_exp
        e = item - t * n_exp
        we, ht = w[e], h[t]
        acc = np.float32(0.0)
        for i in range(w.shape[1]):
            acc += we[i] * ht[i]
        out[t, e] = acc


@nb.njit(**_JIT)
def _top_k(scores: np.ndarray, allowed: np.ndarray, k: int, ids: np.ndarray) -> None:
    """The k best allowed scores, best first (ties: the lower expert id first)."""
    taken = ~allowed
    for r in range(k):
        best = -1
        for e in range(scores.shape[0]):
            if not taken[e] and (best < 0 or scores[e] > scores[best]):
                best = e
        ids[r] = best
        taken[best] = True


@nb.njit(**_JIT)
def route(logits: np.ndarray, bias: np.ndarray, rule: Routing, ids: np.ndarray, weights: np.ndarray) -> None:
    """Experts ``ids[t, :k]`` (best first) and weights ``weights[t, :k]`` of every row."""
    n_exp = logits.shape[1]
    probs = np.empty(n_exp, np.float32)
    select = np.empty(n_exp, np.float32)
    allowed = np.ones(n_exp, np.bool_)
    per_group = n_exp // max(rule.n_group, 1)
    group_score = np.empty(max(rule.n_group, 1), np.float32)
    group_ids = np.empty(max(rule.topk_group, 1), np.int64)
    for t in range(logits.shape[0]):
        row = logits[t]
        if rule.gating == GATING_SIGMOID:
            for e in range(n_exp):
                probs[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-row[e]))
        else:
            peak = row.max()
            total = np.float32(0.0)
            for e in range(n_exp):
                probs[e] = np.exp(row[e] - peak)
                total += probs[e]
            for e in range(n_exp):
                probs[e] /= total
        # The selection scores: the weights' scores plus the selection-only bias.
        for e in range(n_exp):
            select[e] = probs[e] + bias[e] if bias.shape[0] > 0 else probs[e]
        allowed[:] = True
        if rule.n_group > 1:
            for g in range(rule.n_group):
                first = second = -np.inf
                for e in range(g * per_group, (g + 1) * per_group):
                    s = select[e]
                    if s > first:
                        first, second = s, first
                    elif s > second:
                        second = s
                group_score[g] = first + second if per_group > 1 else first
            _top_k(group_score, np.ones(rule.n_group, np.bool_), rule.topk_group, group_ids)
            allowed[:] = False
            for gi in range(rule.topk_group):
                g = group_ids[gi]
                allowed[g * per_group : (g + 1) * per_group] = True
        _top_k(select, allowed, rule.k, ids[t])
        total = np.float32(0.0)
        for r in range(rule.k):
            weights[t, r] = probs[ids[t, r]]
            total += weights[t, r]
        if rule.norm:
            total = max(total, np.float32(6.103515625e-5))  # llama.cpp's clamp (F16's smallest normal)
            for r in range(rule.k):
                weights[t, r] /= total
        if rule.scale != 0.0 and rule.scale != 1.0:
            for r in range(rule.k):
                weights[t, r] *= np.float32(rule.scale)


@nb.njit(**_JIT)
def route_rows(h: np.ndarray, router: np.ndarray, bias: np.ndarray, rule: Routing, ids: np.ndarray,
               weights: np.ndarray) -> None:
    """``router_logits`` then ``route``: one compiled call a layer, not two and an allocation."""
    logits = np.empty((h.shape[0], router.shape[0]), np.float32)
    router_logits(h, router, logits)
    route(logits, bias, rule, ids, weights)


@nb.njit(**_JIT)
def by_expert(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Group the (row, rank) pairs by expert: ``experts`` (the distinct ones, ascending), and for
    the i-th, its pairs ``starts[i]:starts[i+1]``, their rows ``rows[...]`` ascending (so the
    step's decode rows, which come first, come first in every expert's sub-batch); ``pair[t, r]``
    is the pair of row t's rank r."""
    t_rows, k = ids.shape
    count = np.zeros(n_expert + 1, np.int64)
    for t in range(t_rows):
        for r in range(k):
            count[ids[t, r] + 1] += 1
    n_distinct = 0
    for e in range(n_expert):
        if count[e + 1] > 0:
            n_distinct += 1
        count[e + 1] += count[e]  # now count[e] = first slot of expert e
    experts = np.empty(n_distinct, np.int64)
    starts = np.empty(n_distinct + 1, np.int64)
    i = 0
    for e in range(n_expert):
        if count[e + 1] > count[e]:
            experts[i] = e
            starts[i] = count[e]
            i += 1
    starts[n_distinct] = t_rows * k
    fill = count[:n_expert].copy()
    rows = np.empty(t_rows * k, np.int64)
    pair = np.empty((t_rows, k), np.int64)
    for t in range(t_rows):
        for r in range(k):
            e = ids[t, r]
            rows[fill[e]] = t
            pair[t, r] = fill[e]
            fill[e] += 1
    return experts, starts, rows, pair


# -- applying experts ------------------------------------------------------------------------------


@nb.njit(**_JIT)
def _gather(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``x[rows]`` (numba's fancy indexing makes no contiguous copy of several dimensions)."""
    out = np.empty((rows.shape[0], *x.shape[1:]), x.dtype)
    for j in range(rows.shape[0]):
        out[j] = x[rows[j]]
    return out


@nb.njit(**_JIT)
def _quantized_pairs(h: np.ndarray, d_rows: np.ndarray, per: int) -> tuple[np.ndarray, ...]:
    """``quantize_rows(h[d_rows])``: each distinct row quantized once (a row's quants depend on the
    row alone), then copied per pair; an expert applied alone quantizes its own rows only."""
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
    return _gather(xq, pair_u), _gather(dx, pair_u), _gather(sx, pair_u)


@nb.njit(parallel=True, **_JIT)
def _swiglu_quantized(gu: np.ndarray, n_ff: int, per: int) -> tuple[np.ndarray, ...]:
    """``quantize_rows(swiglu(gate, up), per, EXPERT_LEVELS)`` of rows ``[gate | up]``, the gate
    halves overwritten: both steps a row at a time in one parallel region (serial, the SwiGLU of a
    prompt's pairs took 0.11 s of a 2.5 s qwen3moe prefill)."""
    t_rows = gu.shape[0]
    xq = np.empty((t_rows, EXPERT_LEVELS, n_ff), np.int8)
    dx = np.empty((t_rows, EXPERT_LEVELS, n_ff // per), np.float32)
    sx = np.empty((t_rows, EXPERT_LEVELS, n_ff // per), np.int32)
    if t_rows == 1:  # no parallel region for one row (an expert applied alone to a decode row)
        _swiglu_quantized_row(gu, 0, n_ff, per, xq, dx, sx)
    else:
        for t in nb.prange(t_rows):
            _swiglu_quantized_row(gu, t, n_ff, per, xq, dx, sx)
    return xq, dx, sx


@nb.njit(**_JIT)
def _swiglu_quantized_row(gu: np.ndarray, t: int, n_ff: int, per: int, xq: np.ndarray, dx: np.ndarray,
                          sx: np.ndarray) -> None:
    row = gu[t : t + 1]
    swiglu(row[:, :n_ff], row[:, n_ff:])
    quantize_row(gu[t, :n_ff], per, xq[t], dx[t], sx[t])


@nb.njit(**_JIT)
def _int8_experts(xq: np.ndarray, dx: np.ndarray, sx: np.ndarray, pool: ExpertWeights, n_slots: int,
                  slots: np.ndarray, starts: np.ndarray, y: np.ndarray) -> None:
    """Expert i's SwiGLU FFN on rows ``starts[i]:starts[i + 1]`` into ``y``'s, given quantized
    (``EXPERT_LEVELS``): ``int8_matmul_slots`` for both matrices, every expert in one parallel
    region each."""
    up, down = pool.gate_up, pool.down
    n_ff = up.n_rows // n_slots // 2
    gu = np.empty((xq.shape[0], 2 * n_ff), np.float32)
    int8_matmul_slots(xq, dx, sx, up, n_slots, slots, starts, gu)
    xq, dx, sx = _swiglu_quantized(gu, n_ff, n_ff // down.q.shape[1])
    int8_matmul_slots(xq, dx, sx, down, n_slots, slots, starts, y)


@nb.njit(**_JIT)
def apply_experts(
    h: np.ndarray, n_direct: int, pool: ExpertWeights, n_slots: int, slots: np.ndarray,
    starts: np.ndarray, rows: np.ndarray, y: np.ndarray,
) -> None:
    """Expert i, slot ``slots[i]`` of the ``n_slots`` stacked in ``pool`` (``packed.slot``; an
    expert alone is slot 0 of 1), on its pairs: ``y[j] = expert_i(h[rows[j]])`` for j in
    ``starts[i]:starts[i + 1]``. Packed Q4/Q5/Q6/Q8 experts take every pair at once,
    decode and prompt rows alike, one parallel region per matrix for all the experts
    (``_int8_experts``; ``int8_matmul_slots`` splits each expert's groups evenly between the
    threads): expert by expert, a prompt's experts took four regions each, and the whole was 7-8%
    slower on a real prefill's skewed routing (docs/performance.md). The other kinds go expert by
    expert through ``swiglu_ffn``, as in a dense layer (rows ascending: decode rows, those below
    ``n_direct``, first)."""
    if _int8_ffn(pool):
        lo, hi = starts[0], starts[-1]
        xq, dx, sx = _quantized_pairs(h, rows[lo:hi], _block_values(pool, h))
        _int8_experts(xq, dx, sx, pool, n_slots, slots, starts - lo, y[lo:hi])
        return
    for i in range(slots.shape[0]):
        a, b = starts[i], starts[i + 1]
        if b == a:
            continue
        sub_direct = 0
        for j in range(a, b):
            if rows[j] < n_direct:
                sub_direct += 1
        w = slot(pool.gate_up, slots[i], n_slots), slot(pool.down, slots[i], n_slots)
        swiglu_ffn(_gather(h, rows[a:b]), w[0], w[1], sub_direct, y[a:b])


@nb.njit(**_JIT)
def _combine_row(y: np.ndarray, pair: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        acc = weights[0] * y[pair[0], i]
        for r in range(1, pair.shape[0]):
            acc += weights[r] * y[pair[r], i]
        out[i] = acc


@nb.njit(parallel=True, **_JIT)
def combine(y: np.ndarray, pair: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """``out[t] = sum_r weights[t, r] * y[pair[t, r]]``, summed in rank order; a prompt's rows in
    one parallel region (a decode row alone needs none)."""
    if out.shape[0] == 1:
        _combine_row(y, pair[0], weights[0], out[0])
        return
    for t in nb.prange(out.shape[0]):
        _combine_row(y, pair[t], weights[t], out[t])


@nb.njit(**_JIT)
def add_shared_expert(h: np.ndarray, f: FFN, gate: np.ndarray, n_direct: int, out: np.ndarray) -> None:
    """``out += g * shared(h)``, with ``g = sigmoid(gate · h)`` per row when ``gate`` is not empty
    (qwen2moe), 1 otherwise (glm4moe). Packed Q4/Q5/Q6/Q8, it is computed as the routed experts
    are, at their one level: a dense FFN's two levels made glm4moe's shared expert (an expert on
    every row) a quarter of its routed experts' dot products, for an eighth of their weights."""
    y = np.empty_like(out)
    if _int8_ffn(f):
        xq, dx, sx = quantize_rows(h, _block_values(f, h), EXPERT_LEVELS)
        _int8_experts(xq, dx, sx, f, 1, _SLOT_0, np.array([0, h.shape[0]], np.int64), y)
    else:
        swiglu_ffn(h, f.gate_up, f.down, n_direct, y)
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
    decay: np.float32, out: np.ndarray,
) -> int:
    """A MoE layer's whole FFN when its experts are resident and stacked (``ExpertStore.
    resident_layer``), in one compiled call: routing, the heat and HITS of the experts used,
    the experts, their sum and the shared expert (none: ``_NO_SHARED``). Returns how many distinct
    experts it applied. Between parallel regions there is no Python: OpenMP's threads spin
    through the gaps instead of falling asleep and waiting on a wake-up (docs/performance.md)."""
    t_rows, k = h.shape[0], rule.k
    ids = np.empty((t_rows, k), np.int64)
    weights = np.empty((t_rows, k), np.float32)
    route_rows(h, router, bias, rule, ids, weights)
    experts, starts, rows, pair = by_expert(ids, router.shape[0])
    note_routing(heat, hits, experts, decay)
    y = np.empty((t_rows * k, h.shape[1]), np.float32)
    apply_experts(h, n_direct, pool, router.shape[0], experts, starts, rows, y)
    combine(y, pair, weights, out)
    if shared.down.n_rows > 0:
        add_shared_expert(h, shared, shared_gate, n_direct, out)
    return experts.shape[0]


class MoEFFN:
    """A layer's expert feed-forward: router, routing rule, the experts (through the store) and
    the optional shared expert. ``__call__`` is the whole FFN of a MoE layer."""

    def __init__(
        self, layer: int, router: np.ndarray, bias: np.ndarray, rule: Routing, store: ExpertStore,
        shared: FFN | None = None, shared_gate: np.ndarray | None = None, predictable: bool = True,
    ) -> None:
        """``predictable``: the layer before may guess its experts by its router (``predict``)."""
        self.layer, self.router, self.bias, self.rule, self.store = layer, router, bias, rule, store
        self.shared = shared
        self.shared_gate = shared_gate if shared_gate is not None else np.zeros(0, np.float32)
        if predictable:
            store.register_predictor(layer, self.predict)

    def select(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's experts ``ids[t, :k]`` (best first) and their weights."""
        ids = np.empty((h.shape[0], self.rule.k), np.int64)
        weights = np.empty((h.shape[0], self.rule.k), np.float32)
        route_rows(h, self.router, self.bias, self.rule, ids, weights)
        return ids, weights

    def predict(self, h: np.ndarray) -> np.ndarray:
        """The distinct experts this layer would route the rows of ``h`` to: applied to the
        previous layer's input, a guess good enough to read the experts ahead."""
        return np.unique(self.select(h)[0])

    def __call__(self, h: np.ndarray, n_direct: int) -> np.ndarray:
        """The FFN output for every row of ``h`` (the normed hidden state)."""
        out = np.empty_like(h)
        resident = self.store.resident_layer(self.layer)
        if resident is not None:
            start = time.perf_counter()
            used = resident_ffn(h, n_direct, self.router, self.bias, self.rule, resident.pool,
                                self.shared or _NO_SHARED, self.shared_gate, resident.heat, resident.hits,
                                _DECAY, out)
            self.store.note_compute(time.perf_counter() - start)
            self.store.note_resident_use(used)
            return out
        t_rows, k = h.shape[0], self.rule.k
        ids, weights = self.select(h)
        experts, starts, rows, pair = by_expert(ids, self.router.shape[0])
        self.store.note_routing(self.layer, experts)
        self.store.prefetch_next(self.layer, h)  # the next MoE layer's likely experts, read ahead
        y = np.empty((t_rows * k, h.shape[1]), np.float32)
        for i, e in enumerate(experts.tolist()):
            weights_e = self.store.get(self.layer, e)
            start = time.perf_counter()
            apply_experts(h, n_direct, weights_e, 1, _SLOT_0, starts[i : i + 2], rows, y)
            self.store.note_compute(time.perf_counter() - start)
        combine(y, pair, weights, out)
        if self.shared is not None:
            add_shared_expert(h, self.shared, self.shared_gate, n_direct, out)
        return out


def load_moe_ffn(gguf: GGUFFile, layer: int, rule: Routing, store: ExpertStore,
                 predictable: bool = True) -> MoEFFN:
    """Layer ``layer``'s router (``ffn_gate_inp``), selection bias (``exp_probs_b``) and shared
    expert (``ffn_*_shexp``, gated by ``ffn_gate_inp_shexp``) where the file has them."""
    p = f"blk.{layer}."
    if layer not in store.layers:
        raise GGUFError(f"{gguf.path}: layer {layer} has a router but no 3-D expert tensors "
                        f"({p}ffn_{{gate,up,down}}_exps.weight; per-expert tensors are not supported)")
    shared = load_ffn(gguf, p, "_shexp") if p + "ffn_down_shexp.weight" in gguf.tensors else None
    router, bias = load_matrix(gguf, p + "ffn_gate_inp.weight"), optional_vector(gguf, p + "exp_probs_b.bias")
    check_routing(gguf, layer, rule, router, bias, store.n_experts)
    shared_gate = optional_vector(gguf, p + "ffn_gate_inp_shexp.weight")
    return MoEFFN(layer, router, bias, rule, store, shared, shared_gate, predictable)


def check_routing(gguf: GGUFFile, layer: int, rule: Routing, router: np.ndarray, bias: np.ndarray,
                  n_expert: int) -> None:
    """The kernels index by these numbers without bounds checks: a file whose routing metadata
    cannot work is refused at load, with the reason, rather than giving garbage or a crash."""
    where = f"{gguf.path}: layer {layer}:"
    if router.shape[0] != n_expert:
        raise GGUFError(f"{where} the router has {router.shape[0]} rows for {n_expert} experts")
    if bias.shape[0] not in (0, n_expert):
        raise GGUFError(f"{where} exp_probs_b has {bias.shape[0]} values for {n_expert} experts")
    if not 1 <= rule.k <= n_expert:
        raise GGUFError(f"{where} expert_used_count {rule.k} is not within 1..{n_expert}")
    if rule.n_group > 1:
        if n_expert % rule.n_group or not 1 <= rule.topk_group <= rule.n_group:
            raise GGUFError(f"{where} {rule.n_group} expert groups (keeping {rule.topk_group}) "
                            f"do not divide {n_expert} experts")
        if rule.k > rule.topk_group * (n_expert // rule.n_group):
            raise GGUFError(f"{where} top-{rule.k} cannot be taken from {rule.topk_group} groups of "
                            f"{n_expert // rule.n_group}")
