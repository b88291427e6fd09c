"""Speculative decoding's parts on their own (``colibri/sched/speculation.py``): the
acceptance and its pause, the step cost's fit, the draft length, and the rejection rule, whose
output must be plain decoding's: token for token with the same seed, and in distribution (a small
vocabulary where the joint distribution of two tokens is measured against the exact one)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from colibri import settings
from colibri.errors import ConfigError
from colibri.model.sampling import Sampler, SamplingParams
from colibri.sched import speculation as sp
from colibri.sched.lookup import NgramDrafter
from colibri.sched.speculation import Acceptance, StepCost, draft_length, verify


def test_acceptance_rate_and_its_pause():
    a = Acceptance()
    assert a.rate(0) == 0.5  # the prior
    a.record(4, 4, emitted=5)
    assert a.rate(5) > 0.8
    a.record(8, 2, emitted=8)
    assert 0.5 < a.rate(8) < 0.9
    assert a.rate(8) > a.rate(100) > 0.5  # forgotten as tokens pass
    miss = Acceptance()
    miss.record(1, 0, emitted=1)
    assert miss.rate(1) == pytest.approx(1 / 3) and miss.rate(18) > 0.4  # ~17 tokens later: worth a try
    low = Acceptance()
    for i in range(6):  # 24 proposed tokens, 1 accepted: under 10%
        low.record(4, 1 if i == 0 else 0, emitted=i)
    assert low.paused_until == 5 + sp.PAUSE_TOKENS
    assert low.rate(5) == 0.5  # it starts over from the prior
    fine = Acceptance()
    for i in range(6):
        fine.record(4, 1, emitted=i)  # 25%: no pause
    assert fine.paused_until == 0


def test_step_cost_learns_what_the_rows_cost():
    cost = StepCost()
    assert cost.split() == pytest.approx((1 - sp.ROW_COST_PRIOR, sp.ROW_COST_PRIOR))
    cost.observe(1, 0.5)  # the first steps (cold caches, first calls) are not counted
    cost.observe(3, 0.9)
    for _ in range(200):
        cost.observe(1, 0.005)
    assert cost.split()[1] == pytest.approx(sp.ROW_COST_PRIOR)  # one-row steps tell nothing of rows
    for _ in range(300):  # a row: 0.001 s, a fifth of a one-row step (base 0.004)
        cost.observe(1, 0.005)
        cost.observe(6, 0.010)
    assert cost.split()[1] == pytest.approx(0.2, rel=0.05)
    cost.observe(9, 5.0)  # one step the OS held: bounded
    assert cost.split()[1] < 0.3
    busy = StepCost()
    for _ in range(100):  # sixteen streams, never another count: nothing tells what a row costs
        busy.observe(16, 0.02)
    assert busy.split()[1] == pytest.approx(sp.ROW_COST_PRIOR)
    pairs = StepCost()
    for _ in range(300):  # two streams, sometimes with drafts, rows nearly free (a tiny model)
        pairs.observe(2, 0.0101)
        pairs.observe(7, 0.0106)
    assert pairs.split()[1] < 0.05


def test_draft_length_pays_for_its_rows():
    cheap, dear = (0.6, 0.4), (0.2, 0.8)
    assert draft_length(0.5, 1, cheap, 8) == 1  # the prior's first try
    assert draft_length(0.99, 1, cheap, 8) == 8
    assert 1 < draft_length(0.9, 1, cheap, 8) < 8
    assert draft_length(0.99, 1, cheap, 3) == 3
    assert draft_length(0.3, 1, cheap, 8) == 0
    # sixteen streams: a row costs about what a token brings
    assert draft_length(0.85, 16, cheap, 8) == 0 < draft_length(0.85, 1, cheap, 8)
    assert draft_length(0.8, 1, dear, 8) == 0


def test_drafts_are_as_long_as_they_pay_and_none_while_paused_or_past_the_limit():
    d = sp.Drafting(NgramDrafter([7, 1, 2, 3, 4, 5, 9, 1, 2]))
    assert d.propose(emitted=0, streams=1, cost=(0.6, 0.4), limit=8) == [3]  # a = 0.5: one token
    assert d.propose(emitted=0, streams=1, cost=(0.6, 0.4), limit=0) == []
    assert d.propose(emitted=0, streams=16, cost=(0.6, 0.4), limit=8) == []
    d.record(1, 1, emitted=2)
    d.record(1, 1, emitted=4)
    assert len(d.propose(emitted=4, streams=1, cost=(0.6, 0.4), limit=8)) > 1
    d.matched.pause(4)
    assert d.propose(emitted=5, streams=1, cost=(0.6, 0.4), limit=8) == []


def test_a_floor_gives_drafts_the_cost_would_not_but_not_while_paused():
    """--draft-min: a draft of at least the floor where a source has one (rows dearer than any
    gain: none without it), never past the source's tokens or the limit, none while paused."""
    dear = (0.1, 0.9)
    tokens = [7, 1, 2, 3, 4, 5, 9, 1, 2]
    assert sp.Drafting(NgramDrafter(tokens)).propose(emitted=0, streams=1, cost=dear, limit=8) == []
    d = sp.Drafting(NgramDrafter(tokens), floor=3)
    assert d.propose(emitted=0, streams=1, cost=dear, limit=8) == [3, 4, 5]
    assert d.propose(emitted=0, streams=1, cost=dear, limit=2) == [3, 4]
    assert sp.Drafting(NgramDrafter(tokens), floor=16).propose(0, 1, dear, 16) == [3, 4, 5, 9, 1, 2]
    layer = sp.Drafting(None, nextn=True, floor=2)
    assert layer.layer_length(emitted=0, streams=1, cost=dear, limit=8) == 2
    layer.nextn.pause(0)
    assert layer.layer_length(emitted=1, streams=1, cost=dear, limit=8) == 0
    d.matched.pause(0)
    assert d.propose(emitted=1, streams=1, cost=dear, limit=8) == []


