"""The Channel protocol's episodic memory: finished turns, staged, committed, recalled (MEM_QUERY,
MEM_COMMIT, MEM_RESPONSE in docs/channel_protocol.md).

The session stages each finished turn (the user's text, the assistant's reply, a timestamp);
MEM_COMMIT makes the staged turns durable; MEM_QUERY ranks the turns against a query text and the
session injects the best into the model's context. The archive is a SQLite file with an FTS5 index;
the file itself (durability settings, schema check, damaged files moved aside, creation 0o600) is
``memory_file``'s. A commit is durable when it returns, and a kill -9 loses exactly the turns staged
since the last commit.

- Staging: staged turns are rows inserted in one open write transaction, so a query ranks them with
  the stored ones under the same bm25 statistics; ``commit()`` is that transaction's COMMIT. Their
  Python copies are the truth: a failed commit rolls back, keeps them and re-inserts them later.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from colibri.io.channel_frames import MemStatus
from colibri.sched.memory_file import (
    BUSY_TIMEOUT_S,
    MAX_ASIDE_NAMES,
    SCHEMA_VERSION,
    MemoryStoreError,
    connect,
    open_store,
    prepare,
)
from colibri.sched.persist import Warn, warn_stderr

# The public names, those of memory_file re-exported: callers import everything from here.
__all__ = [
    "BUSY_TIMEOUT_S", "DEFAULT_TOP_K", "MAX_ASIDE_NAMES", "MAX_CANDIDATES", "MAX_CURSOR", "MAX_QUERY_TERMS",
    "MAX_STAGED_TURNS", "MAX_TEXT_BYTES", "MAX_TIMESTAMP", "MAX_TOP_K", "MEMORY_FILE", "RECENCY_HALF_LIFE_MS",
    "SCHEMA_VERSION", "EpisodicMemory", "MemoryStoreError", "Recall", "Turn",
]

MEMORY_FILE = "channel_memory.sqlite3"  # in the engine's state directory

# Each side of a turn is cut to this many UTF-8 bytes (on a character boundary, keeping the head):
# a recalled turn goes into the model's context whole, and no context holds many turns longer than
# this; it also bounds the file's growth per turn and the cost of ranking it.
MAX_TEXT_BYTES = 64 << 10
DEFAULT_TOP_K = 3  # top_k 0 on the wire: a few turns inform the reply without crowding the context
MAX_TOP_K = 255  # MEM_RESPONSE's injected_count is a u8
MAX_CURSOR = 0xFFFF  # cursor and next_cursor are u16: a page past this cannot be asked for
# Ranking deeper than the last page the wire can address is wasted work: only this many of the best
# text matches are scored (the weights then order them), however many turns match.
MAX_CANDIDATES = MAX_CURSOR + MAX_TOP_K
# Distinct words of a query used for matching: a long paragraph fits; a 64 MiB payload would
# otherwise build an FTS5 expression of millions of phrases, each one index lookup.
MAX_QUERY_TERMS = 256
# Turns staged without a MEM_COMMIT before the oldest are dropped (with a warning): a host that
# never commits must not grow the engine without bound. 1024 turns is a long conversation; at the
# worst, 1024 x 2 x 64 KiB = 128 MiB, held twice (the Python copy and the open transaction).
MAX_STAGED_TURNS = 1024
# Recency halves every week: conversations resume over days, so last week's turn still counts
# half and last season's next to nothing.
RECENCY_HALF_LIFE_MS = 7 * 24 * 3600 * 1000
# SQLite integers are signed 64-bit; the wire's u64 timestamps are clamped into [0, this].
MAX_TIMESTAMP = 2**63 - 1

_INSERT = "INSERT INTO turns (timestamp, user, assistant, pinned) VALUES (?, ?, ?, ?)"
# The best text matches (rank is bm25, lower is better), with what the weights need.
_CANDIDATES = """
SELECT t.id, t.timestamp, t.pinned, m.rank
FROM (SELECT rowid AS id, rank FROM turns_fts WHERE turns_fts MATCH ? ORDER BY rank LIMIT ?) AS m
JOIN turns AS t ON t.id = m.id
"""


@dataclass(frozen=True)
class Turn:
    id: int  # rowid once stored; 0 while staged
    timestamp: int  # unix milliseconds (u64 on the wire)
    user: str
    assistant: str
    pinned: bool = False


@dataclass(frozen=True)
class Recall:
    status: int  # MemStatus: 0 ok, 1 no matches, 2 archive empty
    turns: tuple[Turn, ...]  # best first, at most top_k
    next_cursor: int  # cursor for the next page of the same ranking; 0 when there is none


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _clamp_timestamp(ts: int) -> int:
    return min(max(int(ts), 0), MAX_TIMESTAMP)


def _clip(text: str) -> str:
    """``text`` cut to MAX_TEXT_BYTES of UTF-8 on a character boundary. Lone surrogates (which
    UTF-8 cannot hold) become "?": a turn is recorded rather than refused."""
    if not isinstance(text, str):
        raise TypeError(f"turn text must be str, not {type(text).__name__}")
    if text.isascii():  # one byte a character, no surrogates
        return text[:MAX_TEXT_BYTES]
    raw = text.encode("utf-8", "replace")
    if len(raw) <= MAX_TEXT_BYTES:
        return raw.decode("utf-8")
    return raw[:MAX_TEXT_BYTES].decode("utf-8", "ignore")  # drops only a character cut in half


def _match_expression(text: str) -> str | None:
    """An FTS5 query that matches ``text`` literally: each whitespace-separated word is quoted as a
    phrase (FTS5's tokenizer then splits it exactly as it split the stored text), the phrases
    joined by OR. Nothing in the client's text is FTS5 syntax: ``"`` is doubled inside the quotes,
    and operators, ``*``, ``NEAR(``, ``^``, parentheses and column filters are plain words. None if
    the text has no words; a word with nothing searchable is a phrase that matches nothing."""
    phrases: list[str] = []
    seen: set[str] = set()
    for word in _clip(text).replace("\0", " ").split():  # NUL would end FTS5's string early
        key = word.casefold()
        if key in seen:
            continue
        seen.add(key)
        phrases.append('"' + word.replace('"', '""') + '"')
        if len(phrases) == MAX_QUERY_TERMS:
            break
    return " OR ".join(phrases) or None


def _finite(w: float) -> float:
    """A weight from the wire (f32): NaN or infinity would make the order undefined, so they are 0."""
    w = float(w)
    return w if math.isfinite(w) else 0.0


class EpisodicMemory:
    """The archive of finished turns, with the turns staged since the last commit.

    Thread-safe (one lock); the methods block on SQLite (commit on an fsync), so the session calls
    the slow ones from a worker thread. ``path`` None keeps everything in memory (--no-persist).
    """

    def __init__(self, path: Path | None, *, warn: Warn = warn_stderr) -> None:
        self._path = None if path is None else Path(path)
        self._warn = warn
        self._lock = threading.RLock()
        self._staged: list[Turn] = []  # the truth about staged turns
        self._rowids: list[int] = []  # rowids of the first len() staged turns, inserted uncommitted
        self._overflow_warned = False
        self._stored = 0
        # Until the file is open (it does not exist yet, or cannot be opened now), ``_conn`` is an
        # in-memory database holding only the staged turns, and each commit tries the file again.
        self._file_open = False
        conn: sqlite3.Connection | None = None
        if self._path is not None:
            try:
                conn = open_store(self._path, warn, create=False)
            except MemoryStoreError as e:
                warn(f"{e}; the episodic memory is not persisted until a commit can open it")
        if conn is None:
            conn = connect(":memory:")
            try:
                prepare(conn, durable=False)
            except sqlite3.Error as e:  # this Python's SQLite has no FTS5
                conn.close()
                raise MemoryStoreError(f"episodic memory: SQLite cannot create its index: {e}") from None
        else:
            self._file_open = True
            self._stored = conn.execute("SELECT count(*) FROM turns").fetchone()[0]
        self._conn: sqlite3.Connection | None = conn

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close without committing: the staged turns are dropped, as a crash would drop them."""
        with self._lock:
            if self._conn is None:
                return
            self._drop_mirror()
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None

    def __enter__(self) -> EpisodicMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError("the episodic memory is closed")
        return self._conn

    @property
    def _where(self) -> str:
        return str(self._path) if self._path is not None else "episodic memory"

    # -- the staged turns ----------------------------------------------------------------------------

    @property
    def staged(self) -> int:
        """Turns staged since the last commit: lost if the engine stops before the next one."""
        return len(self._staged)

    @property
    def stored(self) -> int:
        """Committed turns in the archive. Lock-free (a plain int): STATUS reads it on the event
        loop while a commit may be running in a worker thread."""
        return self._stored

    def stage(self, user: str, assistant: str, timestamp: int | None = None) -> None:
        """Record a finished turn (``timestamp`` in unix ms, default now). It is searchable at once
        and durable after the next ``commit()``. Never raises for the store: a turn whose insert
        fails is kept in the staging buffer and inserted again by the next query or commit."""
        ts = _now_ms() if timestamp is None else _clamp_timestamp(timestamp)
        turn = Turn(0, ts, _clip(user), _clip(assistant))
        with self._lock:
            conn = self._open_conn()
            if len(self._staged) >= MAX_STAGED_TURNS:
                self._staged.pop(0)
                if self._rowids:
                    try:
                        conn.execute("DELETE FROM turns WHERE id = ?", (self._rowids.pop(0),))
                    except sqlite3.Error:
                        self._drop_mirror()
                if not self._overflow_warned:
                    self._overflow_warned = True
                    self._warn(f"{self._where}: {MAX_STAGED_TURNS} turns staged without a commit; "
                               "the oldest uncommitted turns are being dropped")
            self._staged.append(turn)
            try:
                self._sync_mirror()
            except MemoryStoreError:
                pass  # kept in _staged; the next query or commit inserts it again (or reports why not)

    def _sync_mirror(self) -> None:
        """Insert the staged turns not yet in the open transaction (beginning it if needed)."""
        todo = self._staged[len(self._rowids):]
        if not todo:
            return
        conn = self._open_conn()
        try:
            if not self._rowids:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.execute("BEGIN IMMEDIATE")
            for t in todo:
                self._rowids.append(conn.execute(_INSERT, (t.timestamp, t.user, t.assistant, 0)).lastrowid)
        except sqlite3.Error as e:
            self._drop_mirror()
            raise MemoryStoreError(f"{self._where}: cannot stage turns: {e}") from None

    def _drop_mirror(self) -> None:
        """Roll the staged rows back (their Python copies stay staged)."""
        self._rowids.clear()
        conn = self._conn
        if conn is not None and conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite ends the transaction on a failed rollback too

    def commit(self) -> int:
        """Write the staged turns in one transaction, durable when this returns; how many. On
        failure MemoryStoreError, and the turns stay staged for a later commit to retry."""
        with self._lock:
            conn = self._open_conn()
            n = len(self._staged)
            if n == 0:
                return 0
            if self._path is not None and not self._file_open:
                self._commit_to_file()
            else:
                self._sync_mirror()
                try:
                    conn.execute("COMMIT")
                except sqlite3.Error as e:
                    self._drop_mirror()
                    raise MemoryStoreError(f"{self._where}: commit failed: {e}") from None
            self._staged.clear()
            self._rowids.clear()
            self._overflow_warned = False
            self._stored += n
            return n

    def _commit_to_file(self) -> None:
        """The first commit: open (create) the file, write the staged turns there, switch to it."""
        assert self._path is not None
        conn = open_store(self._path, self._warn, create=True)
        assert conn is not None
        try:
            stored = conn.execute("SELECT count(*) FROM turns").fetchone()[0]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(_INSERT, [(t.timestamp, t.user, t.assistant, 0) for t in self._staged])
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            conn.close()
            raise MemoryStoreError(f"{self._path}: commit failed: {e}") from None
        self._drop_mirror()
        old, self._conn, self._file_open, self._stored = self._conn, conn, True, stored
        if old is not None:
            old.close()

    # -- stored turns --------------------------------------------------------------------------------

    def pin(self, turn_id: int, pinned: bool = True) -> None:
        """Pin (or unpin) a stored turn, durably at once; KeyError if there is no such stored turn
        (staged turns have no id yet)."""
        with self._lock:
            conn = self._open_conn()
            self._drop_mirror()  # the pin commits on its own; the staged rows are inserted again after
            try:
                conn.execute("BEGIN IMMEDIATE")
                updated = conn.execute("UPDATE turns SET pinned = ? WHERE id = ?",
                                       (int(bool(pinned)), int(turn_id))).rowcount
                conn.execute("COMMIT" if updated else "ROLLBACK")
            except sqlite3.Error as e:
                self._drop_mirror()
                raise MemoryStoreError(f"{self._where}: cannot pin turn {turn_id}: {e}") from None
            finally:
                try:
                    self._sync_mirror()
                except MemoryStoreError:
                    pass  # as in stage(): inserted again by the next query or commit
            if not updated:
                raise KeyError(turn_id)

    def query(self, text: str, top_k: int, cursor: int = 0, now: int | None = None,
              w_vec: float = 1.0, w_temporal: float = 0.0, w_pinned: float = 0.0) -> Recall:
        """The turns best matching ``text``, stored and staged, page ``cursor`` of the ranking.

        Candidates are the turns sharing a word with ``text`` (matched literally, see
        _match_expression). Each scores ``w_vec * relevance + w_temporal * recency + w_pinned *
        pinned``: relevance is FTS5's bm25 over both sides of the turn, divided by the best match's
        (so in (0, 1]); there is no embedding model, so ``w_vec`` weighs this text relevance.
        Recency is 0.5 ** (age / RECENCY_HALF_LIFE_MS), age counted back from ``now`` (unix ms; 0 or
        None: the current time), in [0, 1]; pinned is 1.0 for a pinned turn. Equal scores: the later
        stored turn first. ``top_k`` 0 means DEFAULT_TOP_K; it is capped at MAX_TOP_K. A page past
        the last match is NO_MATCHES. Storage failures raise MemoryStoreError.
        """
        if top_k < 0 or cursor < 0:
            raise ValueError(f"top_k {top_k} and cursor {cursor} must not be negative")
        k = DEFAULT_TOP_K if top_k == 0 else min(top_k, MAX_TOP_K)
        now = _now_ms() if not now else _clamp_timestamp(now)
        w_vec, w_temporal, w_pinned = _finite(w_vec), _finite(w_temporal), _finite(w_pinned)
        match = _match_expression(text)
        with self._lock:
            conn = self._open_conn()
            self._sync_mirror()
            try:
                if conn.execute("SELECT NOT EXISTS (SELECT 1 FROM turns)").fetchone()[0]:
                    return Recall(MemStatus.ARCHIVE_EMPTY, (), 0)
                rows = [] if match is None else conn.execute(_CANDIDATES, (match, MAX_CANDIDATES)).fetchall()
                if not rows:
                    return Recall(MemStatus.NO_MATCHES, (), 0)
                best = max(-rank for _, _, _, rank in rows)
                scored = []
                for turn_id, ts, pinned, rank in rows:
                    relevance = -rank / best if best > 0 else 1.0
                    recency = 0.5 ** (max(0, now - ts) / RECENCY_HALF_LIFE_MS)
                    score = w_vec * relevance + w_temporal * recency + w_pinned * (1.0 if pinned else 0.0)
                    scored.append((-score, -turn_id))
                scored.sort()
                page = [-neg_id for _, neg_id in scored[cursor : cursor + k]]
                if not page:
                    return Recall(MemStatus.NO_MATCHES, (), 0)
                marks = ",".join("?" * len(page))
                found = {r[0]: r for r in conn.execute(
                    f"SELECT id, timestamp, user, assistant, pinned FROM turns WHERE id IN ({marks})",
                    page).fetchall()}
            except sqlite3.Error as e:
                raise MemoryStoreError(f"{self._where}: query failed: {e}") from None
            staged = set(self._rowids)
            turns = tuple(Turn(0 if i in staged else i, ts, user, assistant, bool(pinned))
                          for i, ts, user, assistant, pinned in (found[i] for i in page))
        end = cursor + len(turns)
        return Recall(MemStatus.OK, turns, end if end < len(scored) and end <= MAX_CURSOR else 0)
