"""The episodic memory's file under failure: the durability settings, a failed commit that keeps its
turns for a retry, an unopenable path, damaged files moved aside with one warning (never an
exception, never overwriting an earlier copy), and only whole committed batches after SIGKILL. The
memory's behaviour with a sound file is test_channel_memory.py's."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from memory_harness import ARCHIVE_EMPTY, opened, users

from colibri.sched import memory
from colibri.sched.memory import MEMORY_FILE, EpisodicMemory, MemoryStoreError

REPO = Path(__file__).resolve().parent.parent


# --- the file's settings ----------------------------------------------------------------------------


def test_durability_settings(tmp_path):
    path = tmp_path / MEMORY_FILE
    with EpisodicMemory(path) as mem:
        mem.stage("a", "b", 1)
        mem.commit()
        assert mem._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert (os.stat(path).st_mode & 0o777) == 0o600  # it holds the conversations
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert c.execute("PRAGMA user_version").fetchone()[0] == memory.SCHEMA_VERSION


# --- failures: commits retried, damaged files moved aside ------------------------------------------


class _CommitFails:
    """A connection whose next COMMIT fails as a full disk would make it."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn, self.failing = conn, True

    def execute(self, sql: str, *args):
        if sql == "COMMIT" and self.failing:
            self.failing = False
            raise sqlite3.OperationalError("database or disk is full")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.conn, name)


def test_failed_commit_keeps_the_staged_turns(tmp_path):
    path = tmp_path / MEMORY_FILE
    with EpisodicMemory(path) as mem:
        mem.stage("first", "one", 1)
        mem.commit()
        mem.stage("second plum", "two", 2)
        mem.stage("third plum", "three", 3)
        mem._conn = _CommitFails(mem._conn)
        with pytest.raises(MemoryStoreError, match="disk is full"):
            mem.commit()
        assert mem.staged == 2 and mem.stored == 1
        assert users(mem.query("plum", 5)) == ["third plum", "second plum"]  # still searchable
        assert mem.commit() == 2 and mem.stored == 3
    with EpisodicMemory(path) as mem:
        assert users(mem.query("plum", 5)) == ["third plum", "second plum"]  # once each
        assert mem.stored == 3


def test_unopenable_path_warns_and_commit_retries(tmp_path):
    path = tmp_path / MEMORY_FILE
    path.mkdir()
    mem, warnings = opened(path)
    assert len(warnings) == 1 and "is a directory" in warnings[0]
    mem.stage("waiting peach", "for a file", 1)
    assert users(mem.query("peach", 1)) == ["waiting peach"]
    with pytest.raises(MemoryStoreError, match="is a directory"):
        mem.commit()
    assert mem.staged == 1 and path.is_dir()  # nothing moved: a directory is not damage
    path.rmdir()
    assert mem.commit() == 1
    mem.close()
    with EpisodicMemory(path) as mem:
        assert users(mem.query("peach", 1)) == ["waiting peach"]


def _valid_file(path: Path, n: int = 3) -> None:
    with EpisodicMemory(path) as mem:
        for i in range(n):
            mem.stage(f"turn {i} " + "filler text " * 80, "reply " * 80, i)
        mem.commit()


def _foreign(path: Path) -> None:
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE accounts (name TEXT)")
        c.execute("INSERT INTO accounts VALUES ('precious')")
    c.close()


def _newer(path: Path) -> None:
    _valid_file(path)
    c = sqlite3.connect(path)
    c.execute("PRAGMA user_version = 99")
    c.close()


def _other_columns(path: Path) -> None:
    c = sqlite3.connect(path)
    c.executescript("CREATE TABLE turns (id INTEGER PRIMARY KEY, text TEXT); "
                    "CREATE VIRTUAL TABLE turns_fts USING fts5(text); CREATE TRIGGER turns_ai AFTER INSERT "
                    "ON turns BEGIN SELECT 1; END; CREATE TRIGGER turns_ad AFTER DELETE ON turns BEGIN "
                    "SELECT 1; END; PRAGMA user_version = 1;")
    c.close()


def _missing_index(path: Path) -> None:
    _valid_file(path)
    c = sqlite3.connect(path)
    c.execute("DROP TABLE turns_fts")
    c.close()


def _torn_pages(path: Path) -> None:
    _valid_file(path, 60)
    size = path.stat().st_size
    assert size > 16 * 4096
    with open(path, "r+b") as f:
        f.seek(4 * 4096)
        f.write(bytes(random.Random(7).randrange(256) for _ in range(8 * 4096)))