def test_a_copys_drafts_are_measured_apart():
    passage = list(range(100, 140))
    d = sp.Drafting(NgramDrafter([*passage, 7, *passage[:20]]))
    assert d.propose(emitted=0, streams=1, cost=(0.7, 0.3), limit=16)
    d.record(4, 4, emitted=5)
    assert d.copying.rate(5) > sp.COPY_PRIOR and d.matched.rate(5) == 0.5
    short = sp.Drafting(NgramDrafter([1, 2, 3, 9, 1, 2]))
    assert short.propose(emitted=0, streams=1, cost=(0.7, 0.3), limit=16) == [3]
    short.record(1, 0, emitted=1)
    assert short.matched.rate(1) < 0.5 and short.copying.rate(1) == sp.COPY_PRIOR


def test_mtp_is_refused_where_the_model_has_none_and_auto_takes_the_sources_it_has():
    assert settings.SPECULATIVE_CHOICES == sp.SPECULATIVE_MODES
    with pytest.raises(ConfigError, match="MTP"):
        sp.resolve("mtp", 8, "llama", has_nextn=False)
    alone = sp.resolve("auto", 6, "llama", has_nextn=False)
    assert alone == sp.Speculation("ngram", 6) and alone.lookup and not alone.nextn
    both = sp.resolve("auto", 6, "glm4moe", has_nextn=True)
    assert both.lookup and both.nextn
    mtp = sp.resolve("mtp", 6, "glm4moe", has_nextn=True)
    assert mtp.nextn and not mtp.lookup
    assert not sp.resolve("off", 8, "glm4moe", has_nextn=True).on
    assert not sp.Speculation("auto", 0).nextn


def test_the_layers_draft_is_taken_unless_lookup_finds_a_copy():
    """auto on a model with a NextN layer: the layer's draft, measured on its own acceptance;
    a stream that lookup finds copying (5 tokens or more agree) takes lookup's longer draft, and the
    layer's tokens are scored against the step's all the same."""
    passage = list(range(100, 140))
    d = sp.Drafting(NgramDrafter([*passage, 7, *passage[:20]]), nextn=True)
    d.layer_draft, d.layer_offer = [1, 2], 2
    assert d.propose(emitted=0, streams=1, cost=(0.7, 0.3), limit=16)[0] == passage[20]
    assert d.layer_draft == []  # a layer's draft is for one step only
    d.record(4, 4, emitted=5, tokens=passage[20:25])
    assert d.copying.rate(5) > sp.COPY_PRIOR
    assert d.nextn.rate(5) < 0.5  # the layer's draft, not fed, was scored: its first token was wrong
    d.layer_draft, d.layer_offer = passage[25:27], 2
    d.propose(emitted=5, streams=1, cost=(0.7, 0.3), limit=16)
    d.record(4, 4, emitted=10, tokens=passage[25:30])
    assert d.nextn.accepted > 1.5  # both right
    open_chat = sp.Drafting(NgramDrafter([1, 2, 3, 9, 1, 2]), nextn=True)
    open_chat.layer_draft, open_chat.layer_offer = [8, 9], 1
    assert open_chat.propose(emitted=0, streams=1, cost=(0.7, 0.3), limit=16) == [8]  # as offered
    open_chat.record(1, 0, emitted=1, tokens=[5])
    assert open_chat.nextn.rate(1) < 0.5 and open_chat.matched.rate(1) == 0.5


