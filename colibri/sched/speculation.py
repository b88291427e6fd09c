"""Speculative decoding: where a stream's draft comes from, and how much of it is worth verifying.

A draft is tokens guessed to follow a stream's next token. The step feeds them after that token,
as decode rows (``planner.py``: the direct path, so each row's logits are the bits a plain decode
step would give), and the engine walks them: row i's token is drawn as always, from row i's logits
with the request's sampler, and the walk goes on while the drawn token equals draft token i+1. A
draft token is a point mass, so this is speculative sampling's rejection rule (accept d with
probability p(d), else draw from p without d, renormalized), drawn with the same one uniform
number per emitted token as plain decoding: greedy and seeded output are token for token those
of plain decoding, and sampled output keeps its distribution exactly. The rows past the first
rejection wrote K/V beyond the slot's history: a row attends to the positions up to its own only,
all of them written by its step or held in the history, so those are never read, and later steps
write over them as the history grows (the rollback is the history's length).

Sources (``--speculative``): ``ngram``, prompt lookup over the stream's own tokens (prompt and
output; ``lookup.py``), no extra weights; ``mtp``, the model's NextN layer
(``colibri.model.network.nextn``: run after each step over the step's verified rows, it drafts a
token, then feeds it back for the next; ``drafts.py``); ``auto``, both where the model has a NextN
layer (a stream that prompt lookup finds copying takes the lookup's draft, often a dozen tokens, the
others the layer's), else lookup.

How much: draft token i is verified only where it pays. ``Acceptance`` measures the chance a draft
token is accepted, given the previous one was (a); ``StepCost`` measures what a step's rows cost.
The draft length taken maximizes the step's expected tokens per second, (B + a + ... + a^k) /
(base + row * (B + k)) for a step of B streams, so drafts shrink where rows are dear (16 streams,
a MoE whose extra rows route to more experts, a capped store reading them from disk) and grow
where the stream is copying. The measure forgets as tokens pass, so a stream whose drafts stopped
paying tries a one-token draft again some twenty tokens later (a stream that copies only in
places finds them); one under 10% accepted over its last 24 proposed tokens pauses for 256 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from colibri.errors import ConfigError
from colibri.sched.lookup import NgramDrafter

SPECULATIVE_MODES = ("off", "ngram", "mtp", "auto")
# A draft whose source agrees with the stream's last COPYING tokens or more is a copy's: its
# acceptance is measured apart from the others' (a stream copying a function accepts nearly all of
# one, and much less of a draft from a two-token match, which would otherwise set one rate for
# both); agreement is counted up to ``lookup.AGREEMENT_MAX`` tokens.
COPYING = 5
# A copy's drafts are taken for likely before any is measured (the code edit's copies accepted
# 85-90% of their tokens): its first draft is several tokens, not one.
COPY_PRIOR = 0.8
# Drafting pauses when fewer than PAUSE_BELOW of the last PAUSE_WINDOW proposed tokens were
# accepted, for PAUSE_TOKENS emitted tokens (colibri's C engine's rule).
PAUSE_WINDOW = 24
# The NextN layer's drafts are judged sooner: the layer runs every step its drafts are not paused
# (a layer of the model's, ~1/L of a step: 11% of one on a 16-layer synthetic GLM file whose
# random layer never predicted right, bench/bench_mtp.py), whether it drafts or not, and a stream
# whose drafts fail proposes one token only now and then (22 in 400 tokens there): 24 proposals
# would take ~400 tokens. None of 8 accepted from a layer that accepts 60% has odds of 1 in 1,500.
NEXTN_PAUSE_WINDOW = 8
PAUSE_BELOW = 0.10
PAUSE_TOKENS = 256
# The acceptance estimate: decayed counts of accepted and rejected draft tokens over a prior of one
# each (a = 0.5 before any proposal, enough for a first one-token draft on the default model);
# every emitted token weighs the past by ACCEPTANCE_DECAY, a half-life of 17 tokens: the rate
# follows what the stream does now (copying a passage, then writing its own words, then copying).
ACCEPTANCE_DECAY = 0.96
# The step cost: a row beyond the first costs ROW_COST_PRIOR of a one-row step until steps of
# varied row counts say otherwise (SmolLM2 Q4_1, 2 cores, a 400-token function copied: ~0.25-0.35;
# the forward pass alone, every row's logits, 300 positions: 1 row 4.7 ms, 9 rows 20.9 ms; a tiny
# test model's rows are nearly free). The prior weighs as much as steps whose row counts spread by
# COST_PRIOR_SPREAD (squared rows); each step weighs the past down by COST_DECAY (a memory of ~100
# steps: the host's noise averages out, a conversation's growing context is followed). A step slower
# than OUTLIER times the fit counts as that; the first WARMUP_STEPS are not counted; a row never
# costs less than MIN_RATIO of a step (the fit on noise can say so).
ROW_COST_PRIOR = 0.3
COST_PRIOR_SPREAD = 4.0
COST_DECAY = 0.99
OUTLIER = 3.0
WARMUP_STEPS = 2
MIN_RATIO = 0.02


class Acceptance:
    """One stream's measured acceptance and its pause."""

    def __init__(self, prior: float = 0.5, window: int = PAUSE_WINDOW) -> None:
        self.prior = prior  # the rate before any proposal: two pseudo-proposals' worth
        self.pause_window = window  # proposed tokens the pause rule judges at a time
        self.accepted = self.rejected = 0.0  # decayed counts, the prior's excluded
        self.at = 0  # the emitted count the counts are decayed to
        self.window = self.window_accepted = 0  # proposed and accepted since the last check
        self.paused_until = 0  # the emitted count at which drafting resumes

    def rate(self, emitted: int) -> float:
        """a: the chance a draft token is accepted when the one before it was."""
        self._decay(emitted)
        return (self.accepted + 2.0 * self.prior) / (self.accepted + self.rejected + 2.0)

    def _decay(self, emitted: int) -> None:
        if emitted > self.at:
            f = ACCEPTANCE_DECAY ** (emitted - self.at)
            self.accepted, self.rejected, self.at = self.accepted * f, self.rejected * f, emitted

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        """A verified draft of ``proposed`` tokens, ``accepted`` of them (the first rejection ends
        what is observed: the tokens after it were never tried), ``emitted`` the count after it."""
        self._decay(emitted)
        self.accepted += accepted
        self.rejected += 1 if accepted < proposed else 0
        self.window += proposed
        self.window_accepted += accepted
        if self.window >= self.pause_window:
            if self.window_accepted < PAUSE_BELOW * self.window:
                self.pause(emitted)
            self.window = self.window_accepted = 0

    def pause(self, emitted: int) -> None:
        """No drafts for PAUSE_TOKENS tokens, then a fresh start from the prior."""
        self.paused_until = emitted + PAUSE_TOKENS
        self.accepted = self.rejected = 0.0
        self.window = self.window_accepted = 0


