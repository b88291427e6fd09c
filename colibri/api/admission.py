"""Admission: requests take a KV slot or wait for one in a bounded FIFO queue, for a bounded time.

A request names a slot (``cache_slot``) or takes any free one. Waiters are served first come,
first served among those whose slot is free; a full queue or a wait past the timeout is refused
(the server answers 429 before any streaming header is sent).

A streamed answer outlives the route that admitted it, so the slot is held by a ``SlotLease``
that whoever ends the answer releases, rather than by a ``with`` block in the route.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiters already."""


class QueueTimeout(Exception):
    """No slot came free within ``timeout_s``."""


@dataclass(eq=False)
class _Waiter:
    wanted: int | None
    granted: int | None = None
    event: trio.Event = field(default_factory=trio.Event)


class SlotLease:
    """A slot taken from ``Admission``, until ``release`` (or the end of an ``async with``)."""

    def __init__(self, slot: int, waited: float, hold: AsyncExitStack) -> None:
        self.slot, self.waited, self._hold = slot, waited, hold

    async def release(self) -> None:
        """Give the slot back; shielded, so a cancelled caller cannot leak it. Idempotent."""
        with trio.CancelScope(shield=True):
            await self._hold.aclose()

    async def __aenter__(self) -> SlotLease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


class Admission:
    def __init__(self, n_slots: int, max_queue: int, timeout_s: float) -> None:
        self.n_slots, self.max_queue, self.timeout_s = n_slots, max_queue, timeout_s
        self.busy = [False] * n_slots
        self.waiters: deque[_Waiter] = deque()
        self.last_used = list(range(n_slots))  # least recently used first: spreads the KV reuse

    @property
    def active(self) -> int:
        return sum(self.busy)

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def _free(self, wanted: int | None) -> int | None:
        if wanted is not None:
            return None if self.busy[wanted] else wanted
        return next((s for s in self.last_used if not self.busy[s]), None)

    def _take(self, slot: int) -> int:
        self.busy[slot] = True
        self.last_used.remove(slot)
        self.last_used.append(slot)
        return slot

    def _release(self, slot: int) -> None:
        self.busy[slot] = False
        for waiter in list(self.waiters):
            free = self._free(waiter.wanted)
            if free is not None:
                self.waiters.remove(waiter)
                waiter.granted = self._take(free)
                waiter.event.set()

    @asynccontextmanager
    async def slot(self, wanted: int | None = None) -> AsyncIterator[tuple[int, float]]:
        """Hold a slot for the block: yields (slot, seconds waited). Raises QueueFull/QueueTimeout."""
        start = trio.current_time()
        free = self._free(wanted) if not self.waiters else None
        if free is not None:
            slot = self._take(free)
        else:
            if len(self.waiters) >= self.max_queue:
                raise QueueFull
            waiter = _Waiter(wanted)
            self.waiters.append(waiter)
            try:
                with trio.move_on_after(self.timeout_s):
                    await waiter.event.wait()
            except BaseException:  # cancelled while waiting (the client left): no slot may leak
                if waiter.granted is not None:
                    self._release(waiter.granted)
                else:
                    self.waiters.remove(waiter)
                raise
            if waiter.granted is None:
                self.waiters.remove(waiter)
                raise QueueTimeout
            slot = waiter.granted
        try:
            yield slot, trio.current_time() - start
        finally:
            self._release(slot)

    async def lease(self, wanted: int | None = None) -> SlotLease:
        """A slot held past this call, for an answer that outlives its route (a stream): the same
        queueing, refusals and cancellation as ``slot``."""
        hold = AsyncExitStack()
        slot, waited = await hold.enter_async_context(self.slot(wanted))
        return SlotLease(slot, waited, hold)