DAMAGE = {
    "garbage": (lambda p: p.write_bytes(b"this is not a database\n" * 100), "not a readable SQLite"),
    "sqlite header only": (lambda p: p.write_bytes(b"SQLite format 3\x00" + b"\xff" * 84), "not a readable"),
    "foreign database": (_foreign, "another program"),
    "newer schema": (_newer, "schema version 99 is newer"),
    "other columns": (_other_columns, "other columns"),
    "missing index": (_missing_index, "lacks table turns_fts"),
    "torn pages": (_torn_pages, ""),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_file_moved_aside_with_one_warning(tmp_path, capsys, kind):
    path = tmp_path / MEMORY_FILE
    make, reason = DAMAGE[kind]
    make(path)
    before = path.read_bytes()
    mem = EpisodicMemory(path)  # the default warn: stderr, in the CLI's form
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"colibri: warning: {path}: "), err
    assert reason in err and f"moved aside to {MEMORY_FILE}.damaged," in err and "Traceback" not in err
    aside = tmp_path / (MEMORY_FILE + ".damaged")
    assert aside.read_bytes() == before  # the user's data is kept, byte for byte
    assert mem.query("turn", 3).status == ARCHIVE_EMPTY
    mem.stage("fresh start", "works", 1)
    assert mem.commit() == 1
    mem.close()
    with EpisodicMemory(path) as mem:
        assert users(mem.query("fresh", 3)) == ["fresh start"]
    assert capsys.readouterr().err == ""


def test_earlier_damaged_copies_are_not_overwritten(tmp_path):
    path = tmp_path / MEMORY_FILE
    (tmp_path / (MEMORY_FILE + ".damaged")).write_bytes(b"the first damaged copy")
    path.write_bytes(b"second damage" * 50)
    (tmp_path / (MEMORY_FILE + "-wal")).write_bytes(b"its stale wal")
    mem, warnings = opened(path)
    assert len(warnings) == 1 and f"{MEMORY_FILE}.damaged.1," in warnings[0]
    assert (tmp_path / (MEMORY_FILE + ".damaged")).read_bytes() == b"the first damaged copy"
    assert (tmp_path / (MEMORY_FILE + ".damaged.1")).read_bytes() == b"second damage" * 50
    # SQLite's own files go with it (this one SQLite drops itself: no valid frame): none is left to
    # be played into the fresh archive
    assert not (tmp_path / (MEMORY_FILE + "-wal")).exists()
    mem.close()


def test_empty_file_is_a_fresh_archive(tmp_path):
    path = tmp_path / MEMORY_FILE
    path.touch()  # what a crash right after creating the file leaves
    mem, warnings = opened(path)
    assert warnings == [] and mem.query("x", 1).status == ARCHIVE_EMPTY
    mem.stage("x marks", "the spot", 1)
    mem.commit()
    mem.close()
    with EpisodicMemory(path) as mem:
        assert mem.stored == 1


# --- crash safety under kill -9 ---------------------------------------------------------------------

BATCH = 20  # turns per commit in the child
CRASH_CHILD = r"""
import sys
from pathlib import Path
from colibri.sched.memory import EpisodicMemory
path, batch = Path(sys.argv[1]), int(sys.argv[2])
mem = EpisodicMemory(path)
b = mem.stored // batch
print("ready", flush=True)
while True:
    for i in range(batch):
        text = f"batch{b} turn{i} " + "lorem ipsum dolor " * 60
        mem.stage(text, f"reply{b} " + "sit amet " * 60, b * 1000 + i)
    mem.commit()
    print("committed", b, flush=True)
    b += 1
"""


def _check_whole_batches(path: Path) -> int:
    """The archive holds batches 0..n-1 whole, in order, and an index that agrees; returns n."""
    c = sqlite3.connect(path)
    try:
        if not c.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            return 0  # killed while creating the file, before its schema committed: an empty archive
        rows = c.execute("SELECT id, timestamp, user FROM turns ORDER BY id").fetchall()
        c.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")  # raises if torn
    finally:
        c.close()
    assert len(rows) % BATCH == 0, f"{len(rows)} turns: a torn batch"
    for k, (rowid, ts, user) in enumerate(rows):
        b, i = divmod(k, BATCH)
        assert (rowid, ts) == (k + 1, b * 1000 + i) and user.startswith(f"batch{b} turn{i} "), (k, rowid, ts)
    return len(rows) // BATCH


def test_sigkill_leaves_whole_committed_batches(tmp_path):
    path = tmp_path / MEMORY_FILE
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    batches = 0
    for kill in range(8):
        child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(path), str(BATCH)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"ready\n", child.stderr.read().decode()
            time.sleep(rng.uniform(0.005, 0.06))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        out = child.stdout.read().decode().split()
        err = child.stderr.read().decode()
        child.stdout.close()
        child.stderr.close()
        assert err == "", err  # no warning: a killed writer leaves nothing that looks damaged
        done = [int(w) for w in out[1::2]]
        assert done == list(range(batches, batches + len(done)))  # it went on from what it found
        acknowledged = batches + len(done)
        now = _check_whole_batches(path) if path.exists() else 0
        # every acknowledged commit is there, and at most one more (committed, killed before its print)
        assert acknowledged <= now <= acknowledged + 1, f"kill {kill} (seed {seed}): {now} {acknowledged}"
        batches = now
    assert batches > 0, f"seed {seed}: no commit before any kill"
    mem, warnings = opened(path)
    assert warnings == [] and mem.stored == batches * BATCH and mem.staged == 0
    last = mem.query(f"batch{batches - 1}", BATCH)
    assert sorted(t.timestamp for t in last.turns) == [(batches - 1) * 1000 + i for i in range(BATCH)]
    mem.close()
