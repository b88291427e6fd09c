"""Compiled functions called without numba's dispatcher, where a call's argument types never change.

The dispatcher types every argument of every call, in Python for NamedTuples of arrays (a layer's
weights, a MoE layer's stacked experts): 7 us of a dense layer's 74 (0.2 ms a token on the default
model, 30 layers), 14 us of a resident MoE layer's call (0.34 ms a token on a 24-layer MoE). An
entry point reads whatever it is given as the types it was compiled for, so its callers bind one
only to arguments whose types they keep: ``Decoder`` checks at load that every layer's weights type
alike and normalizes the step's arrays; ``MoEFFN`` binds one per stack of resident experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba.core.dispatcher import Dispatcher


class Entry:
    """``fn`` through the entry point of the signature its first call had."""

    def __init__(self, fn: Dispatcher) -> None:
        self.fn = fn
        self.entry: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.entry is None:
            self.entry = self.fn.compile(tuple(self.fn.typeof_pyval(a) for a in args))
        return self.entry(*args)


def same_types(fn: Dispatcher, values: list[Any]) -> bool:
    """Whether numba types every one of ``values`` alike (one layer argument across the layers)."""
    return len({fn.typeof_pyval(v) for v in values}) <= 1
