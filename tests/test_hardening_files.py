"""Issue 38, items 1 and 6: nothing in the state directory is opened through a planted link.

A link planted under a temp name (``.coli_kv.tmp``, ``.coli_usage.tmp``, a snapshot's ``.tmp``) is
neither written through nor renamed into place; start-up removes such links (never their targets);
a slot, usage or snapshot file that is a link is refused on load; a state directory another user
could write is refused at start; ``/atlas`` serves a regular ``experts.json`` only (a link, a FIFO, a
file over the cap are a 404), read off the event loop. Through the real engine and server where it
matters, directly on ``persist`` for the cases that need no process.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from engine_harness import EngineProcess, chat_prompt, engine_args
from serve_harness import running_server, serve_command, server_env

from colibri.atlas import write_atlas
from colibri.errors import ConfigError
from colibri.sched import persist
from colibri.sched.persist import (
    load_slot,
    load_snapshot,
    load_usage,
    remove_stale_temps,
    save_slot,
    save_snapshot,
    save_usage,
    slot_path,
    usage_path,
)
from colibri.state_files import check_state_dir

MODEL_FP = hashlib.sha256(b"model a").digest()
SHAPE = (2, 16, 2, 4)  # n_layers, n_ctx, n_kv_heads, head_dim
N_VOCAB = 100
VICTIM = b"a file the server's user may write, and nobody asked to change\n"
QUICK_S = 60  # a refused start is one error line, long before any model loads
PROMPT_S = 10  # "at once": a frozen event loop never answers at all


def kv(n: int = 5) -> tuple[list[int], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return (rng.integers(0, N_VOCAB, n).tolist(), rng.standard_normal(SHAPE).astype(np.float16),
            rng.standard_normal(SHAPE).astype(np.float16))


def outputs() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(SHAPE, np.float16), np.zeros(SHAPE, np.float16)


def victim(tmp_path: Path, name: str = "victim") -> Path:
    path = tmp_path / name
    path.write_bytes(VICTIM)
    return path


def plant(link: Path, target: Path) -> None:
    link.symlink_to(target)


def assert_untouched(*victims: Path) -> None:
    for v in victims:
        assert v.read_bytes() == VICTIM, f"{v} was written through a planted link"


def assert_regular(path: Path) -> None:
    assert stat.S_ISREG(os.lstat(path).st_mode), f"{path} is not a regular file (a link renamed in?)"


# --- writes through planted temp links ----------------------------------------------------------------


def test_saves_never_write_through_a_planted_temp_link(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    kv_victim, usage_victim, slot2_victim = (victim(tmp_path, n) for n in ("kv", "usage", "slot2"))
    plant(state / ".coli_kv.tmp", kv_victim)
    plant(state / ".coli_kv.2.tmp", slot2_victim)
    plant(state / ".coli_usage.tmp", usage_victim)
    tokens, k, v = kv()
    save_slot(state, 0, tokens, k, v, MODEL_FP)
    save_slot(state, 2, tokens, k, v, MODEL_FP)
    save_usage(state, np.ones((2, 3), np.float32), MODEL_FP)
    assert_untouched(kv_victim, usage_victim, slot2_victim)
    for path in (slot_path(state, 0), slot_path(state, 2), usage_path(state)):
        assert_regular(path)
    assert sorted(p.name for p in state.iterdir()) == [".coli_kv", ".coli_kv.2", ".coli_usage"]
    assert load_slot(state, 2, MODEL_FP, *outputs(), SHAPE[1], N_VOCAB) == tokens


def test_a_snapshot_save_never_writes_through_a_planted_temp_link(tmp_path):
    target = victim(tmp_path)
    snap = tmp_path / "snaps" / "a.snap"
    snap.parent.mkdir()
    plant(snap.with_name("a.snap.tmp"), target)
    tokens, k, v = kv()
    save_snapshot(snap, tokens, k, v, MODEL_FP, b'{"m": 1}')
    assert_untouched(target)
    assert_regular(snap)
    assert load_snapshot(snap, MODEL_FP, *outputs(), SHAPE[1], N_VOCAB) == (tokens, b'{"m": 1}')


async def test_a_real_engine_turn_never_writes_through_planted_links(nursery, tmp_path):
    """Planted after start (start-up would remove them): the turn's slot save and the usage save at
    exit create their temps exclusively; the links' targets keep their bytes."""
    state = tmp_path / "state"
    state.mkdir()
    engine = await EngineProcess.start(nursery, *engine_args(state))
    kv_victim, usage_victim = victim(tmp_path, "kv"), victim(tmp_path, "usage")
    plant(state / ".coli_kv.tmp", kv_victim)
    plant(state / ".coli_usage.tmp", usage_victim)
    out = await engine.run(1, chat_prompt("Say hi."), max_tokens=4)
    assert out.final is not None and out.final.saved, out.final
    assert await engine.close() == 0
    assert_untouched(kv_victim, usage_victim)
    assert_regular(state / ".coli_kv")
    assert_regular(state / ".coli_usage")
    assert not any(p.name.endswith(".tmp") for p in state.iterdir()), list(state.iterdir())