def test_the_layers_tokens_not_fed_are_scored_and_a_layer_that_fails_pauses():
    d = sp.Drafting(NgramDrafter([1, 2, 3, 9, 1, 2]), nextn=True)
    d.layer_draft, d.layer_offer = [8], 0  # too unlikely to feed: computed all the same
    assert d.propose(emitted=0, streams=1, cost=(0.7, 0.3), limit=16) == []
    d.record(0, 0, emitted=1, tokens=[8])
    assert d.nextn.rate(1) > 0.5 and d.drafted == 0
    end = 2 + 2 * sp.NEXTN_PAUSE_WINDOW
    for emitted in range(2, end):  # none right: the layer pauses, lookup drafts alone
        d.layer_draft, d.layer_offer = [8], 0
        d.propose(emitted=emitted, streams=1, cost=(0.7, 0.3), limit=16)
        d.record(0, 0, emitted=emitted, tokens=[5])
    assert d.nextn.paused_until > end
    d.layer_draft, d.layer_offer = [8], 1
    assert d.propose(emitted=end, streams=1, cost=(0.7, 0.3), limit=16) == [3]
    alone = sp.Drafting(None, nextn=True)
    alone.extend([5, 6])  # nothing to index
    assert alone.layer_length(emitted=0, streams=1, cost=(0.7, 0.3), limit=16) >= 1
    assert alone.layer_length(emitted=0, streams=1, cost=(0.7, 0.3), limit=0) == 0


def test_verify_walks_the_draft_while_it_matches_and_stops_at_a_stop_token():
    picks = iter([5, 6, 9, 4])
    assert verify([5, 6, 7], lambda j: next(picks), stop_ids={2}) == [5, 6, 9]
    assert verify([5, 6], lambda j: [5, 6, 8][j], stop_ids={2}) == [5, 6, 8]  # all accepted: a bonus
    assert verify([2, 6], lambda j: 2, stop_ids={2}) == [2]  # the turn ended: nothing after
    assert verify([], lambda j: 7, stop_ids={2}) == [7]


# A small vocabulary and a process whose next-token logits depend on the whole prefix (what the
# model's row after a draft token would give), the first two tokens' joint distribution measured.
V = 5
TABLE = np.random.default_rng(11).normal(0.0, 1.2, (97, V)).astype(np.float32)


def _row(prefix: list[int]) -> np.ndarray:
    return TABLE[hash(tuple(prefix)) % len(TABLE)]


def _generate(sampler: Sampler, length: int, drafts: np.random.Generator | None) -> tuple[int, ...]:
    """``length`` tokens, plainly or with a random draft at each step, no longer than the tokens
    left but one (as the engine drafts: never past the request's limit)."""
    out: list[int] = []
    while len(out) < length:
        size = 0 if drafts is None else int(drafts.integers(0, length - len(out)))
        draft = [int(t) for t in drafts.integers(0, V, size)] if size else []
        context = out[:]

        def draw(j: int, context=context, draft=draft) -> int:
            return sampler(_row(context + draft[:j]))

        out += verify(draft, draw, stop_ids=())
    assert len(out) == length
    return tuple(out)


def _probabilities(logits: np.ndarray, top_p: float) -> np.ndarray:
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_seeded_sampling_gives_the_same_tokens_with_drafts(top_p):
    """One uniform number per emitted token, drafts or not: the same seed, the same tokens."""
    params = SamplingParams(temperature=0.9, top_p=top_p, seed=5)
    plain, spec, drafts = Sampler(params), Sampler(params), np.random.default_rng(4)
    for _ in range(500):
        assert _generate(plain, 6, None) == _generate(spec, 6, drafts)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_output_keeps_its_distribution(top_p):
    """Drafted at random, unseeded: the first two tokens' counts against the exact joint
    distribution (chi-square), and nothing the truncation removes ever drawn."""
    spec, drafts = Sampler(SamplingParams(temperature=1.0, top_p=top_p)), np.random.default_rng(3)
    n = 20000
    counts = np.zeros((V, V))
    for _ in range(n):
        counts[_generate(spec, 2, drafts)] += 1
    p1 = _probabilities(_row([]), top_p)
    exact = np.array([[p1[a] * _probabilities(_row([a]), top_p)[b] for b in range(V)] for a in range(V)],
                     np.float64)
    seen = exact > 0
    assert counts[~seen].sum() == 0
    _, p_value = stats.chisquare(counts[seen], exact[seen] / exact[seen].sum() * n)
    assert p_value > 1e-3
