"""Step planning: which rows the next forward step computes. Pure (no trio, no model), so its
fairness and its row order are unit-tested on their own (``tests/test_planner.py``).

Decode rows come first (one per request with one token to feed, then its draft's tokens, if it
has one: the matmuls' direct path, whose rows give the same bits whatever else is in the step),
then at most one prompt chunk: serial, chunked prefill, one prompt at a time in the order requests
arrived, so a long prompt does not freeze the other streams. A decoding request samples from each
of its rows (its token's, and each draft token's, to verify the next); a prompt from its last row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class SlotView(Protocol):
    index: int
    history: list[int]  # tokens already in the KV cache: the next row's position is its length


class Feeding(Protocol):
    """A request as the planner sees it: the tokens it still has to feed, and its slot."""

    slot: SlotView
    todo: list[int]
    draft: list[int]  # tokens guessed to follow a decoding request's one todo token (speculation.py)


class Share(NamedTuple):
    """A request's part of a step: the rows it feeds, and the rows whose logits it samples from
    (none for a prompt chunk mid-way)."""

    req: Feeding
    n: int
    logit_rows: range


@dataclass
class StepPlan:
    """One forward step: the rows, and for each request its share of them."""

    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    shares: list[Share] = field(default_factory=list)
    n_direct: int = 0  # the leading decode rows, drafts included

    @property
    def logit_rows(self) -> list[int]:
        return [row for share in self.shares for row in share.logit_rows]


def plan_step(active: Sequence[Feeding], prefill_chunk: int, alone_chunk: int | None = None) -> StepPlan:
    """The rows of the next step for the ``active`` requests, in arrival order: a prompt chunk of
    ``prefill_chunk`` tokens beside decoding requests, of ``alone_chunk`` (default the same) where
    none decodes: no stream waits on that step, and a MoE model's larger steps read its experts
    fewer times (``settings.prefill_chunks``)."""
    plan = StepPlan()
    decoding = [(r, r.todo + r.draft, True) for r in active if len(r.todo) == 1]
    prefill = next((r for r in active if len(r.todo) > 1), None)
    size = prefill_chunk if decoding or alone_chunk is None else alone_chunk
    chunk = [(prefill, prefill.todo[:size], False)] if prefill else []
    plan.n_direct = sum(len(rows) for _, rows, _ in decoding)
    for req, rows, decodes in decoding + chunk:
        start, first, n = len(req.slot.history), len(plan.tokens), len(rows)
        plan.tokens.extend(rows)
        plan.slots.extend([req.slot.index] * n)
        plan.positions.extend(range(start, start + n))
        if decodes:
            sampled = range(first, first + n)
        else:  # a prompt's last chunk samples its first token
            sampled = range(first + n - 1, first + n) if n == len(req.todo) else range(0)
        plan.shares.append(Share(req, n, sampled))
    return plan
