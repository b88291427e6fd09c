"""The sampling parameters and the one check of their ranges, for every protocol: the Channel's
SET_CONFIG, a mux or legacy SUBMIT (``Engine.check``), ``coli run``'s flags. A range is where the
sampler's arithmetic is defined for every finite float32 logit a model produces; NaN and the
infinities are outside every one.

No numba and no kernels here (``sampling.py`` draws): the HTTP server, which must not load them,
can hold its parser to the same ranges by importing this module.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

# Tokens looked back on by the repetition penalty (llama.cpp's penalty_last_n default).
REPETITION_WINDOW = 64
# The repetition penalty divides a seen token's positive logit by p and multiplies its negative
# one by p (llama.cpp's rule): in float32 that overflows once |logit| * max(p, 1/p) passes 3.4e38.
# Within [1e-3, 1e3] it takes a logit past 3.4e35, which no output head comes near (logits are
# tens; a model whose logits reach such values is broken, and its request ends with an error).
# Nothing is lost at the bounds: a seen token's logit scaled by 1000 already decides any softmax.
# A penalty of 1e-45 (a float32 denormal, taken when only p > 0 was asked) made every seen positive
# logit inf: no finite peak to sample from, and the engine left its step loop.
REPETITION_PENALTY_MIN = 1e-3
REPETITION_PENALTY_MAX = 1e3


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
        """ValueError naming the first field outside its range.

        Any finite temperature >= 0 is defined (the sampler takes one below float32's range as
        greedy, one above it as uniform); top_p and min_p are probabilities (top_p 0 would keep no
        token); top_k, repeat_window and the seed are counts: integers >= 0, so that a float, whose
        infinity or NaN has no integer, never reaches ``int()`` in the middle of a step."""
        _real("temperature", self.temperature, 0.0, math.inf)
        _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _real("min_p", self.min_p, 0.0, 1.0)
        _real("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX)
        _count("top_k", self.top_k)
        _count("repeat_window", self.repeat_window)
        if self.seed is not None:
            _count("seed", self.seed)


def _real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """``value`` a finite real number in [low, high] ((low, high] with ``low_open``)."""
    ok = (isinstance(value, numbers.Real) and math.isfinite(value)
          and (low < value if low_open else low <= value) and value <= high)
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high < math.inf else f">= {low:g}"
        raise ValueError(f"{name} must be a finite number {'in ' if high < math.inf else ''}{span}, "
                         f"got {value!r}")


def _count(name: str, value: object) -> None:
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}") from None
    if n < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {n}")
