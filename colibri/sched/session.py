"""What the process skeleton (``engine_process.py``) asks of a protocol's session: the mux, legacy
and Channel sessions each own their frames, their writer's encoding and their extras, over one
``Engine``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

# The next bytes of the host's input (b"" at EOF).
Receive = Callable[[], Awaitable[bytes]]


class Session(Protocol):
    async def open(self) -> None:
        """What the host sees first, once the slots are restored (READY, STATUS idle)."""

    async def read(self, receive: Receive) -> int:
        """The host's input until EOF or the end the protocol defines; the process's exit status.
        Cancelled on SIGTERM (the skeleton then closes the session as after EOF)."""

    async def close(self, status: int) -> None:
        """Reading has stopped: end the session's own work before in-flight requests drain."""
