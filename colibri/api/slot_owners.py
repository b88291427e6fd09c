"""Whose conversation each KV slot holds, so that only that client reuses it.

A slot's cache answers a question about its content: a request reuses the prefix it shares with
the slot's history, and says how much (``reused_tokens``; the prefill's time says it too). A client
that could pin another's slot could guess that conversation a token at a time. So a request reuses
a slot's history only when the slot's owner is the request's: the ``X-Session-Id`` it sent, or no
one for requests without one (they share, as one client: docs/deploy.md). Any other request gets
the slot forgotten first (mux ``FORGET``: its next request reuses nothing).

The owner is known for sure only once the slot's content is the new owner's. Between a FORGET and
the end of the new owner's turn the slot is ``UNKNOWN``, which matches no one, and so it stays if
that turn's end did not leave the new content on disk: a crash in between (the engine restarted,
restoring the old file; the server restarted, reading this table) can never hand the old content
to the new owner. With a state directory the table is a file there, rewritten (atomically, never
through a link) when an owner changes; missing or unreadable, every slot is ``UNKNOWN``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import trio

from colibri import state_files

OWNERS_FILE = ".coli_owners"  # beside the engine's slot files, whose content it describes
_TEMP = OWNERS_FILE + ".tmp"
ANONYMOUS = ""  # requests without a session id: one client, as far as the cache goes
UNKNOWN = "?"  # content whose owner is not known for sure: reusable by no one
# The table is a hash per slot (16 slots at most): anything bigger is not ours.
MAX_OWNERS_BYTES = 4096


def owner_of(session_id: str | None) -> str:
    """A request's owner: its session id, hashed (the id is the client's secret; the file on disk
    and the server's memory keep only its hash)."""
    return ANONYMOUS if not session_id else hashlib.sha256(session_id.encode()).hexdigest()


class SlotOwners:
    def __init__(self, n_slots: int, state_dir: Path | None) -> None:
        self.path = state_dir / OWNERS_FILE if state_dir is not None else None
        # Without persistence every slot starts empty: nobody's content, anyone may take it.
        self.tags = [ANONYMOUS] * n_slots if self.path is None else self._load(n_slots)
        self._lock = trio.Lock()  # one rewrite of the file at a time

    def reusable(self, slot: int, owner: str) -> bool:
        return self.tags[slot] == owner

    async def claim(self, slot: int, owner: str) -> bool:
        """The slot taken by ``owner``'s request; True: it must be forgotten first."""
        if self.tags[slot] == owner:
            return False
        if self.tags[slot] != UNKNOWN:
            self.tags[slot] = UNKNOWN
            await self._save()  # before the FORGET: a crash from here on leaves it UNKNOWN
        return True

    async def settle(self, slot: int, owner: str, saved: bool | None) -> None:
        """``owner``'s turn in a claimed slot has ended; ``saved``: the engine wrote the slot's file
        (its DONE said so). Only then is the content, in memory and on disk, the owner's."""
        if self.tags[slot] == UNKNOWN and (saved or self.path is None):
            self.tags[slot] = owner
            await self._save()

    def _load(self, n_slots: int) -> list[str]:
        try:
            raw = state_files.read_regular(self.path, MAX_OWNERS_BYTES) if self.path else None
            tags = json.loads(raw) if raw is not None else None
        except (OSError, ValueError, state_files.Refused):
            tags = None
        if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            return [UNKNOWN] * n_slots
        return [tags[i] if i < len(tags) else UNKNOWN for i in range(n_slots)]

    async def _save(self) -> None:
        if self.path is None:
            return
        data = json.dumps(self.tags).encode()
        async with self._lock:
            try:
                await trio.to_thread.run_sync(self._write, data)
            except OSError as e:  # the table in memory still holds: only a crash could cost
                print(f"colibri: warning: {self.path} not written: {e}", file=sys.stderr, flush=True)

    def _write(self, data: bytes) -> None:
        assert self.path is not None
        with state_files.replacing(self.path, self.path.with_name(_TEMP)) as f:
            f.write(data)
