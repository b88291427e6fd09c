"""The engine's side of speculative decoding (``speculation.py``): the drafts each step verifies,
chosen before it, and the NextN layer's pass after it, which fills the layer's K/V over the step's
verified rows and drafts the next step's tokens.

The NextN pass (``colibri.model.network.nextn``): row p of a stream takes the main step's last
hidden state at p and the token at p + 1. After a step, a stream's verified rows are its prompt
chunk's rows (the token after the chunk's last is the next prompt token, or the one sampled), or
its decoding token's row and its accepted draft tokens' (the token after each is the one drawn
from it). One batched call of the layer covers every stream's rows (decode streams' rows first,
as in the step); each stream that goes on decoding samples its first draft token greedily from
its last row, then feeds it back, one row a pass, for the draft's next tokens. The layer's K/V at
those later positions is written over by the next pass, as a rejected draft's K/V is in the main
layers. A slot's first row after a reused prefix attends to the layer's K/V of that prefix as the
earlier turn left it; the rows fed outside a request (the Channel's probes and soft inputs) do
not run the layer, nor do a stream's rows while its layer's drafts are paused (under 10% accepted:
the pass costs a layer of the model each step, ~1/L of it, which drafts that fail do not repay):
its K/V there is whatever it was. Drafts only: the tokens are verified.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import numpy as np

from colibri.model.interface import EngineModel
from colibri.model.kv_cache import KVCache
from colibri.model.tokenizer import GGUFTokenizer
from colibri.sched.lookup import LineJoins, NgramDrafter
from colibri.sched.planner import StepPlan
from colibri.sched.requests import Request, Slot
from colibri.sched.speculation import Speculation, StepCost


def assign_drafts(active: Sequence[Request], speculation: Speculation, step_cost: StepCost, n_ctx: int,
                  stop_ids: Container[int]) -> None:
    """Each decoding request's draft for the step to come: no longer than the tokens it may still
    emit and the positions its slot has left, and nothing past a stop token."""
    decoding = [r for r in active if len(r.todo) == 1]
    cost = step_cost.split()
    for req in decoding:
        if req.drafting is None or req.stop_requested:
            continue
        room = _room(req, speculation, req.emitted, len(req.slot.history), n_ctx)
        draft = req.drafting.propose(req.emitted, len(decoding), cost, room)
        stop = next((i for i, t in enumerate(draft) if t in stop_ids), None)
        req.draft = draft if stop is None else draft[: stop + 1]  # nothing is drawn past a turn's end


def _room(req: Request, speculation: Speculation, emitted: int, position: int, n_ctx: int) -> int:
    """The most draft tokens the request may verify in the step that feeds its next token at
    ``position``, ``emitted`` tokens given by then: each is one more token of its answer and one
    more position of its slot."""
    return min(speculation.draft_max, req.submit.max_tokens - emitted - 1, n_ctx - position - 1)


def line_joins(tokenizer: GGUFTokenizer) -> LineJoins | None:
    """Prompt lookup's soft line breaks in the model's vocabulary."""
    return LineJoins.of_vocabulary([tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)])


def index_slot(slot: Slot, prompt: list[int], joins: LineJoins | None) -> NgramDrafter:
    """The slot's prompt-lookup index, holding ``prompt`` (off the event loop: a long prompt's
    first index takes tens of milliseconds)."""
    if slot.drafter is None:
        slot.drafter = NgramDrafter(prompt, joins)
    else:
        slot.drafter.reuse(prompt)
    return slot.drafter


@dataclass
class _Stream:
    """A stream's part of the NextN pass."""

    req: Request
    rows: list[int]  # its verified rows, as indices into the step's rows
    tokens: list[int]  # the token after each row's
    sampled: int  # tokens the step gave it (0 mid-prompt, or when the last ends its turn)
    length: int = 0  # draft tokens to make (0: only the layer's K/V)
    offer: int = 0  # of those, how many it offers to feed (the others are scored, not fed)
    draft: list[int] = field(default_factory=list)


def nextn_pass(model: EngineModel, kv: KVCache, plan: StepPlan, drawn: Sequence[object],
               speculation: Speculation, step_cost: StepCost, stop_ids: Container[int]) -> None:
    """After a step whose requests drew ``drawn`` (``Engine._compute``'s choices: a list of
    (token, candidates) per request that sampled, None mid-prompt, a str where sampling failed):
    the NextN layer over the step's verified rows of every request that drafts with it, and their
    drafts for the next step (``Drafting.layer_draft``)."""
    streams = _streams(plan, drawn, stop_ids)
    if not streams:
        return
    positions = np.asarray(plan.positions, np.int64)
    cost, n_decoding = step_cost.split(), sum(1 for s in streams if s.sampled)
    for s in streams:
        if s.sampled:  # the next step feeds its new token at the last row's position + 1
            req = s.req
            room = _room(req, speculation, req.emitted + s.sampled, int(positions[s.rows[-1]]) + 1, kv.n_ctx)
            s.offer = req.drafting.layer_length(req.emitted + s.sampled, n_decoding, cost, room)
            s.length = max(s.offer, 1) if room > 0 else 0  # a first token to score, fed or not
    rows = [r for s in streams for r in s.rows]
    slots, at = np.asarray(plan.slots, np.int64)[rows], positions[rows]
    kv.check_rows(slots, at)
    ends = np.cumsum([len(s.rows) for s in streams]) - 1
    chain = [s for s in streams if s.length]
    last = ends[[i for i, s in enumerate(streams) if s.length]]
    tokens = np.asarray([t for s in streams for t in s.tokens], np.int64)
    logits, hidden = model.draft(tokens, model.hidden(np.asarray(rows)), slots, at, kv, last,
                                 sum(1 for r in rows if r < plan.n_direct))
    at = at[last]
    while chain:  # each pass: one more token of each draft not yet long enough
        picks = logits.argmax(axis=1)
        for s, t in zip(chain, picks.tolist(), strict=True):
            s.draft.append(t)
        going = [i for i, s in enumerate(chain) if len(s.draft) < s.length and s.draft[-1] not in stop_ids]
        if not going:
            break
        chain, hidden, at, picks = [chain[i] for i in going], hidden[going], at[going] + 1, picks[going]
        slots = np.asarray([s.req.slot.index for s in chain], np.int64)
        kv.check_rows(slots, at)
        logits, hidden = model.draft(picks.astype(np.int64), hidden, slots, at, kv,
                                     np.arange(len(chain), dtype=np.int64), len(chain))
    for s in streams:
        s.req.drafting.layer_draft, s.req.drafting.layer_offer = s.draft, s.offer


def _streams(plan: StepPlan, drawn: Sequence[object], stop_ids: Container[int]) -> list[_Stream]:
    """The requests of the step that draft with the NextN layer, and their verified rows."""
    out, first = [], 0
    for (req, n, logit_rows), choice in zip(plan.shares, drawn, strict=True):
        start, first = first, first + n
        drafting = req.drafting
        if drafting is None or drafting.nextn is None or isinstance(choice, str):
            continue
        if req.emitted < drafting.nextn.paused_until:  # its drafts do not pay: nor does the layer
            continue
        fed = plan.tokens[start : start + n]
        if choice is None:  # mid-prompt: the next token is the prompt's
            out.append(_Stream(req, list(range(start, start + n)), fed[1:] + [req.todo[n]], 0))
            continue
        kept = n - len(logit_rows) + len(choice)  # the prompt's rows, or the token's and accepted drafts'
        last = choice[-1][0]
        out.append(_Stream(req, list(range(start, start + kept)), fed[1:kept] + [last],
                           0 if last in stop_ids else len(choice)))
    return out
