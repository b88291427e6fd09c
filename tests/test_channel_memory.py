"""The Channel protocol's episodic memory: stage/commit/query round trips, the ranking and its
weights, paging, the three statuses, staged turns lost and committed ones kept across a reopen,
client text never read as FTS5 syntax, and the limits, lifecycle and threads. The file's durability
(settings, failed commits, damaged files, SIGKILL) is test_channel_memory_durability.py's."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_harness import ARCHIVE_EMPTY, NO_MATCHES, OK, opened, users

from colibri.sched import memory
from colibri.sched.memory import (
    DEFAULT_TOP_K,
    MAX_TEXT_BYTES,
    MAX_TIMESTAMP,
    MAX_TOP_K,
    MEMORY_FILE,
    EpisodicMemory,
    Recall,
    Turn,
)

NOW = 1_800_000_000_000  # a fixed "now" (unix ms) for the recency tests
HOUR, DAY = 3600_000, 86400_000


# --- round trips ------------------------------------------------------------------------------------


def test_stage_commit_query_round_trip(tmp_path):
    path = tmp_path / "state" / MEMORY_FILE  # the state directory does not exist yet either
    mem, warnings = opened(path)
    mem.stage("what is the capital of France?", "Paris is the capital of France.", 1000)
    mem.stage("and of Italy?", "Rome.", 2000)
    assert mem.staged == 2 and mem.stored == 0
    assert not path.exists()  # the file is created by the first commit
    r = mem.query("capital France", 0)
    assert r.status == OK and r.next_cursor == 0
    assert r.turns == (Turn(0, 1000, "what is the capital of France?", "Paris is the capital of France."),)
    assert mem.commit() == 2
    assert mem.staged == 0 and mem.stored == 2 and path.is_file()
    assert mem.commit() == 0  # nothing staged: nothing to do
    mem.close()
    mem, more = opened(path)
    assert mem.stored == 2
    r = mem.query("Rome", 5)
    assert r.status == OK and r.turns == (Turn(2, 2000, "and of Italy?", "Rome."),)
    mem.close()
    assert warnings == more == []


def test_committed_survive_reopen_staged_do_not(tmp_path):
    path = tmp_path / MEMORY_FILE
    with EpisodicMemory(path) as mem:
        mem.stage("durable kiwi", "yes", 1)
        mem.commit()
        mem.stage("fleeting kiwi", "no", 2)
        r = mem.query("kiwi", 5)
        assert users(r) == ["fleeting kiwi", "durable kiwi"]  # staged turns are searchable
        assert [t.id for t in r.turns] == [0, 1]  # ... and have no id until committed
    # leaving the block closed without committing, as a crash would
    with EpisodicMemory(path) as mem:
        assert mem.staged == 0 and mem.stored == 1
        assert users(mem.query("kiwi", 5)) == ["durable kiwi"]
        assert mem.query("fleeting", 5).status == NO_MATCHES


def test_no_file_until_a_commit(tmp_path):
    path = tmp_path / MEMORY_FILE
    with EpisodicMemory(path) as mem:
        mem.stage("never committed", "gone", 1)
        assert mem.query("committed", 1).status == OK
    assert list(tmp_path.iterdir()) == []


def test_in_memory_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with EpisodicMemory(None) as mem:
        mem.stage("volatile", "kept in memory", 5)
        assert mem.commit() == 1 and mem.stored == 1
        mem.pin(1)
        r = mem.query("volatile", 1)
        assert r.turns == (Turn(1, 5, "volatile", "kept in memory", True),)
    assert list(tmp_path.iterdir()) == []


def test_text_clipped_on_a_character_boundary():
    with EpisodicMemory(None) as mem:
        for n, (char, width) in enumerate((("a", 1), ("é", 2), ("€", 3), ("🦜", 4))):
            head = f"clipword{n} "  # the head is kept, the tail cut
            text = head + char * (MAX_TEXT_BYTES // width + 10)
            mem.stage(text, text, 1)
            (turn,) = mem.query(f"clipword{n}", 1).turns
            # whole characters only: for widths 3 and 4 the one the limit cuts in half is dropped
            assert turn.user == turn.assistant == head + char * ((MAX_TEXT_BYTES - len(head)) // width)
            assert len(turn.user.encode()) <= MAX_TEXT_BYTES
            mem.commit()
        mem.stage("lone \ud800 surrogate", "ok", 1)  # UTF-8 cannot hold it: recorded as "?"
        assert mem.query("surrogate", 1).turns[0].user == "lone ? surrogate"


def test_timestamps():
    with EpisodicMemory(None) as mem:
        before = time.time_ns() // 1_000_000
        mem.stage("default stamp", "now", None)
        mem.stage("huge stamp", "u64 max", 2**64 - 1)
        mem.stage("negative stamp", "clamped", -5)
        after = time.time_ns() // 1_000_000
        assert before <= mem.query("default", 1).turns[0].timestamp <= after
        assert mem.query("huge", 1).turns[0].timestamp == MAX_TIMESTAMP
        assert mem.query("negative", 1).turns[0].timestamp == 0
        assert mem.commit() == 3


# --- ranking ----------------------------------------------------------------------------------------


def test_more_relevant_first():
    with EpisodicMemory(None) as mem:
        mem.stage("a kiwi and mango smoothie", "blend kiwi with mango", 1)
        mem.stage("I like kiwi", "kiwi is a fruit among many other things one could talk about", 2)
        mem.stage("the weather today", "sunny", 3)
        mem.commit()
        r = mem.query("kiwi mango", 5)
        assert users(r) == ["a kiwi and mango smoothie", "I like kiwi"]  # the weather does not match
        r = mem.query("weather", 5, w_vec=1.0, w_temporal=0.5)  # recency alone never adds a non-match
        assert users(r) == ["the weather today"]


def test_recency_weight_picks_the_newer_of_equals():
    with EpisodicMemory(None) as mem:
        mem.stage("tea plans", "green tea", NOW - HOUR)  # stored first: the lower id
        mem.stage("tea plans", "green tea", NOW - 30 * DAY)
        mem.commit()
        plain = mem.query("tea", 2, now=NOW)
        assert [t.timestamp for t in plain.turns] == [NOW - 30 * DAY, NOW - HOUR]  # tie: later stored
        recent = mem.query("tea", 2, now=NOW, w_temporal=1.0)
        assert [t.timestamp for t in recent.turns] == [NOW - HOUR, NOW - 30 * DAY]
        # now 0 (the wire's "unset") or None: the current time
        real = time.time_ns() // 1_000_000
        mem.stage("coffee plans", "espresso", real - HOUR)
        mem.stage("coffee plans", "espresso", real - 30 * DAY)
        for now in (0, None):
            r = mem.query("coffee", 2, now=now, w_temporal=1.0)
            assert [t.timestamp for t in r.turns] == [real - HOUR, real - 30 * DAY]
        # a future turn (clock skew) counts as brand new, not as more than new
        mem.stage("tea plans", "green tea", NOW + DAY)
        assert mem.query("tea", 3, now=NOW, w_temporal=1.0).turns[0].timestamp == NOW + DAY


def test_recency_can_outweigh_relevance():
    with EpisodicMemory(None) as mem:
        mem.stage("rust borrow checker lifetimes", "rust borrow checker lifetimes", NOW - 365 * DAY)
        mem.stage("rust", "a language", NOW - HOUR)
        mem.commit()
        assert users(mem.query("rust borrow checker", 2, now=NOW))[0] == "rust borrow checker lifetimes"
        assert users(mem.query("rust borrow checker", 2, now=NOW, w_temporal=5.0))[0] == "rust"


def test_pinned_weight_picks_the_pinned(tmp_path):
    path = tmp_path / MEMORY_FILE
    with EpisodicMemory(path) as mem:
        mem.stage("budget meeting", "Tuesday", 10)
        mem.stage("budget meeting", "Tuesday", 10)
        mem.commit()
        assert [t.id for t in mem.query("budget", 2, w_pinned=1.0).turns] == [2, 1]
        mem.stage("budget meeting", "Tuesday", 11)
        mem.pin(1)
        assert mem.staged == 1  # pinning commits on its own, the staged turn stays staged
        r = mem.query("budget", 3, w_pinned=1.0)
        assert [(t.id, t.pinned) for t in r.turns] == [(1, True), (0, False), (2, False)]
        assert [t.id for t in mem.query("budget", 3).turns] == [0, 2, 1]  # no weight: no effect
        with pytest.raises(KeyError):
            mem.pin(999)
        with pytest.raises(KeyError):
            mem.pin(0)  # a staged turn's id: nothing stored has it
    with EpisodicMemory(path) as mem:  # the pin was durable, the staged turn was not
        r = mem.query("budget", 3, w_pinned=1.0)
        assert [(t.id, t.pinned) for t in r.turns] == [(1, True), (2, False)]
        mem.pin(1, False)
        assert [t.id for t in mem.query("budget", 2, w_pinned=1.0).turns] == [2, 1]


def test_weights_from_the_wire_never_raise():
    with EpisodicMemory(None) as mem:
        mem.stage("nan weights", "x", 1)
        mem.stage("nan weights", "y", 2)
        for w in (float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 3.4e38):
            r = mem.query("weights", 2, now=2**64 - 1, w_vec=w, w_temporal=w, w_pinned=w)
            assert r.status == OK and len(r.turns) == 2


# --- paging and statuses ----------------------------------------------------------------------------


def test_paging():
    with EpisodicMemory(None) as mem:
        for i in range(7):
            mem.stage(f"page turn {i} " + "lemon " * (i + 1), f"reply {i}", i)
        mem.stage("unrelated", "nothing", 99)
        mem.commit()
        whole = mem.query("lemon", 7)
        assert len(whole.turns) == 7 and whole.next_cursor == 0
        pages, cursor = [], 0
        for expect_next in (3, 6, 0):
            r = mem.query("lemon", 3, cursor)
            assert r.status == OK and r.next_cursor == expect_next
            pages += r.turns
            cursor = r.next_cursor
        assert tuple(pages) == whole.turns  # the pages are the ranking, cut
        assert mem.query("lemon", 3, 7) == Recall(NO_MATCHES, (), 0)  # past the last match
        assert mem.query("lemon", 7, 0).next_cursor == 0  # exactly all: no next page


def test_next_cursor_stays_inside_u16(monkeypatch):
    monkeypatch.setattr(memory, "MAX_CURSOR", 4)
    with EpisodicMemory(None) as mem:
        for i in range(10):
            mem.stage(f"melon {i}", "x", i)
        assert mem.query("melon", 3, 0).next_cursor == 3
        assert mem.query("melon", 3, 3).next_cursor == 0  # 6 is past what the wire can carry


def test_top_k_default_and_cap():
    with EpisodicMemory(None) as mem:
        for i in range(MAX_TOP_K + 45):
            mem.stage(f"cherry {i}", "x", i)
        assert len(mem.query("cherry", 0).turns) == DEFAULT_TOP_K
        r = mem.query("cherry", 1000)
        assert len(r.turns) == MAX_TOP_K and r.next_cursor == MAX_TOP_K
        assert len(mem.query("cherry", 1000, r.next_cursor).turns) == 45
        with pytest.raises(ValueError):
            mem.query("cherry", -1)


def test_statuses(tmp_path):
    with EpisodicMemory(tmp_path / MEMORY_FILE) as mem:
        for q in ("anything", "", '" * )'):
            assert mem.query(q, 3) == Recall(ARCHIVE_EMPTY, (), 0)
        mem.stage("hello there", "general kenobi", 1)
        assert mem.query("hello", 3).status == OK  # staged only: not empty
        assert mem.query("goodbye", 3) == Recall(NO_MATCHES, (), 0)
        for q in ("", "   \n\t", '" * ) ( :', "\x00"):  # no searchable words
            assert mem.query(q, 3) == Recall(NO_MATCHES, (), 0)
        mem.commit()
        assert mem.query("kenobi", 3).status == OK
        assert int(mem.query("kenobi", 3).status) == 0 and int(mem.query("x", 3).status) == 1


# --- client text is never FTS5 syntax ---------------------------------------------------------------

HOSTILE = ['"', '""', '"unbalanced', "*", "app*", "*app", "OR", "AND", "NOT", "OR OR", "a OR", "NEAR(",
           "NEAR(a b, 3)", "NEAR", "NEAR/2", "user:", "assistant: zebra", "{user assistant}: x", "-user: x",
           "user : x", ")", "(", "( )", "(a OR b", "^start", "a + b", "'", "\\", ";", "-- comment",
           "'; DROP TABLE turns; --", "\x00", "a\x00b", "emoji 🦜 ✓", "ǅ Ω ß ﬁ İ", "\u200b", "\ufeff",
           "\n\t\r", "rowid:1", "turns_fts: x", "rank:", "MATCH", "%", "_", "a_b", "x" * 5000,
           "日本語のテキスト", "مرحبا بالعالم", "a\u0301b", "\U0010ffff", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


@pytest.fixture(scope="module")
def hostile_memory():
    with EpisodicMemory(None) as mem:
        for h in HOSTILE:
            mem.stage(h, h, 1)
        mem.commit()
        mem.stage("zebra crossing", "ok", 2)
        mem.stage("only banana here", "yes", 3)
        mem.stage("an apple a day", "keeps", 4)
        mem.stage("this or that", "either", 5)
        mem.stage("say NEAR(kiwi twice", "done", 6)
        yield mem


@pytest.mark.parametrize("text", HOSTILE, ids=[ascii(h)[:30] for h in HOSTILE])
def test_hostile_text_stored_and_queried_literally(hostile_memory, text):
    r = hostile_memory.query(text, 255)
    assert r.status in (OK, NO_MATCHES)
    if any(c.isascii() and c.isalnum() for c in text.replace("\x00", " ")):
        assert r.status == OK and text in users(r)  # it finds itself, stored verbatim (NUL too)


def test_operators_are_plain_words(hostile_memory):
    mem = hostile_memory
    assert "zebra crossing" in users(mem.query("assistant: zebra", 255))  # no column filter
    assert "zebra crossing" in users(mem.query("{assistant}: zebra", 255))
    assert "only banana here" in users(mem.query("apple NOT banana", 255))  # no NOT
    r = users(mem.query("apple AND zebra", 255))
    assert "zebra crossing" in r and "an apple a day" in r  # no AND: any word matches
    assert "this or that" in users(mem.query("OR", 255))  # the word "or"
    assert "say NEAR(kiwi twice" in users(mem.query("NEAR(kiwi", 255))  # the phrase "near kiwi"
    assert "an apple a day" not in users(mem.query("app*", 255))  # no prefix query
    assert mem.query('"', 255).status == NO_MATCHES  # nothing searchable


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=60))
def test_arbitrary_unicode_never_raises(text):
    with EpisodicMemory(None) as mem:
        mem.stage(text, "reply", 1)
        r = mem.query(text, 3)
        assert r.status in (OK, NO_MATCHES)
        if any(c.isascii() and c.isalnum() for c in text):
            assert r.status == OK and r.turns[0].user == text
        mem.commit()
        assert mem.query(text, 3).status == r.status


# --- limits, lifecycle, threads ---------------------------------------------------------------------


def test_staging_is_bounded(monkeypatch):
    monkeypatch.setattr(memory, "MAX_STAGED_TURNS", 3)
    mem, warnings = opened(None)
    for i in range(5):
        mem.stage(f"fig{i} fig", "x", i)
    assert mem.staged == 3 and len(warnings) == 1 and "dropped" in warnings[0]
    assert users(mem.query("fig", 10)) == ["fig4 fig", "fig3 fig", "fig2 fig"]
    assert mem.query("fig0", 10).status == NO_MATCHES
    assert mem.commit() == 3
    mem.close()


def test_closed(tmp_path):
    mem = EpisodicMemory(tmp_path / MEMORY_FILE)
    mem.close()
    mem.close()  # idempotent
    for call in (lambda: mem.stage("a", "b"), mem.commit, lambda: mem.query("a", 1), lambda: mem.pin(1)):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_threads(tmp_path):
    """The session stages on the event loop and commits and queries in worker threads."""
    path = tmp_path / MEMORY_FILE
    mem = EpisodicMemory(path)

    def work(k: int) -> None:
        for i in range(40):
            mem.stage(f"thread{k} grape {i}", "x", i)
            if i % 10 == 9:
                mem.commit()
            mem.query("grape", 3)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mem.commit()
    assert mem.stored == 160 and mem.staged == 0
    mem.close()
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT count(*) FROM turns").fetchone()[0] == 160
