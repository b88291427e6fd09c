"""Crash test: ``kill -9`` the engine at random moments, 40 times, and check what is on disk.

Each round starts ``coli engine`` (the tiny random llama of tools/make_tiny_llama.py, 4 slots) on the
same state dir, keeps every slot busy with a stream of requests (random prompts, lengths and
temperatures, some CANCELs), and SIGKILLs it: at a uniform random time, right after a turn end was
acknowledged, or while a request is finishing (its slot is being persisted). Then every slot file
must load without a warning and hold either the previous round's state or a state committed in this
round by a request on that slot (its prompt's ids, then at most max_tokens more), and one
acknowledged by DONE must not be lost; its K/V must be those of its tokens; ``.coli_usage`` must
be absent or whole; no temp file survives the next start. Selection:
``pytest tests/test_crash.py`` or ``-k crash``; ``COLI_CRASH_ROUNDS`` and ``COLI_CRASH_SEED``
change the number of rounds and the seed (``make test`` runs 20 to keep the suite inside its time
budget, ``make test-long`` 100; each round costs ~1.7 s).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest
import trio
from engine_harness import EngineProcess, Outcome, engine_args

from colibri.io.events import Data, Done, Error, ErrorCode, Perf
from colibri.model.kv_cache import KVCache
from colibri.model.loader import Model
from colibri.sched import persist

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tiny_llama", ROOT / "tools" / "make_tiny_llama.py")
mtl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mtl
_spec.loader.exec_module(mtl)

ROUNDS = int(os.environ.get("COLI_CRASH_ROUNDS", "40"))
SLOTS, CTX = 4, 512
MAX_TOKENS = (5, 80)
TEMPERATURES = (0.0, 0.7, 1.0)
CANCEL_P = 0.25  # a request is cancelled after a random delay with this probability
UNIFORM_KILL_S = 1.5
PERSIST_WINDOW_S = 0.05  # a kill this soon after a DONE/CANCELLED may overlap another slot's save
EVENT_TIMEOUT = 60  # generous: the machine may be shared with other test runs

QUESTIONS = [
    "hello", "Tell me a story about the sea.", "What is the capital of France?", "List three primes.",
    "hello world, and then some more of the world", "Write a haiku.", "Why is the sky blue?",
    "In the beginning there was the word, and the word was hello, and it went on and on " * 3,
    "Say one word.", "Count from one to twenty in words, slowly, with a comment on each.",
]


@dataclass(eq=False)
class Req:
    rid: int
    slot: int
    ids: list[int]  # the prompt as the engine tokenizes it
    max_tokens: int
    out: Outcome
    cancel_sent: bool = False
    t_final: float | None = None

    @property
    def done(self) -> Done | None:
        # not ``out.final``: a CANCEL that crosses the DONE is answered NOT_FOUND after it
        return next((e for e in self.out.events if isinstance(e, Done)), None)

    @property
    def cancelled(self) -> bool:
        return Error(self.rid, ErrorCode.CANCELLED) in self.out.events

    def check_replies(self) -> None:
        """Nothing, DONE, or ERROR CANCELLED; and if a CANCEL was sent, maybe NOT_FOUND after DONE."""
        finals = [e for e in self.out.events if isinstance(e, Done | Error)]
        if self.cancel_sent and finals[1:] == [Error(self.rid, ErrorCode.NOT_FOUND)] and self.done:
            finals = finals[:1]
        assert finals in ([], [self.done], [Error(self.rid, ErrorCode.CANCELLED)]), finals

    def committed_len(self) -> int:
        """The history a DONE acknowledges: the prompt and every emitted token, less the last one
        when the turn hit max_tokens (it was sampled, never fed)."""
        d = self.done
        return len(self.ids) + d.emitted - (1 if d.length_limited else 0)

    def is_done_commit(self, tokens: list[int]) -> bool:
        """``tokens`` is the history this request's DONE acknowledged."""
        return (self.done is not None and tokens[: len(self.ids)] == self.ids
                and len(tokens) == self.committed_len())

    def may_have_committed(self, tokens: list[int]) -> bool:
        n = len(self.ids)
        if tokens[:n] == self.ids and len(tokens) <= n + self.max_tokens:
            return True
        # cancelled before its prompt was all fed: the slot keeps the part that was
        return self.cancel_sent and tokens == self.ids[: len(tokens)]


