"""A MoE layer's router: how each row's scores become its top-k experts and their weights.

The gating styles (llama.cpp's ``expert_gating_func``; see ``docs/architecture.md``):

- softmax (mixtral, qwen2moe, qwen3moe, olmoe, deepseek2 V2): ``p = softmax(router · h)`` over all
  experts, the k best, their weights ``p``, renormalised to sum 1 or not (``norm``).
- sigmoid (glm4moe, deepseek2 V3): ``s = sigmoid(router · h)``; the experts are *chosen* by
  ``s + bias`` (the score-correction bias ``exp_probs_b``), optionally within the ``topk_group``
  best of ``n_group`` groups (a group ranked by the sum of its two best corrected scores), and
  *weighted* by the uncorrected ``s``, renormalised, then multiplied by the routed scaling factor.
- softmax of the chosen (gpt-oss): the k best logits (the router has a bias), their weights the
  softmax over those k alone.

Every row is routed on its own (``router_logits`` computes each logit alone, no BLAS), so a row's
experts never depend on the other rows of the step. ``by_expert`` groups a step's (row, rank) pairs
by expert, for the experts' batched application (``moe.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.ops import add_bias
from colibri.store.gguf import GGUFError, GGUFFile

# llama.cpp's expert_gating_func values
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3

_JIT = dict(nogil=True, cache=True)
_JIT_FAST = dict(nogil=True, cache=True, fastmath=True)


class Routing(NamedTuple):
    """How a layer's router turns scores into (expert, weight) pairs."""

    gating: int  # GATING_SOFTMAX, GATING_SIGMOID or GATING_SOFTMAX_WEIGHT
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
def _softmax_k(w: np.ndarray) -> None:
    """The chosen experts' logits, best first, as their softmax (gpt-oss's weights)."""
    total = np.float32(0.0)
    peak = w[0]
    for r in range(w.shape[0]):
        w[r] = np.exp(w[r] - peak)
        total += w[r]
    for r in range(w.shape[0]):
        w[r] /= total


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
        elif rule.gating == GATING_SOFTMAX_WEIGHT:  # chosen by logit: softmax's order
            probs[:] = row
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
        if rule.gating == GATING_SOFTMAX_WEIGHT:
            _softmax_k(weights[t, : rule.k])
        elif rule.norm:
            total = max(total, np.float32(6.103515625e-5))  # llama.cpp's clamp (F16's smallest normal)
            for r in range(rule.k):
                weights[t, r] /= total
        if rule.scale != 0.0 and rule.scale != 1.0:
            for r in range(rule.k):
                weights[t, r] *= np.float32(rule.scale)


@nb.njit(**_JIT)
def route_rows(h: np.ndarray, router: np.ndarray, router_bias: np.ndarray, bias: np.ndarray, rule: Routing,
               ids: np.ndarray, weights: np.ndarray) -> None:
    """``router_logits`` (plus ``router_bias`` where not empty: gpt-oss's) then ``route``: one
    compiled call a layer, not two and an allocation."""
    logits = np.empty((h.shape[0], router.shape[0]), np.float32)
    router_logits(h, router, logits)
    if router_bias.shape[0] > 0:
        add_bias(logits, router_bias)
    route(logits, bias, rule, ids, weights)



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