# --- start-up clean-up ----------------------------------------------------------------------------------


def test_remove_stale_temps_removes_planted_links_never_their_targets(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    target, target_dir = victim(tmp_path), tmp_path / "a_dir"
    target_dir.mkdir()
    (target_dir / "inside").write_bytes(VICTIM)
    plant(state / ".coli_kv.tmp", target)
    plant(state / ".coli_kv.3.tmp", target_dir)
    plant(state / ".coli_usage.tmp", tmp_path / "nothing")  # dangling
    plant(state / "notes.tmp", target)  # not one of our names: left alone
    assert remove_stale_temps(state) == 3
    assert sorted(p.name for p in state.iterdir()) == ["notes.tmp"]
    assert_untouched(target, target_dir / "inside")


# --- loads refuse links ------------------------------------------------------------------------------------


def test_loads_refuse_a_slot_usage_or_snapshot_file_that_is_a_link(tmp_path, capsys):
    elsewhere, state = tmp_path / "elsewhere", tmp_path / "state"
    elsewhere.mkdir()
    state.mkdir()
    tokens, k, v = kv()
    save_slot(elsewhere, 0, tokens, k, v, MODEL_FP)
    save_usage(elsewhere, np.ones(6, np.float32), MODEL_FP)
    save_snapshot(elsewhere / "s.snap", tokens, k, v, MODEL_FP, b"{}")
    plant(slot_path(state, 0), slot_path(elsewhere, 0))
    plant(usage_path(state), usage_path(elsewhere))
    plant(state / "s.snap", elsewhere / "s.snap")
    capsys.readouterr()
    assert load_slot(state, 0, MODEL_FP, *outputs(), SHAPE[1], N_VOCAB) is None
    assert load_usage(state, MODEL_FP, (6,)) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("symbolic link" in line for line in err), err
    with pytest.raises(persist.SnapshotError, match="symbolic link"):
        load_snapshot(state / "s.snap", MODEL_FP, *outputs(), SHAPE[1], N_VOCAB)
    assert load_slot(elsewhere, 0, MODEL_FP, *outputs(), SHAPE[1], N_VOCAB) == tokens  # targets intact


# --- the state directory at start --------------------------------------------------------------------------


def start(*args: str) -> subprocess.CompletedProcess[str]:
    """A command that must refuse to start: run to its end in its own process group (killed whole
    if it does start after all, so no engine outlives the test)."""
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=server_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=QUICK_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        err += "\n(still running: killed)"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.parametrize("command", ["engine", "serve"])
def test_a_world_writable_state_dir_is_refused_at_start(tmp_path, command):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    if command == "engine":
        args = [sys.executable, "-m", "colibri", "engine", "--state-dir", str(state)]
    else:
        args = serve_command("--state-dir", str(state))
    result = start(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: error: state directory"), result.stderr
    assert str(state) in lines[0] and "writable by every user (mode 0777)" in lines[0], lines[0]
    assert list(state.iterdir()) == []


def test_state_dir_rules(tmp_path):
    """Sticky or not, world-writable is refused; so is a directory another user owns or a group
    other than the user's private one can write; a link to a good directory is resolved and fine."""
    good = tmp_path / "good"
    assert check_state_dir(good) == good and stat.S_IMODE(good.stat().st_mode) == 0o700  # created
    link = tmp_path / "link"
    link.symlink_to(good)
    assert check_state_dir(link) == good
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with pytest.raises(ConfigError, match="writable by every user"):
        check_state_dir(sticky)
    with pytest.raises(ConfigError, match="is not a directory"):
        check_state_dir(victim(tmp_path) / ".")
    if os.geteuid() != 0:
        return  # giving a directory away takes root
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        check_state_dir(theirs)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 0, 65534)
    shared.chmod(0o770)
    with pytest.raises(ConfigError, match="writable by group 65534"):
        check_state_dir(shared)


def test_coli_atlas_writes_only_into_a_safe_directory_and_never_through_a_link(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by every user"):
        write_atlas({"rows": 1}, loose / "experts.json")
    assert list(loose.iterdir()) == []
    state = tmp_path / "state"
    state.mkdir()
    target = victim(tmp_path)
    plant(state / "experts.json.tmp", target)
    write_atlas({"rows": 1}, state / "experts.json")
    assert_untouched(target)
    assert_regular(state / "experts.json")
    assert sorted(p.name for p in state.iterdir()) == ["experts.json"]


# --- /atlas ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def atlas_server(tmp_path_factory):
    state = tmp_path_factory.mktemp("atlas_state")
    with running_server("--state-dir", str(state), "--web-dist", "/nonexistent") as srv:
        yield srv, state / "experts.json"


def refusals(srv, needle: str) -> list[str]:
    return [line for line in srv.lines if "/atlas" in line and needle in line]


def test_atlas_does_not_serve_a_link(atlas_server, tmp_path):
    srv, experts = atlas_server
    experts.symlink_to(victim(tmp_path))
    try:
        with srv.http(timeout=PROMPT_S) as h:
            for _ in range(2):
                r = h.get("/atlas")
                assert r.status_code == 404 and VICTIM not in r.content, r.content
        deadline = time.monotonic() + PROMPT_S
        while not refusals(srv, "symbolic link") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(refusals(srv, "symbolic link")) == 1, srv.log  # logged once, not per request
        assert "Traceback" not in srv.log
    finally:
        experts.unlink()


def test_atlas_does_not_read_a_fifo_and_the_server_stays_responsive(atlas_server):
    srv, experts = atlas_server
    os.mkfifo(experts)
    try:
        with srv.http(timeout=PROMPT_S) as h:
            assert h.get("/atlas").status_code == 404
            assert h.get("/health").status_code == 200
    finally:
        try:  # a server stuck reading the FIFO gets its EOF, so the test fails instead of hanging
            os.close(os.open(experts, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        experts.unlink()


def test_atlas_refuses_a_file_over_the_cap(atlas_server):
    srv, experts = atlas_server
    oversized = 64 << 20  # sparse: no disk used
    with experts.open("wb") as f:
        f.truncate(oversized)
    try:
        with srv.http(timeout=PROMPT_S) as h:
            assert h.get("/atlas").status_code == 404
            experts.write_text('{"rows": 1}')
            r = h.get("/atlas")
            assert r.status_code == 200 and r.json() == {"rows": 1}
    finally:
        experts.unlink()
    from colibri.api.routes import MAX_ATLAS_BYTES

    assert oversized > MAX_ATLAS_BYTES
