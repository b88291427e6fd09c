"""A DONE says whether its turn was saved, and the server reports a failed save (docs/persistence.md).

Saves are made to fail by ``break_saves``: the state directory goes read-only (0o500), and since
root ignores file modes (these tests may run as root), a directory is also put where each save's
temp file goes (``.coli_kv.tmp``...): ``open(O_WRONLY | O_CREAT)`` of a directory fails with EISDIR
for root too, at the very call a read-only directory fails (EACCES), and the state directory itself
stays in place, so ``mend_saves`` undoes it all.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from engine_harness import EngineProcess, chat_prompt, engine_args
from serve_harness import running_server, server_env, user

from colibri.io.events import Done
from colibri.sched import persist

SLOTS = 2
DEGRADED_REASON = "the last turn's KV slot was not persisted; see the engine's log"


def _temps(state_dir: Path) -> list[Path]:
    names = [persist.slot_path(state_dir, i) for i in range(SLOTS)] + [persist.usage_path(state_dir)]
    return [p.with_name(p.name + persist.TEMP_SUFFIX) for p in names]


def break_saves(state_dir: Path) -> None:
    """Every later save into ``state_dir`` fails, for root as for anyone (the module's docstring)."""
    for temp in _temps(state_dir):
        temp.mkdir()
    state_dir.chmod(0o500)


def mend_saves(state_dir: Path) -> None:
    state_dir.chmod(0o700)
    for temp in _temps(state_dir):
        temp.rmdir()


# ------------------------------------------------------------------------------------ the engine


async def turn(engine: EngineProcess, rid: int, question: str = "What is 2+2?") -> Done:
    out = await engine.run(rid, chat_prompt(question), max_tokens=4)
    assert isinstance(out.final, Done), out.final
    return out.final


async def test_done_says_saved_with_a_writable_state_dir_and_not_after_a_failed_save(nursery, tmp_path):
    state = tmp_path / "state"
    engine = await EngineProcess.start(nursery, *engine_args(state, slots=SLOTS))
    assert (await turn(engine, 1)).saved is True
    assert persist.slot_path(state, 0).is_file()
    break_saves(state)
    try:
        assert (await turn(engine, 2, "Name a color.")).saved is False
    finally:
        mend_saves(state)
    assert (await turn(engine, 3, "Name a fruit.")).saved is True  # the next save works again
    assert await engine.close() == 0


async def test_done_says_not_saved_with_a_read_only_state_dir(nursery, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    break_saves(state)
    try:
        engine = await EngineProcess.start(nursery, *engine_args(state, slots=SLOTS))
        assert (await turn(engine, 1)).saved is False
        assert (await turn(engine, 2, "Name a color.")).saved is False  # and it goes on serving
        assert await engine.close() == 0
    finally:
        mend_saves(state)
    assert not persist.slot_path(state, 0).exists()


async def test_done_says_not_saved_without_persistence(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None))
    assert (await turn(engine, 1)).saved is False
    assert await engine.close() == 0


# ------------------------------------------------------------------------------------ the server


def _chat(http: httpx.Client, question: str) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": user(question), "max_tokens": 4,
                                                 "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["colibri"]["stats"]


def _failures(http: httpx.Client) -> float:
    m = re.search(r"^colibri_persist_failures_total (\S+)$", http.get("/metrics").text, re.M)
    assert m, "no colibri_persist_failures_total in /metrics"
    return float(m[1])


def test_server_reports_a_failed_save_until_one_succeeds(tmp_path):
    state = tmp_path / "state"
    with running_server("--state-dir", str(state), "--kv-slots", str(SLOTS), "--ctx", "512",
                        env=server_env()) as server, server.http() as http:
        assert _chat(http, "What is 2+2?")["saved"] is True
        assert http.get("/health").json()["status"] == "ok" and _failures(http) == 0
        break_saves(state)
        try:
            assert _chat(http, "Name a color.")["saved"] is False
            h = http.get("/health")
            assert h.status_code == 200, h.text  # degraded, not down: answers are still served
            assert h.json()["status"] == "degraded" and h.json()["reason"] == DEGRADED_REASON, h.json()
            assert h.json()["persist_failures"] == 1 and _failures(http) == 1
        finally:
            mend_saves(state)
        assert _chat(http, "Name a fruit.")["saved"] is True
        h = http.get("/health").json()
        assert h["status"] == "ok" and h["reason"] == "ok", h
        assert _failures(http) == 1  # a counter: the failure stays counted


def test_server_without_persistence_is_not_degraded():
    with running_server("--kv-slots", "1", "--ctx", "512", env=server_env()) as server, server.http() as http:
        assert _chat(http, "What is 2+2?")["saved"] is False
        assert http.get("/health").json()["status"] == "ok" and _failures(http) == 0
