"""Step planning: which rows the next forward step computes. Pure (no trio, no model), so its
fairness and its row order are unit-tested on their own (``tests/test_planner.py``).

Decode rows come first (one per request with one token to feed: the matmuls' direct path), then
at most one prompt chunk: serial, chunked prefill, one prompt at a time in the order requests
arrived, so a long prompt does not freeze the other streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class SlotView(Protocol):
    index: int
    history: list[int]  # tokens already in the KV cache: the next row's position is its length


class Feeding(Protocol):
    """A request as the planner sees it: the tokens it still has to feed, and its slot."""

    slot: SlotView
    todo: list[int]


@dataclass
class StepPlan:
    """One forward step: the rows, and for each request its share of them."""

    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # (request, rows it feeds, the row whose logits it samples from, or None mid-prompt)
    shares: list[tuple[Feeding, int, int | None]] = field(default_factory=list)
    n_direct: int = 0  # the leading decode rows

    @property
    def logit_rows(self) -> list[int]:
        return [row for _, _, row in self.shares if row is not None]


def plan_step(active: Sequence[Feeding], prefill_chunk: int) -> StepPlan:
    """The rows of the next step for the ``active`` requests, in arrival order."""
    plan = StepPlan()
    decoding = [(r, 1) for r in active if len(r.todo) == 1]
    prefill = next((r for r in active if len(r.todo) > 1), None)
    chunk = [(prefill, min(prefill_chunk, len(prefill.todo)))] if prefill else []
    plan.n_direct = len(decoding)
    for req, n in decoding + chunk:
        start = len(req.slot.history)
        plan.tokens.extend(req.todo[:n])
        plan.slots.extend([req.slot.index] * n)
        plan.positions.extend(range(start, start + n))
        last = len(plan.tokens) - 1 if n == len(req.todo) else None
        plan.shares.append((req, n, last))
    return plan
