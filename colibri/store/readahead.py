"""When the expert store's read-ahead pays: both ways tried, the cheaper kept.

While MoE layer L computes, the store asks the kernel to read the experts layer L+1 will probably
use (``ExpertStore.prefetch``). That hides the disk's latency where the disk has time to spare
(1.11-1.16x tokens per second on this project's VM disk) and costs where the disk's throughput is
the bottleneck: the guesses that miss take bandwidth from the reads a step waits on (0.89x with
reads throttled to 200 MB/s; docs/performance.md). Which holds depends on the disk and the load,
not on the model, so the policy measures it: TRIAL_STEPS decode steps with the read-ahead, as many
without (which goes first alternates), then the cheaper way for HOLD_STEPS steps, then both again.
The cost of a step is its seconds per expert used (a step that routes to more experts does more
work, read or not); a way's cost is its median step.

Sans-IO: ``observe`` takes each decode step's figures, ``enabled`` says whether to read ahead for
the next one. Reading ahead changes nothing but speed: a token's experts are the same bits read
ahead or not.
"""

from __future__ import annotations

import statistics
from enum import Enum

# Decode steps per way in a trial: enough to average over a few tokens' routing (each step's
# cost varies with how many of its experts missed), few enough that the losing way costs little.
TRIAL_STEPS = 16
# Steps the chosen way holds before the next trial: long against a trial (a trial's losing half is
# ~6% of a cycle), short enough to follow a change of load or of what is resident.
HOLD_STEPS = 240
# Not reading ahead must be this much cheaper to be chosen: the read-ahead is the default, and two
# ways within the machine's noise are a tie.
MARGIN = 0.05


class Mode(Enum):
    AUTO = "auto"  # measured (this module)
    ON = "on"  # always read ahead
    OFF = "off"  # never (the benchmarks' baselines)


class ReadAheadPolicy:
    """Whether the store reads ahead, decided by ``mode`` or (AUTO) by trying both ways."""

    def __init__(self, mode: Mode = Mode.AUTO) -> None:
        self.mode = mode
        self.chosen = True  # AUTO's way outside trials
        # Which way a trial tries first alternates: the way tried second inherits the first's page
        # cache (what it read ahead and did not use yet), a lean the alternation evens out.
        self._with_first = True
        self._phase = 0  # 0: a trial's first way, 1: its second, 2: holding ``chosen``
        self._steps = 0  # steps of the current phase
        self._costs: dict[bool, list[float]] = {True: [], False: []}  # per way: seconds per use
        self._misses = 0  # in the current trial, both ways
        self.decisions = 0  # trials concluded (telemetry, tests)

    @property
    def enabled(self) -> bool:
        if self.mode is not Mode.AUTO:
            return self.mode is Mode.ON
        if self._phase == 2:
            return self.chosen
        return self._with_first == (self._phase == 0)

    def observe(self, seconds: float, uses: int, misses: int) -> None:
        """One decode step: its wall time, the experts it used (summed over layers) and how many
        of them were read from the file."""
        if self.mode is not Mode.AUTO or uses <= 0:
            return
        self._steps += 1
        if self._phase < 2:
            self._costs[self.enabled].append(seconds / uses)
            self._misses += misses
            if self._steps == TRIAL_STEPS:
                if self._phase == 1:
                    self.chosen = self._decide()
                self._phase += 1
                self._steps = 0
        elif self._steps == HOLD_STEPS:
            self._phase, self._steps, self._misses = 0, 0, 0
            self._costs = {True: [], False: []}
            self._with_first = not self._with_first

    def _decide(self) -> bool:
        """Read ahead unless the trial without it was cheaper by MARGIN, comparing the median
        step of each (one slow step, a collection or a writeback, does not decide a trial). With
        no misses in either there was nothing to read: keep reading ahead (it costs only a
        router product)."""
        self.decisions += 1
        if self._misses == 0:
            return True
        with_, without = (statistics.median(self._costs[way]) for way in (True, False))
        return not without < with_ * (1.0 - MARGIN)
