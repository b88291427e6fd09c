"""The engine's state per KV slot and per request."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from colibri.io.events import Error, Submit
from colibri.model.grammar import Constraint
from colibri.model.interface import StoreCounters
from colibri.model.sampling import Sampler
from colibri.model.tokenizer import StreamDecoder
from colibri.sched.lookup import NgramDrafter
from colibri.sched.speculation import Drafting

# Where a request's events go: its session's encoder, or a capture around it (legacy, Channel).
Emit = Callable[[object], Awaitable[None]]


@dataclass(eq=False)
class Slot:
    index: int
    history: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache, in order
    owner: Request | None = None
    # prompt lookup's index of its last request's tokens: the next turn indexes only what it adds
    drafter: NgramDrafter | None = None


@dataclass(eq=False)
class Request:
    """One SUBMIT from acceptance to its DONE or ERROR. Its task in the engine's nursery runs inside
    ``scope``, which CANCEL cancels; ``finished`` is set when generation ends."""

    id: int
    slot: Slot
    submit: Submit
    sampler: Sampler
    emit: Emit
    detokenizer: StreamDecoder
    prompt: list[int] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)  # tokens still to feed: prompt suffix, then the last sample
    emitted: int = 0
    reused: int = 0
    admitted: bool = False
    length_limited: bool = False
    cancelled: bool = False
    finished: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    t_prefill: float = 0.0
    t_attn: float = 0.0  # the attention and head seconds of the steps it had rows in (PERF, PROF)
    t_head: float = 0.0
    store_at_start: StoreCounters | None = None  # the expert store's counters when admitted
    constraint: Constraint | None = None  # the SUBMIT's grammar, if it had one
    stop_requested: bool = False  # STOP: end with a normal DONE at the next step boundary
    forwards: int = 0  # forward steps this request had rows in (PROF)
    failure: Error | None = None  # why it ended in the step loop (its sampling failed): its ERROR
    drafting: Drafting | None = None  # speculative decoding's state, where the request drafts
    draft: list[int] = field(default_factory=list)  # the next step's draft: tokens to verify after todo