@dataclass
class Stats:
    rounds: int = 0
    kills: int = 0
    kills_in_persist_window: int = 0
    kills_with_temp_file: int = 0
    new_state_rounds: int = 0
    old_state_rounds: int = 0
    slots_new: int = 0
    slots_old: int = 0
    commits_before_ack: int = 0  # new state on disk, its DONE/CANCELLED not yet written
    kv_checked: int = 0
    dones: int = 0
    cancels: int = 0
    modes: dict[str, int] = field(default_factory=dict)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Checker:
    """Reads the slot files as the engine does, and recomputes their K/V in-process."""

    def __init__(self, model_path: Path, state_dir: Path) -> None:
        self.model = Model(model_path)
        self.state_dir = state_dir
        self.model_fp = self.model.fingerprint

    def load(self, slot: int) -> tuple[list[int] | None, np.ndarray, np.ndarray, list[str]]:
        kv = KVCache(self.model.hp, 1, CTX)
        warnings: list[str] = []
        k, v = kv.slot(0)
        tokens = persist.load_slot(self.state_dir, slot, self.model_fp, k, v,
                                   CTX, self.model.hp.n_vocab, warn=warnings.append)
        return tokens, k, v, warnings

    def check_usage(self) -> None:
        """``.coli_usage`` (empty routing heat for a dense model) is absent or whole."""
        warnings: list[str] = []
        persist.load_usage(self.state_dir, self.model_fp, (0,), warn=warnings.append)
        assert warnings == [], warnings

    def check_kv(self, tokens: list[int], k: np.ndarray, v: np.ndarray) -> None:
        n = len(tokens)
        if n == 0:
            return
        ref = KVCache(self.model.hp, 1, CTX)
        rows = np.arange(n, dtype=np.int64)
        self.model.forward(np.asarray(tokens, np.int64), np.zeros(n, np.int64), rows, ref,
                           np.asarray([n - 1], np.int64), 0)
        ref_k, ref_v = ref.slot(0)
        np.testing.assert_allclose(k[:, :n], ref_k[:, :n], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(v[:, :n], ref_v[:, :n], rtol=1e-3, atol=1e-3)
        assert not k[:, n:].any() and not v[:, n:].any()


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    return mtl.write_tiny_llama(tmp_path / "tiny.gguf")


def temp_files(state_dir: Path) -> list[str]:
    return sorted(p.name for p in state_dir.glob("*" + persist.TEMP_SUFFIX))


def stderr_problems(path: Path) -> list[str]:
    """The engine's complaints: a warning about a state file (load_slot's one line) or a crash."""
    text = path.read_text(errors="replace")
    return [line for line in text.splitlines()
            if line.startswith("colibri:") or ".coli_" in line or "Traceback" in line]


async def wait_for(cond, timeout: float = EVENT_TIMEOUT, poll: float = 0.002) -> bool:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(poll)
        return True
    return False


class Traffic:
    """One round's requests: a driver per slot keeps every slot busy with random requests (some
    cancelled), and the kill moments are read off their outcomes."""

    def __init__(self, engine: EngineProcess, rng: random.Random, prompts: list[tuple[str, list[int]]],
                 ids: itertools.count) -> None:
        self.engine, self.rng, self.prompts, self.ids = engine, rng, prompts, ids
        self.reqs: dict[int, list[Req]] = {s: [] for s in range(SLOTS)}
        self.send_lock = trio.Lock()  # one writer at a time on the engine's stdin

    async def driver(self, slot: int) -> None:
        engine, rng = self.engine, self.rng
        while True:
            text, prompt_ids = rng.choice(self.prompts)
            rid = next(self.ids)
            req = Req(rid, slot, prompt_ids, rng.randint(*MAX_TOKENS), engine.outcomes[rid])
            self.reqs[slot].append(req)
            temperature, top_p = rng.choice(TEMPERATURES), rng.choice((1.0, 0.9))
            async with self.send_lock:
                await engine.submit(rid, text, slot=slot, max_tokens=req.max_tokens,
                                    temperature=temperature, top_p=top_p)
            if rng.random() < CANCEL_P:
                await trio.sleep(rng.uniform(0, 0.4))
                if not req.out.finished.is_set():
                    req.cancel_sent = True
                    async with self.send_lock:
                        await engine.send(b"CANCEL %d\n" % rid)
            await req.out.finished.wait()
            req.t_final = trio.current_time()

    def any_output(self) -> bool:
        return any(q.out.events for rs in self.reqs.values() for q in rs)

    def finishing(self) -> bool:
        """A request whose turn is ending (its slot is about to be saved, or being saved):
        CANCEL sent, or (about) max_tokens streamed. DATA lines undercount tokens (a split
        UTF-8 character streams nothing), hence the margin."""
        for rs in self.reqs.values():
            for q in rs:
                if q.out.finished.is_set():
                    continue
                n_data = sum(isinstance(e, Data) for e in q.out.events)
                if q.cancel_sent or n_data >= q.max_tokens - 2:
                    return True
        return False

    def last_final(self) -> float:
        return max((q.t_final for rs in self.reqs.values() for q in rs if q.t_final), default=-1e9)

    async def kill_moment(self) -> str:
        """Wait until a random moment of a random kind (returned): uniform, right after a turn
        end, or while a request is finishing."""
        rng = self.rng
        mode = rng.choices(["uniform", "after-final", "finishing"], weights=[5, 2, 3])[0]
        if mode == "uniform":
            await trio.sleep(rng.uniform(0, UNIFORM_KILL_S))
        elif mode == "after-final":
            before = self.last_final()
            await wait_for(lambda: self.last_final() > before, timeout=5)
            await trio.sleep(rng.uniform(0, 0.005))
        else:
            await wait_for(self.finishing, timeout=5, poll=0.001)
            await trio.sleep(rng.uniform(0, 0.02))
        return mode

    async def serve_and_kill(self, stats: Stats) -> None:
        """Drive every slot, SIGKILL the engine at a random moment, stop the drivers."""
        engine = self.engine
        killed = False
        async with trio.open_nursery() as dn:
            try:
                for s in range(SLOTS):
                    dn.start_soon(self.driver, s)
                assert await wait_for(self.any_output), "the engine produced no output after its restart"
                mode = await self.kill_moment()
                stats.modes[mode] = stats.modes.get(mode, 0) + 1
                now = trio.current_time()
                if self.finishing() or now - self.last_final() < PERSIST_WINDOW_S:
                    stats.kills_in_persist_window += 1
                engine.kill()
                killed = True
                stats.kills += 1
            finally:
                dn.cancel_scope.cancel()
                if not killed:
                    engine.kill()  # a failed round must not leave the engine running


async def reap_killed(engine: EngineProcess, err: BinaryIO, err_path: Path, state_dir: Path,
                      stats: Stats) -> None:
    """Wait for the killed engine to be gone (killed, not exited by itself), and close its stdin."""
    with trio.fail_after(30):
        await engine.proc.wait()
    if engine.proc.returncode != -9:
        err.flush()
        raise AssertionError(f"the engine exited by itself (rc {engine.proc.returncode}) before the "
                             f"kill:\n{err_path.read_text(errors='replace')[-3000:]}")
    if temp_files(state_dir):
        stats.kills_with_temp_file += 1
    try:
        await engine.proc.stdin.aclose()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def crash_round(args: list[str], rng: random.Random, prompts: list[tuple[str, list[int]]],
                      ids: itertools.count, err_path: Path, state_dir: Path,
                      stats: Stats) -> dict[int, list[Req]]:
    """One start-serve-kill round; returns the requests per slot, their outcomes complete (the
    pipe is drained after the kill: a DONE the engine wrote before dying counts)."""
    with open(err_path, "wb") as err:
        async with trio.open_nursery() as rn:
            engine = await EngineProcess.start(rn, *args, stderr=err)
            assert engine.ready.is_set()
            # restore ran (stale temps removed, every file loaded) before READY
            assert temp_files(state_dir) == [], "a temp file survived the engine's start"
            assert stderr_problems(err_path) == [], err_path.read_text()
            traffic = Traffic(engine, rng, prompts, ids)
            await traffic.serve_and_kill(stats)
            await reap_killed(engine, err, err_path, state_dir, stats)
        # here the reader has seen EOF: every event the engine wrote is in the outcomes
    assert stderr_problems(err_path) == [], err_path.read_text()
    return traffic.reqs


def check_slot(checker: Checker, slot: int, old: list[int], rs: list[Req], stats: Stats,
               verify_kv: bool) -> tuple[list[int], bool]:
    """The slot's file after a kill; (its tokens, whether they are a new state)."""
    tokens, k, v, warnings = checker.load(slot)
    assert warnings == [], warnings
    tokens = tokens or []
    for q in rs:
        q.check_replies()
        if q.done:
            assert q.done.prompt_tokens == len(q.ids)
    acked = [i for i, q in enumerate(rs) if q.done is not None]
    if acked:
        # a DONE means "persisted": that commit, or one of a later request, is on disk
        last = rs[acked[-1]]
        ok = last.is_done_commit(tokens) or any(q.may_have_committed(tokens) for q in rs[acked[-1] + 1 :])
        why = f"DONE of request {last.rid} ({last.committed_len()} tokens) lost"
    else:
        ok = tokens == old or any(q.may_have_committed(tokens) for q in rs)
        why = "neither the previous state nor a commit of this round"
    assert ok, (f"slot {slot}: {len(tokens)} tokens on disk, {why}; old {len(old)} tokens; requests "
                f"{[(q.rid, len(q.ids), q.max_tokens, q.cancel_sent, q.out.final) for q in rs]}")
    if verify_kv:
        checker.check_kv(tokens, k, v)
        stats.kv_checked += 1
    new = tokens != old
    # a state on disk whose request has not answered yet: the kill landed between rename and reply
    if new and not (acked and rs[acked[-1]].is_done_commit(tokens)) and any(
            q.may_have_committed(tokens) and q.out.final is None for q in rs):
        stats.commits_before_ack += 1
    return tokens, new


def check_reuse(rs: list[Req], old: list[int]) -> None:
    """The first request of a round on a slot reuses what the slot file held: the engine restored it."""
    if rs and rs[0].done is not None:
        perf = next(e for e in rs[0].out.events if isinstance(e, Perf))
        assert perf.reused_tokens == min(common_prefix(old, rs[0].ids), len(rs[0].ids) - 1), (
            perf, len(old), len(rs[0].ids))


def chat_prompts(model: Model) -> list[tuple[str, list[int]]]:
    """Each question as a user turn in the model's chat template: (text, its ids)."""
    prompts = []
    for q in QUESTIONS:
        text = model.chat_template.render([{"role": "user", "content": q}])
        prompts.append((text, model.tokenizer.encode(text, special=True)))
    return prompts


def check_round(checker: Checker, reqs: dict[int, list[Req]], previous: list[list[int]], kv_slot: int,
                stats: Stats) -> None:
    """Every slot after a round's kill; ``previous`` becomes what the slot files hold."""
    any_new = any_old = False
    for s in range(SLOTS):
        check_reuse(reqs[s], previous[s])
        stats.dones += sum(q.done is not None for q in reqs[s])
        stats.cancels += sum(q.cancelled for q in reqs[s])
        tokens, new = check_slot(checker, s, previous[s], reqs[s], stats, verify_kv=s == kv_slot)
        any_new |= new
        any_old |= not new
        stats.slots_new += new
        stats.slots_old += not new
        previous[s] = tokens
    stats.new_state_rounds += any_new
    stats.old_state_rounds += any_old


def summarize(stats: Stats, seed: int, elapsed: float) -> str:
    return (f"crash test: seed {seed}, {stats.rounds} rounds, {stats.kills} kills in {elapsed:.0f} s "
            f"(modes {stats.modes}); {stats.kills_in_persist_window} kills in a persist window, "
            f"{stats.kills_with_temp_file} left a temp file; {stats.new_state_rounds} new-state rounds, "
            f"{stats.old_state_rounds} old-state rounds; slots: {stats.slots_new} new, {stats.slots_old} "
            f"old, {stats.commits_before_ack} committed before their reply; {stats.dones} DONE, "
            f"{stats.cancels} CANCELLED; K/V recomputed for {stats.kv_checked} files")


async def serve_to_the_end(args: list[str], prompts: list[tuple[str, list[int]]], ids: itertools.count,
                           err_path: Path, state_dir: Path) -> dict[int, list[Req]]:
    """One more start, served normally to the end: every slot answers, persists and the engine exits."""
    with open(err_path, "wb") as err:
        async with trio.open_nursery() as nursery:
            engine = await EngineProcess.start(nursery, *args, stderr=err)
            assert temp_files(state_dir) == []
            final: dict[int, list[Req]] = {}
            for s in range(SLOTS):
                text, prompt_ids = prompts[s]
                rid = next(ids)
                out = await engine.submit(rid, text, slot=s, max_tokens=12)
                final[s] = [Req(rid, s, prompt_ids, 12, out)]
            for s in range(SLOTS):
                out = await engine.result(final[s][0].rid)
                assert isinstance(out.final, Done), out.final
            assert await engine.close() == 0
    assert stderr_problems(err_path) == [], err_path.read_text()
    assert temp_files(state_dir) == []
    return final


async def test_crash_sigkill_during_generation_and_persistence(tmp_path, tiny_model):
    seed = int(os.environ.get("COLI_CRASH_SEED", str(time.time_ns() % 2**32)))
    rng = random.Random(seed)
    state_dir, logs = tmp_path / "state", tmp_path / "logs"
    logs.mkdir()
    checker = Checker(tiny_model, state_dir)
    prompts = chat_prompts(checker.model)
    assert max(len(p) for _, p in prompts) + MAX_TOKENS[1] <= CTX
    args = engine_args(state_dir, "--model", str(tiny_model), slots=SLOTS, ctx=CTX)
    ids = itertools.count(1)
    stats = Stats()
    previous: list[list[int]] = [[] for _ in range(SLOTS)]
    t0 = time.perf_counter()

    for r in range(ROUNDS):
        try:
            reqs = await crash_round(args, rng, prompts, ids, logs / f"round{r:03d}.err", state_dir, stats)
            stats.rounds += 1
            checker.check_usage()
            kv_slot = rng.randrange(SLOTS)  # one file's K/V recomputed per round (0.1 s each)
            check_round(checker, reqs, previous, kv_slot, stats)
        except BaseException as e:
            e.add_note(f"crash test: round {r}, COLI_CRASH_SEED={seed}, engine stderr in {logs}")
            raise

    summary = summarize(stats, seed, time.perf_counter() - t0)
    print("\n" + summary)
    assert stats.kills == ROUNDS
    assert stats.new_state_rounds > 0 and stats.old_state_rounds > 0, summary
    assert stats.kills_in_persist_window > 0, summary

    final = await serve_to_the_end(args, prompts, ids, logs / "final.err", state_dir)
    for s in range(SLOTS):
        check_reuse(final[s], previous[s])
        tokens, _ = check_slot(checker, s, previous[s], final[s], stats, verify_kv=True)
        assert len(tokens) == final[s][0].committed_len()
    warnings: list[str] = []
    assert persist.load_usage(state_dir, checker.model_fp, (0,), warn=warnings.append) is not None
    assert warnings == []