class StepCost:
    """What a decode step's rows cost, from the steps measured (steps with prompt rows are not
    decode steps: not counted): seconds = base + row * rows, fitted by least squares over decayed
    sums, the slope drawn toward the prior (a row costs ROW_COST_PRIOR of a one-row step) with the
    weight of COST_PRIOR_SPREAD: where the steps' row counts hardly vary (16 streams and no drafts)
    the data cannot tell a row's cost, and the prior stands."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # decayed sums of 1, n, n^2, t, n*t
        self._skip = WARMUP_STEPS

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        if self._skip:  # the first steps wait on cold caches and first calls
            self._skip -= 1
            return
        if self._sums[0] > 1.0:  # one step the OS held counts as a slow one, not as ten
            base, row = self._fit()
            seconds = min(seconds, OUTLIER * (base + row * rows))
        self._sums = [v * COST_DECAY for v in self._sums]
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self._sums[i] += v

    def _fit(self) -> tuple[float, float]:
        """(base, row) in seconds."""
        w, wn, wnn, wt, wnt = self._sums
        n, t = wn / w, wt / w
        spread, cov = wnn - wn * n, wnt - wn * t
        # the prior's slope, ROW_COST_PRIOR of a one-row step, written in the fitted line's terms
        row = (cov + COST_PRIOR_SPREAD * ROW_COST_PRIOR * t) / (
            spread + COST_PRIOR_SPREAD * (1.0 + ROW_COST_PRIOR * (n - 1.0)))
        row = max(row, MIN_RATIO * t / n)
        return max(t - row * n, 0.0), row

    def split(self) -> tuple[float, float]:
        """(base, row) in one-row-step units: a step of n rows costs base + row * n."""
        if self._sums[0] <= 0.0:
            return 1.0 - ROW_COST_PRIOR, ROW_COST_PRIOR
        base, row = self._fit()
        return base / (base + row), row / (base + row)


def draft_length(rate: float, streams: int, cost: tuple[float, float], limit: int) -> int:
    """The k in [0, limit] with the most expected tokens per second: a step of ``streams`` rows and
    k draft rows yields streams + rate + ... + rate^k tokens for base + row * (streams + k)."""
    base, row = cost
    best_k, best = 0, streams / (base + row * streams)
    gain, p = float(streams), 1.0
    for k in range(1, limit + 1):
        p *= rate
        gain += p
        value = gain / (base + row * (streams + k))
        if value > best:
            best_k, best = k, value
    return best_k


def verify(draft: Sequence[int], draw: Callable[[int], int], stop_ids: Container[int]) -> list[int]:
    """The tokens a step gives a request that fed ``draft`` after its token: ``draw(j)`` is row j's
    token, drawn as plain decoding draws it; the walk goes on while it equals draft token j, and
    ends at a stop token (nothing is drawn after the turn's end)."""
    tokens: list[int] = []
    for j in range(len(draft) + 1):
        token = draw(j)
        tokens.append(token)
        if j == len(draft) or token != draft[j] or token in stop_ids:
            break
    return tokens


@dataclass(frozen=True)
class Speculation:
    """The engine's setting: the draft source (``SPECULATIVE_MODES``, ``auto`` resolved at load) and
    the longest draft a step verifies, the shortest it is given where drafting runs (``DRAFT_MIN``
    in settings.py)."""

    mode: str = "off"
    draft_max: int = 16
    draft_min: int = 0

    @property
    def on(self) -> bool:
        return self.mode != "off" and self.draft_max > 0

    @property
    def lookup(self) -> bool:
        """Prompt lookup drafts (alone, or the copies beside the NextN layer's)."""
        return self.on and self.mode in ("ngram", "auto")

    @property
    def nextn(self) -> bool:
        """The model's NextN layer drafts."""
        return self.on and self.mode in ("mtp", "auto")


NO_SPECULATION = Speculation()


def resolve(mode: str, draft_max: int, arch: str, has_nextn: bool, draft_min: int = 0) -> Speculation:
    """The engine's setting for its model (``has_nextn``: a NextN layer loaded): ``auto`` as the
    sources the model has."""
    if mode == "mtp" and not has_nextn:
        raise ConfigError(f"--speculative mtp: the model has no NextN (MTP) layer colibri runs "
                          f"(architecture {arch!r}; GLM-4.5's files may carry one); use ngram or auto")
    if mode == "auto" and not has_nextn:
        mode = "ngram"
    return Speculation(mode, draft_max, draft_min)


class Drafting:
    """One request's drafting: its sources, their acceptance, its counts (PERF reports them).

    The NextN layer's acceptance is measured at every step it runs, not only where its draft is
    fed: its first token costs only the head's row once the layer has run for its K/V, so where
    its draft is not fed (too unlikely to pay, or lookup's taken instead) it is scored against the
    token the step drew (the same event as its acceptance: the drawn token equals it); a layer
    whose drafts fail is so paused within NEXTN_PAUSE_WINDOW steps, and stops costing its pass."""

    def __init__(self, lookup: NgramDrafter | None, nextn: bool = False, floor: int = 0) -> None:
        self.lookup = lookup  # the slot's prompt-lookup index, holding the request's prompt
        # by the source's agreement; a copy's drafts are taken for likely before any is measured
        self.matched, self.copying = Acceptance(), Acceptance(COPY_PRIOR)
        self.nextn = Acceptance(window=NEXTN_PAUSE_WINDOW) if nextn else None  # the NextN layer's drafts
        self.layer_draft: list[int] = []  # the NextN layer's tokens for the next step (``drafts.py``)
        self.layer_offer = 0  # how many of them it offers to feed (the rest are only scored)
        self._shadow: list[int] = []  # the layer's tokens not fed: scored against the step's
        self._last = self.matched  # the acceptance the step's draft is measured for
        self.drafted = self.accepted = 0
        self.floor = floor  # the fewest tokens a draft is given (Speculation.draft_min)

    def _length(self, rate: float, streams: int, cost: tuple[float, float], limit: int) -> int:
        return max(min(self.floor, limit), draft_length(rate, streams, cost, limit))

    def extend(self, tokens: Sequence[int]) -> None:
        if self.lookup is not None:
            self.lookup.extend(tokens)

    def layer_length(self, emitted: int, streams: int, cost: tuple[float, float], limit: int) -> int:
        """How many tokens the NextN layer offers to feed in the step to come (each one more pass
        of the layer): none while paused."""
        a = self.nextn
        if a is None or limit <= 0 or emitted < a.paused_until:
            return 0
        return self._length(a.rate(emitted), streams, cost, limit)

    def propose(self, emitted: int, streams: int, cost: tuple[float, float], limit: int) -> list[int]:
        """The draft for the step to come (empty: none this step)."""
        layer_draft, offer = self.layer_draft, self.layer_offer
        self.layer_draft, self.layer_offer, self._shadow = [], 0, []
        if limit <= 0:
            return []
        draft, agreed = self.lookup.propose(limit) if self.lookup is not None else ([], 0)
        layer = self.nextn
        if layer is None or emitted < layer.paused_until:
            layer_draft = []  # (none computed while paused: nothing to feed or score)
        if layer_draft and agreed < COPYING:
            self._last = layer  # the layer's where it ran, unless lookup finds a copy
            fed = layer_draft[: self._length(layer.rate(emitted), streams, cost, min(offer, limit))]
            self._shadow = [] if fed else layer_draft
            return fed
        self._shadow = layer_draft
        a = self._last = self.copying if agreed >= COPYING else self.matched
        if not draft or emitted < a.paused_until:
            return []
        return draft[: self._length(a.rate(emitted), streams, cost, len(draft))]

    def record(self, proposed: int, accepted: int, emitted: int, tokens: Sequence[int] = ()) -> None:
        """A step's outcome: its draft (``proposed`` tokens, ``accepted`` of them; none: 0, 0),
        ``tokens`` the tokens it gave, against which the layer's tokens not fed are scored."""
        self.drafted += proposed
        self.accepted += accepted
        if proposed:
            self._last.record(proposed, accepted, emitted)
        shadow, self._shadow = self._shadow, []
        if shadow and tokens and self.nextn is not None:  # judged as far as the step's tokens go
            seen = min(len(shadow), len(tokens))
            agreed = next((i for i in range(seen) if shadow[i] != tokens[i]), seen)
            self.nextn.record(min(agreed + 1, seen), agreed, emitted)
