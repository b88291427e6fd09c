"""Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p.

One row of logits (the vocabulary) per sequence: the weights in numpy, the truncations and the
draw compiled (``kernels.draw``), so that sampling stays cheap next to the forward step on a
vocabulary of 150k tokens too. The parameters and the ranges they are held to: ``sampling_params``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from colibri.model.kernels.draw import draw
from colibri.model.kernels.ops import best_and_log_z
from colibri.model.sampling_params import (
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    REPETITION_WINDOW,
    SamplingParams,
)

__all__ = ["REPETITION_PENALTY_MAX", "REPETITION_PENALTY_MIN", "REPETITION_WINDOW", "Sampler",
           "SamplingParams", "load_kernels", "top_candidates"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


class Sampler:
    """Samples one sequence's tokens; its generator is seeded once, so a seed fixes the output."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._scratch = np.empty(0, np.float32)
        if params.temperature > 0.0:
            load_kernels()  # before the first token, not during it

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0 and len(history) and p.repeat_window:
            logits = logits.copy()
            seen = np.unique(np.asarray(history[-p.repeat_window:], dtype=np.int64))
            vals = logits[seen]
            logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        inv_t = 1.0 / p.temperature if p.temperature > 0.0 else math.inf
        if inv_t > _FLOAT32_MAX:  # T below float32's range: anything but the peak has odds 0
            return int(np.argmax(logits))
        peak = logits.max()  # NaN if any logit is
        if not np.isfinite(peak):  # a model gone bad: the engine ends this request, not the others
            raise ValueError(f"logits without a finite peak ({peak}): nothing to sample from")
        # Above float32's range a temperature makes every finite logit equally likely; a 1/T of 0
        # would make a -inf logit's weight NaN (-inf * 0), the smallest normal keeps it 0.
        return _draw(logits, self._weights(len(logits)), peak, max(inv_t, _FLOAT32_TINY), p,
                     self._rng.random())

    def _weights(self, n: int) -> np.ndarray:
        """Scratch for a row's weights, kept between tokens (a vocabulary's worth of float32)."""
        if self._scratch.shape[0] != n:
            self._scratch = np.empty(n, np.float32)
        return self._scratch


def _draw(logits: np.ndarray, weights: np.ndarray, peak: float, inv_t: float, p: SamplingParams,
          u: float) -> int:
    """``weights`` (scratch) = exp((logits - peak) / T) in float32, then the compiled draw, its
    arguments of the one type signature ``load_kernels`` loads."""
    inv_t = np.float32(inv_t)
    np.subtract(logits, peak, out=weights)  # vectorized numpy passes
    np.multiply(weights, inv_t, out=weights)
    np.exp(weights, out=weights)
    return draw(logits, weights, float(peak), float(inv_t), int(p.top_k), float(p.top_p), float(p.min_p), u)


@functools.cache
def load_kernels() -> None:
    """Load the compiled draw now, once a process: from numba's cache it takes ~10 ms beside a
    model (200 ms in a bare process), compiled on a cold cache seconds. The engine calls it
    before READY; a sampling ``Sampler`` at its construction, so that no decode step waits."""
    row = np.zeros(2, np.float32)
    _draw(row, np.empty(2, np.float32), 0.0, 1.0, SamplingParams(temperature=1.0), 0.5)


def top_candidates(logits: np.ndarray, sampled: int, n: int) -> list[tuple[int, float]]:
    """``n`` (token, log-probability) pairs: the sampled token first, then the best others (ties:
    the lower id first). A row with no finite peak (NaN, +inf, or nothing but -inf) has nothing to
    normalize against: its pairs are NaN, after the sampled token the lowest other ids."""
    row = np.ascontiguousarray(logits, np.float32)
    n = min(n, len(row))
    if not np.isfinite(row.max()):
        return [(t, float("nan")) for t in [sampled, *[t for t in range(n) if t != sampled][: n - 1]]]
    best = np.empty(n, np.int64)
    log_z = best_and_log_z(row, best)
    others = [int(t) for t in best if t != sampled][: n - 1]
    return [(t, float(row[t]) - log_z) for t in [sampled, *others]]
