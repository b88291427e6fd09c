"""The read-ahead policy (``colibri/store/readahead.py``): fed steps where one way is cheaper, it
keeps that way between trials and tries both again after a hold; with nothing missed it keeps
reading ahead; fixed modes never change. And in the store: the forward pass reports its decode
steps (prefill steps are not weighed), and a disabled read-ahead asks the kernel for nothing.
Real timings are not asserted (a benchmark's job: ``bench_moe_peer.py --readahead-ways``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_expert_store import N_EXPERTS, N_TOKENS, greedy, moe_path  # noqa: F401 (the fixture)

from colibri.model.loader import Model
from colibri.store.readahead import HOLD_STEPS, MARGIN, TRIAL_STEPS, Mode, ReadAheadPolicy

USES = 8  # expert uses per step, as a 4-layer top-2 model's


def _run(policy: ReadAheadPolicy, cost_with: float, cost_without: float, steps: int) -> list[bool]:
    """``steps`` decode steps of ``USES`` uses, each costing its way's seconds per use; returns
    whether each step read ahead."""
    ways = []
    for _ in range(steps):
        on = policy.enabled
        ways.append(on)
        policy.observe((cost_with if on else cost_without) * USES, USES, misses=1)
    return ways


def test_a_trial_tries_both_ways_then_holds_the_cheaper():
    policy = ReadAheadPolicy()
    ways = _run(policy, cost_with=1.0, cost_without=0.8, steps=2 * TRIAL_STEPS + HOLD_STEPS)
    assert ways[:TRIAL_STEPS] == [True] * TRIAL_STEPS
    assert ways[TRIAL_STEPS:2 * TRIAL_STEPS] == [False] * TRIAL_STEPS
    assert ways[2 * TRIAL_STEPS:] == [False] * HOLD_STEPS  # without was cheaper: held
    assert policy.decisions == 1
    ways = _run(policy, cost_with=1.0, cost_without=0.8, steps=2 * TRIAL_STEPS + HOLD_STEPS)
    assert ways[:2 * TRIAL_STEPS] == [False] * TRIAL_STEPS + [True] * TRIAL_STEPS  # the other first
    assert ways[2 * TRIAL_STEPS:] == [False] * HOLD_STEPS and policy.decisions == 2


def test_one_slow_step_does_not_decide_a_trial():
    """Each way's median step: a without-step 100x dearer (a collection, say) is one step."""
    policy = ReadAheadPolicy()
    ways = []
    for i in range(2 * TRIAL_STEPS + 1):
        on = policy.enabled
        ways.append(on)
        cost = 1.0 if on else (80.0 if i == TRIAL_STEPS else 0.8)
        policy.observe(cost * USES, USES, misses=1)
    assert not ways[-1]  # without held, the slow step notwithstanding


def test_the_read_ahead_is_kept_when_it_pays_or_ties():
    for without in (1.5, 1.0, 1.0 - MARGIN / 2):  # dearer without, equal, within the margin
        policy = ReadAheadPolicy()
        ways = _run(policy, cost_with=1.0, cost_without=without, steps=2 * TRIAL_STEPS + HOLD_STEPS)
        assert all(ways[2 * TRIAL_STEPS:]), without


def test_the_choice_follows_a_change_of_disk():
    """A hold, then the disk gets slow: the next trial finds reading ahead dearer and drops it."""
    policy = ReadAheadPolicy()
    cycle = 2 * TRIAL_STEPS + HOLD_STEPS
    assert all(_run(policy, 1.0, 1.2, cycle)[2 * TRIAL_STEPS:])
    assert not any(_run(policy, 1.0, 0.5, cycle)[2 * TRIAL_STEPS:])
    assert policy.decisions == 2


def test_with_nothing_missed_it_keeps_reading_ahead():
    policy = ReadAheadPolicy()
    for _ in range(2 * TRIAL_STEPS):
        on = policy.enabled
        policy.observe(1.0 if on else 0.1, USES, misses=0)
    assert policy.enabled and policy.decisions == 1


@pytest.mark.parametrize("mode", [Mode.ON, Mode.OFF])
def test_a_fixed_mode_never_changes(mode: Mode):
    policy = ReadAheadPolicy(mode)
    ways = _run(policy, cost_with=1.0, cost_without=0.1 if mode is Mode.ON else 10.0, steps=400)
    assert ways == [mode is Mode.ON] * 400 and policy.decisions == 0


def test_the_store_weighs_decode_steps_and_a_disabled_read_ahead_reads_nothing(moe_path: Path):  # noqa: F811
    model = Model(moe_path, ram_budget=1)  # a budget: every expert a miss, read-ahead in play
    store = model.decoder.experts
    seen: list[tuple[float, int, int]] = []
    store.readahead.observe = lambda seconds, uses, misses: seen.append((seconds, uses, misses))
    greedy(model)  # a prefill step, then decode steps
    assert len(seen) == N_TOKENS - 1 and all(seconds > 0 for seconds, _, _ in seen)  # not the prefill
    n_moe = len(store.layers)
    assert all(n_moe <= uses <= n_moe * store.n_used for _, uses, _ in seen)  # one row: k per layer
    assert all(misses == uses for _, uses, misses in seen)  # a 1-byte budget keeps nothing
    advised: list[tuple[int, int]] = []
    model.gguf.advise_willneed = lambda start, length: advised.append((start, length))
    store.readahead = ReadAheadPolicy(Mode.OFF)
    store.prefetch(store.layers[0], np.arange(N_EXPERTS))
    assert advised == []
    store.readahead = ReadAheadPolicy(Mode.ON)
    store.prefetch(store.layers[0], np.arange(N_EXPERTS))
    assert len(advised) == 3 * N_EXPERTS  # gate, up and down of each
