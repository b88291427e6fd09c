"""The episodic memory's file: opening it, checking its schema, moving a damaged one aside, and the
SQLite settings that make a commit durable.

Kept apart from ``memory`` (staging, commits, ranking) because none of this depends on how turns
are staged or ranked: it decides only whether a file at a path is an archive this build can trust,
and what to do when it is not. ``memory`` calls ``open_store`` (the file, checked),
``connect`` and ``prepare`` (an in-memory archive for --no-persist and for the turns staged before
the file exists). ``MemoryStoreError`` is defined here, since opening the file raises it, and
re-exported by ``memory``, where callers import it from.

- Durability: WAL with ``synchronous=FULL`` (each commit's WAL frames are fsynced before it
  returns; SQLite's docs: durable across power loss in WAL mode), so the file is only ever in a
  committed state and a kill -9 loses exactly the turns staged since the last commit. Where WAL
  cannot work (a file system without shared memory) the rollback journal with ``synchronous=EXTRA``
  (FULL plus the directory sync after the journal's unlink that makes DELETE mode durable).
- Damage: a file that is not SQLite, fails its integrity check or has another schema is moved aside
  (``<name>.damaged``) with one warning and the memory starts empty; nothing is deleted.
- The file is created by the first commit (an engine that never commits leaves no file), 0o600:
  it holds the conversations.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

from colibri.sched.persist import Warn

# PRAGMA user_version of the schema below. Another version is moved aside, never migrated in place:
# there is only one so far, and a migration written later must not find its input overwritten.
SCHEMA_VERSION = 1
# How long a statement waits for a lock another process holds (a second engine on the same state
# directory) before it fails: long enough for that one's commit, short enough not to hang a turn.
BUSY_TIMEOUT_S = 2.0
# Names tried for a damaged file (<name>.damaged, <name>.damaged.1, ...): earlier ones are never
# overwritten; past this many, the file is left in place and the memory is not persisted.
MAX_ASIDE_NAMES = 100

_SQLITE_CORRUPT = 11  # primary result codes that mean the file's content is damaged
_SQLITE_NOTADB = 26
# Beside the database, SQLite's own files: they belong to it and move aside with it.
_COMPANIONS = ("-wal", "-shm", "-journal")
_COLUMNS = ["id", "timestamp", "user", "assistant", "pinned"]
_FTS_COLUMNS = ["user", "assistant"]
_OBJECTS = {("table", "turns"), ("table", "turns_fts"), ("trigger", "turns_ai"), ("trigger", "turns_ad")}

# The FTS5 index is an external-content table over ``turns`` (the text is stored once), kept in
# step by triggers; ``pinned`` is not indexed, so pinning needs no index update.
_SCHEMA = f"""
BEGIN IMMEDIATE;
CREATE TABLE turns (
    id INTEGER PRIMARY KEY,
    timestamp INTEGER NOT NULL,
    user TEXT NOT NULL,
    assistant TEXT NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1))
);
CREATE VIRTUAL TABLE turns_fts USING fts5(user, assistant, content='turns', content_rowid='id',
                                          tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER turns_ai AFTER INSERT ON turns BEGIN
    INSERT INTO turns_fts(rowid, user, assistant) VALUES (new.id, new.user, new.assistant);
END;
CREATE TRIGGER turns_ad AFTER DELETE ON turns BEGIN
    INSERT INTO turns_fts(turns_fts, rowid, user, assistant)
        VALUES ('delete', old.id, old.user, old.assistant);
END;
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""


class MemoryStoreError(OSError):
    """The archive could not be read or written (disk full, unopenable file, lock held elsewhere).
    Staged turns are kept: a later commit retries them."""


class _Damaged(Exception):
    """The file is not a colibri memory we can trust; the message is the reason shown to the user."""


def _is_damage(e: sqlite3.Error) -> bool:
    return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def _fsync_dir(path: Path) -> None:
    """Make a creation or rename inside ``path`` durable: the entry lives in the directory's data."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def connect(target: str) -> sqlite3.Connection:
    # Autocommit mode: every transaction is an explicit BEGIN ... COMMIT of ours. Any thread may use
    # the connection (the session calls from trio's worker threads); EpisodicMemory's lock serializes.
    return sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)


def _set_durability(conn: sqlite3.Connection) -> str:
    """WAL + FULL, or the rollback journal + EXTRA where WAL is refused; the journal mode set."""
    mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
    if mode != "wal":
        mode = str(conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0]).lower()
    conn.execute(f"PRAGMA synchronous = {'FULL' if mode == 'wal' else 'EXTRA'}")
    # macOS: fsync does not flush the drive's cache, F_FULLFSYNC does (a no-op elsewhere).
    conn.execute("PRAGMA fullfsync = ON")
    conn.execute("PRAGMA checkpoint_fullfsync = ON")
    return mode


def prepare(conn: sqlite3.Connection, durable: bool) -> None:
    """Check an opened database is our schema (or empty: create it); _Damaged if it is not."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]  # the first read: NOTADB here
    objects = {(t, n) for t, n in conn.execute("SELECT type, name FROM sqlite_master").fetchall()}
    if version == 0 and not objects:  # new, or a crash before the schema's transaction committed
        if durable:
            _set_durability(conn)
        try:
            conn.executescript(_SCHEMA)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return
    if version == 0:
        raise _Damaged("a SQLite database of another program (no colibri schema version)")
    if version != SCHEMA_VERSION:
        relation = "newer" if version > SCHEMA_VERSION else "older"
        raise _Damaged(f"schema version {version} is {relation} than this build's {SCHEMA_VERSION}")
    missing = _OBJECTS - objects
    if missing:
        raise _Damaged("schema lacks " + ", ".join(sorted(f"{t} {n}" for t, n in missing)))
    if [r[1] for r in conn.execute("PRAGMA table_info(turns)").fetchall()] != _COLUMNS or [
            r[1] for r in conn.execute("PRAGMA table_info(turns_fts)").fetchall()] != _FTS_COLUMNS:
        raise _Damaged("its tables have other columns than this build's schema")
    # O(file size), once at start: a damaged page is reported now, not in the middle of a session.
    check = conn.execute("PRAGMA quick_check").fetchall()
    if [r[0] for r in check] != ["ok"]:
        raise _Damaged(f"fails SQLite's integrity check ({check[0][0]})")
    if durable:
        _set_durability(conn)


def _move_aside(path: Path, reason: str) -> Path:
    """Rename the file and SQLite's files beside it to the first free ``.damaged`` name (a journal
    left next to a fresh database would be played into it); MemoryStoreError if that fails."""
    for i in range(MAX_ASIDE_NAMES):
        aside = path.with_name(path.name + (".damaged" if i == 0 else f".damaged.{i}"))
        if not any(os.path.lexists(str(aside) + s) for s in ("", *_COMPANIONS)):
            break
    else:
        raise MemoryStoreError(f"{path}: {reason}, and {MAX_ASIDE_NAMES} damaged copies lie beside it")
    try:
        for suffix in ("", *_COMPANIONS):
            if os.path.lexists(str(path) + suffix):
                os.rename(str(path) + suffix, str(aside) + suffix)
        _fsync_dir(path.parent)
    except OSError as e:
        raise MemoryStoreError(f"{path}: {reason}, and it cannot be moved aside: {e.strerror or e}") from None
    return aside


def _create_file(path: Path) -> None:
    """An empty file (an empty SQLite database) readable by its owner only; SQLite's WAL and shm
    files copy its mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.close(fd)
    _fsync_dir(path.parent)


def open_store(path: Path, warn: Warn, create: bool) -> sqlite3.Connection | None:
    """The archive at ``path``, checked (a damaged one moved aside with one warning); None if there
    is no file and ``create`` is false. MemoryStoreError if it cannot be opened (not a regular file,
    no permission, locked, this SQLite lacks FTS5): nothing is moved for those."""
    for _ in range(2):  # a second round only after moving a damaged file aside
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not create:
                return None
            try:
                _create_file(path)
            except FileExistsError:
                continue
            except OSError as e:
                raise MemoryStoreError(f"{path}: cannot create: {e.strerror or e}") from None
        except OSError as e:
            raise MemoryStoreError(f"{path}: cannot open: {e.strerror or e}") from None
        else:
            if not stat.S_ISREG(st.st_mode):
                what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise MemoryStoreError(f"{path}: is {what}")
        conn: sqlite3.Connection | None = None
        try:
            conn = connect(str(path))
            prepare(conn, durable=True)
            return conn
        except (_Damaged, sqlite3.Error) as e:
            if conn is not None:
                conn.close()
            if isinstance(e, sqlite3.Error) and not _is_damage(e):
                raise MemoryStoreError(f"{path}: cannot open: {e}") from None
            reason = str(e) if isinstance(e, _Damaged) else f"not a readable SQLite database ({e})"
        aside = _move_aside(path, reason)
        warn(f"{path}: {reason}; moved aside to {aside.name}, the episodic memory starts empty")
    raise MemoryStoreError(f"{path}: damaged again right after a fresh start")
