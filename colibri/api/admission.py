"""Admission: requests take a KV slot or wait for one in a bounded FIFO queue, for a bounded time.

A request names a slot (``cache_slot``) or takes a free one: the free slot whose last prompt shares
the longest prefix with its own, when that prefix is at least ``min_share`` of the slot's prompt
(the conversation's next turn finds its KV), else the least recently used free slot (a new
conversation does not evict one that a shared system prompt merely resembles). Waiters are served
first come, first served among those whose slot is free; a full queue or a wait past the timeout is
refused (the server answers 429 before any streaming header is sent).

The knowledge is the server's: each slot's last prompt as sent (token ids, or the rendered text
when the engine tokenizes). The engine matches the real history and reports what it reused, so a
stale entry (the engine restarted without persistence, a cancelled prefill) costs a prefill, never
a wrong answer (docs/deploy.md, "Which slot a request takes"). Only slots the request's owner may
reuse (``slot_owners``) are chosen for their prefix.

A streamed answer outlives the route that admitted it, so the slot is held by a ``SlotLease``
that whoever ends the answer releases, rather than by a ``with`` block in the route.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio

from colibri import settings
from colibri.api.slot_owners import SlotOwners

# The --prefix-share default (its reason: colibri/settings.py).
MIN_PREFIX_SHARE = settings.PREFIX_SHARE.default

Prompt = Sequence[int] | str  # token ids, or the rendered text when the engine tokenizes it


def common_prefix(a: Prompt, b: Prompt) -> int:
    """The length of the longest common prefix, by bisection on slice equality (compared in C: a
    4096-token prompt costs a dozen slice compares, not 4096 Python steps)."""
    if isinstance(a, str) != isinstance(b, str):
        return 0
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiters already."""


class QueueTimeout(Exception):
    """No slot came free within ``timeout_s``."""


@dataclass(eq=False)
class _Waiter:
    wanted: int | None
    prompt: Prompt | None
    owner: str | None
    granted: tuple[int, bool] | None = None  # the slot, and whether its prefix chose it
    event: trio.Event = field(default_factory=trio.Event)


class SlotLease:
    """A slot taken from ``Admission``, until ``release`` (or the end of an ``async with``).
    ``prefix_hit``: the slot was chosen for the prefix it holds (not named, not the LRU one)."""

    def __init__(self, slot: int, waited: float, hold: AsyncExitStack, prefix_hit: bool = False) -> None:
        self.slot, self.waited, self._hold, self.prefix_hit = slot, waited, hold, prefix_hit
        self.released = False
        self.owner = ""  # whose request holds it (``slot_owners.owner_of``)
        self.forget = False  # the slot held another owner's conversation: the engine forgets it first

    async def release(self) -> None:
        """Give the slot back; shielded, so a cancelled caller cannot leak it. Idempotent."""
        self.released = True
        with trio.CancelScope(shield=True):
            await self._hold.aclose()

    async def __aenter__(self) -> SlotLease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


class Admission:
    def __init__(
        self, n_slots: int, max_queue: int, timeout_s: float, min_share: float = MIN_PREFIX_SHARE,
        owners: SlotOwners | None = None,
    ) -> None:
        self.n_slots, self.max_queue, self.timeout_s = n_slots, max_queue, timeout_s
        self.owners = owners  # None: every slot's prefix is anyone's (a unit test's admission)
        self.min_share = min_share
        self.busy = [False] * n_slots
        self.waiters: deque[_Waiter] = deque()
        self.last_used = list(range(n_slots))  # least recently used first: spreads the KV reuse
        self.prompts: list[Prompt | None] = [None] * n_slots  # each slot's last prompt, as sent

    @property
    def active(self) -> int:
        return sum(self.busy)

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def _free(self, wanted: int | None, prompt: Prompt | None = None,
              owner: str | None = None) -> tuple[int, bool] | None:
        """The slot to take now, and whether its prefix chose it; None: none is free."""
        if wanted is not None:
            return None if self.busy[wanted] else (wanted, False)
        free = [s for s in self.last_used if not self.busy[s]]
        if not free:
            return None
        best, best_len = free[0], 0
        if prompt:
            for s in free:  # least recently used first: a tie goes to the older slot
                if self.owners is not None and not self.owners.reusable(s, owner or ""):
                    continue  # another client's conversation: never chosen for what it holds
                held = self.prompts[s]
                n = common_prefix(held, prompt) if held else 0
                if n > best_len and n >= self.min_share * len(held):
                    best, best_len = s, n
        return best, best_len > 0

    def _take(self, slot: int, prompt: Prompt | None) -> int:
        self.busy[slot] = True
        self.last_used.remove(slot)
        self.last_used.append(slot)
        self.prompts[slot] = prompt  # what the slot will hold a prefix of (None: unknown)
        return slot

    def _release(self, slot: int) -> None:
        self.busy[slot] = False
        for waiter in list(self.waiters):
            free = self._free(waiter.wanted, waiter.prompt, waiter.owner)
            if free is not None:
                self.waiters.remove(waiter)
                self._take(free[0], waiter.prompt)
                waiter.granted = free
                waiter.event.set()

    @asynccontextmanager
    async def slot(
        self, wanted: int | None = None, prompt: Prompt | None = None, owner: str | None = None
    ) -> AsyncIterator[tuple[int, float, bool]]:
        """Hold a slot for the block: yields (slot, seconds waited, chosen by its prefix). ``prompt``:
        the request's prompt (ids or text), for the prefix choice among the slots ``owner`` may
        reuse. Raises QueueFull/QueueTimeout."""
        start = trio.current_time()
        if prompt is not None and not isinstance(prompt, str):
            prompt = tuple(prompt)  # a list's slice never equals a tuple's
        free = self._free(wanted, prompt, owner) if not self.waiters else None
        if free is not None:
            slot, hit = self._take(free[0], prompt), free[1]
        else:
            if len(self.waiters) >= self.max_queue:
                raise QueueFull
            waiter = _Waiter(wanted, prompt, owner)
            self.waiters.append(waiter)
            try:
                with trio.move_on_after(self.timeout_s):
                    await waiter.event.wait()
            except BaseException:  # cancelled while waiting (the client left): no slot may leak
                if waiter.granted is not None:
                    self._release(waiter.granted[0])
                else:
                    self.waiters.remove(waiter)
                raise
            if waiter.granted is None:
                self.waiters.remove(waiter)
                raise QueueTimeout
            slot, hit = waiter.granted
        try:
            yield slot, trio.current_time() - start, hit
        finally:
            self._release(slot)

    async def lease(self, wanted: int | None = None, prompt: Prompt | None = None,
                    owner: str | None = None) -> SlotLease:
        """A slot held past this call, for an answer that outlives its route (a stream): the same
        queueing, refusals and cancellation as ``slot``."""
        hold = AsyncExitStack()
        slot, waited, hit = await hold.enter_async_context(self.slot(wanted, prompt, owner))
        return SlotLease(slot, waited, hold, hit)
