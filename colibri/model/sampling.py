"""Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p.

Numpy over one row of logits (the vocabulary) per sequence: cheap next to the forward step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibri.model.kernels.ops import best_and_log_z

# Tokens looked back on by the repetition penalty (llama.cpp's penalty_last_n default).
REPETITION_WINDOW = 64
# Candidates sorted when only top_p or min_p cut the distribution: if they hold top_p of the mass
# the rest cannot matter; otherwise the whole vocabulary is sorted.
SORT_HEAD = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    repeat_window: int = REPETITION_WINDOW  # the recent tokens the penalty looks at

    def validate(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repeat_window < 0:
            raise ValueError(f"repeat_window must be >= 0, got {self.repeat_window}")


class Sampler:
    """Samples one sequence's tokens; its generator is seeded once, so a seed fixes the output."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0 and len(history) and p.repeat_window:
            logits = logits.copy()
            seen = np.unique(np.asarray(history[-p.repeat_window:], dtype=np.int64))
            vals = logits[seen]
            logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        if p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0:  # the whole distribution: no sort
            scaled = logits.astype(np.float64) / p.temperature
            probs = np.exp(scaled - scaled.max())
            return int(self._rng.choice(len(probs), p=probs / probs.sum()))
        order = self._candidates(logits)
        scaled = logits[order].astype(np.float64) / p.temperature
        probs = np.exp(scaled - scaled[0])
        probs /= probs.sum()
        keep = len(order)
        if p.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        if p.top_p < 1.0:
            # the smallest prefix whose mass reaches top_p (always at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        probs = probs[:keep] / probs[:keep].sum()
        return int(order[self._rng.choice(keep, p=probs)])

    def _candidates(self, logits: np.ndarray) -> np.ndarray:
        """Token ids best first: the top_k, or enough of the head of the distribution to cover
        top_p (sorting a 50k vocabulary per token costs milliseconds; its head, microseconds)."""
        p, n = self.params, len(logits)
        k = p.top_k if p.top_k > 0 else SORT_HEAD
        if k < n:
            head = np.argpartition(-logits, k - 1)[:k]
            head = head[np.argsort(-logits[head], kind="stable")]
            if p.top_k > 0:
                return head
            scaled = logits.astype(np.float64) / p.temperature
            weights = np.exp(scaled - scaled.max())
            if weights[head].sum() >= p.top_p * weights.sum():
                return head
        return np.argsort(-logits, kind="stable")[: p.top_k or n]


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
