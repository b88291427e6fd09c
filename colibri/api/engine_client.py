"""The server's side of the mux protocol: ``coli engine`` as a child process, many requests over it.

One task reads the child's stdout through the codec and routes each event to the request it names;
a lock serialises writes to its stdin. If the child dies, every request in flight ends with
``EngineDied``, the state says why, and the child is restarted with backoff.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import trio

from colibri.errors import ConfigError
from colibri.io.events import (
    Accept,
    Cancel,
    Data,
    Done,
    Error,
    ExpertMap,
    Forget,
    Hits,
    HwInfo,
    Perf,
    Prof,
    Ready,
    Stop,
    Submit,
    Tiers,
    TopK,
)
from colibri.io.mux import ResponseReader, encode_request

# Seconds to wait for the engine to end a request it was told to CANCEL (one step, normally): its
# slot is the engine's until then, so the server must not hand the slot to another request earlier.
CANCEL_WAIT_S = 30.0
# Restart backoff after the engine dies: doubling from the first to the last, so a crash loop costs
# little CPU and a one-off crash little downtime.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
# An engine that served this long before dying was healthy: the next restart waits the first delay.
RESTART_RESET_S = 60.0
READ_SIZE = 1 << 16
# An engine that fails to start (exits before READY) this many times in a row with the same last
# words is misconfigured, not crashing: a state directory it cannot use, a model it cannot load.
# Retrying would loop for ever, so the server stops with the engine's message.
SAME_START_FAILURES = 2


class EngineStartFailed(ConfigError):
    """The engine failed to start the same way SAME_START_FAILURES times in a row."""


class EngineDied(Exception):
    """The engine process ended while the request was in flight."""


@dataclass
class Telemetry:
    """The latest engine telemetry, for /experts and the stats frames."""

    hwinfo: HwInfo | None = None
    tiers: Tiers | None = None
    emap: ExpertMap | None = None
    hits: Hits | None = None
    seq: int = 0  # bumps with every EMAP/HITS
    hit_pct: float | None = None  # the expert store's hit rate over the last finished turn (MoE)


@dataclass
class PersistStatus:
    """What the engine's DONEs say about saving KV slots: a failed save must not pass for a saved
    turn (docs/persistence.md), so /health and /metrics report it."""

    enabled: bool  # the engine has a state directory (not --no-persist): saved 0 is then a failure
    failures: int = 0  # DONEs that said their slot was not saved
    last_failed: bool = False  # the most recent DONE that said anything said: not saved
    on_failure: Callable[[], object] | None = None  # counts a failure into /metrics

    def note(self, done: Done) -> None:
        if not self.enabled or done.saved is None:  # None: an engine that does not say
            return
        self.last_failed = not done.saved
        if self.last_failed:
            self.failures += 1
            if self.on_failure is not None:
                self.on_failure()


@dataclass(eq=False)
class _Flight:
    send: trio.MemorySendChannel
    abandoned: bool = False
    ended: trio.Event = field(default_factory=trio.Event)  # its DONE or ERROR came, or the engine died


@dataclass
class Ticket:
    """A request's engine id, known once ``generate`` has sent it (what ``stop`` names)."""

    id: int = 0


@dataclass
class EngineClient:
    engine_args: list[str]
    env: dict[str, str] | None = None
    ready: bool = False
    reason: str = "starting"
    restarts: int = 0
    telemetry: Telemetry = field(default_factory=Telemetry)
    _proc: trio.Process | None = None
    _flights: dict[int, _Flight] = field(default_factory=dict)
    _next_id: int = 1
    _write_lock: trio.Lock = field(default_factory=trio.Lock)
    _ready_event: trio.Event = field(default_factory=trio.Event)
    _stopping: bool = False
    persist: PersistStatus = field(init=False)

    def __post_init__(self) -> None:
        # The engine is told --no-persist exactly when the server has no state directory.
        self.persist = PersistStatus(enabled="--no-persist" not in self.engine_args)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep an engine running; ``started`` once the first one is READY. Raises
        EngineStartFailed when it fails to start the same way SAME_START_FAILURES times running."""
        backoff, started, failures = RESTART_FIRST_S, False, []
        while True:
            began = trio.current_time()
            code, last_words = await self._run_once(task_status if not started else None)
            was_ready = self._ready_event.is_set()
            started = started or was_ready
            self.ready = False
            if self._stopping:
                self.reason = "stopped"
                return
            why = last_words or f"exit status {code}"
            failures = [] if was_ready else [*failures, why][-SAME_START_FAILURES:]
            if len(failures) == SAME_START_FAILURES and len(set(failures)) == 1:
                self.reason = f"the engine cannot start: {failures[0]}"
                self._fail_all()
                raise EngineStartFailed(self.reason)
            self.reason = f"engine exited with status {code}; restarting"
            self._fail_all()
            self._ready_event = trio.Event()
            if trio.current_time() - began > RESTART_RESET_S:
                backoff = RESTART_FIRST_S
            print(f"colibri: {self.reason} in {backoff:.1f}s", file=sys.stderr, flush=True)
            await trio.sleep(backoff)
            backoff = min(RESTART_MAX_S, backoff * 2)
            self.restarts += 1

    async def _run_once(self, task_status: trio.TaskStatus[None] | None) -> tuple[int, str]:
        """One engine process, until it exits: (its exit status, its last line on stderr). Its
        stderr is relayed to ours line by line."""
        cmd = [sys.executable, "-m", "colibri", "engine", *self.engine_args]
        proc = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env
        )
        last: list[str] = []
        try:
            async with trio.open_nursery() as relay:
                relay.start_soon(_relay_stderr, proc.stderr, last)
                self._proc = proc
                await self._read(proc, task_status)
                code = await proc.wait()
        finally:
            if proc.returncode is None:  # cancelled: the engine does not outlive us
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
        return code, last[0] if last else ""

    async def _read(self, proc: trio.Process, task_status: trio.TaskStatus[None] | None) -> None:
        reader = ResponseReader()
        while True:
            try:
                data = await proc.stdout.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                return
            for event in reader.receive_data(data):
                if isinstance(event, Ready):
                    self.ready, self.reason = True, "ok"
                    self._ready_event.set()
                    if task_status is not None:
                        task_status.started()
                        task_status = None
                    continue
                rid = getattr(event, "id", 0)
                if isinstance(event, Done):  # an abandoned request's DONE counts too
                    self.persist.note(event)
                if isinstance(event, Done) and self.telemetry.emap and self.telemetry.emap.rows:
                    self.telemetry.hit_pct = event.hit_pct  # MoE only: a dense model has no store
                if rid and isinstance(event, Accept | Data | TopK | Done | Error | Perf | Prof):
                    flight = self._flights.get(rid)
                    if flight is not None:
                        try:
                            flight.send.send_nowait(event)
                        except trio.BrokenResourceError:
                            pass  # abandoned: its caller left; the events until its end are dropped
                        if isinstance(event, Done | Error):
                            self._flights.pop(rid, None)
                            flight.send.close()
                            flight.ended.set()
                    continue
                self._note(event)

    def _note(self, event: object) -> None:
        """Telemetry: kept for /experts, whichever request it came with."""
        t = self.telemetry
        match event:
            case HwInfo():
                t.hwinfo = event
            case Tiers():
                t.tiers = event
            case ExpertMap():
                t.emap, t.seq = event, t.seq + 1
            case Hits():
                t.hits, t.seq = event, t.seq + 1

    def _fail_all(self) -> None:
        for flight in self._flights.values():
            flight.send.close()  # the iterator sees the channel end without Done: EngineDied
            flight.ended.set()
        self._flights.clear()

    async def _write(self, data: bytes) -> None:
        if self._proc is None or not self.ready:
            raise EngineDied(self.reason)
        async with self._write_lock:
            try:
                await self._proc.stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise EngineDied("the engine's stdin is closed") from e

    async def generate(
        self, prompt: str | tuple[int, ...], slot: int, max_tokens: int, temperature: float,
        top_p: float, seed: int | None = None, grammar: str | None = None, ticket: Ticket | None = None,
        forget: bool = False, speculative: bool | None = None,
    ) -> AsyncIterator[Accept | Data | TopK | Perf | Prof | Done | Error]:
        """The request's events up to its Done or Error. ``prompt``: token ids (SUBMIT_IDS), or
        text the engine tokenizes with control tokens parsed (SUBMIT). ``grammar`` constrains every
        token; ``ticket`` learns the engine id (for ``stop``); ``forget``: a FORGET of the slot
        goes first, in the same write; ``speculative`` False: no drafts for it (SUBMIT's ninth
        field). Leaving the loop early (a client gone) cancels the request
        in the engine."""
        rid = self._next_id
        self._next_id += 1
        if ticket is not None:
            ticket.id = rid
        send, recv = trio.open_memory_channel(math.inf)
        flight = _Flight(send)
        self._flights[rid] = flight
        finished = False
        try:
            text, ids = (prompt, None) if isinstance(prompt, str) else ("", tuple(prompt))
            submit = Submit(rid, slot, max_tokens, temperature, top_p, text, seed, ids, grammar,
                            speculative=speculative)
            await self._write((encode_request(Forget(slot)) if forget else b"") + encode_request(submit))
            async with recv:
                async for event in recv:
                    if isinstance(event, Done | Error):
                        finished = True
                    yield event
                    if finished:
                        return
            raise EngineDied(self.reason)
        finally:
            if not finished and self._flights.get(rid) is flight:
                with trio.CancelScope(shield=True):
                    try:
                        await self._write(encode_request(Cancel(rid)))  # its ERROR is dropped
                    except EngineDied:
                        self._flights.pop(rid, None)
                    else:  # the engine holds the slot until the request ends: wait for that
                        with trio.move_on_after(CANCEL_WAIT_S):
                            await flight.ended.wait()

    async def stop(self, rid: int) -> None:
        """STOP: the engine ends the request at its next step with a normal DONE (a stop string
        matched); its events go on arriving until then."""
        if rid in self._flights:
            await self._write(encode_request(Stop(rid)))

    async def shutdown(self) -> None:
        """EOF to the engine: it finishes, persists and exits; no restart follows."""
        self._stopping = True
        if self._proc is not None:
            try:
                await self._proc.stdin.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await self._proc.wait()


async def _relay_stderr(stream: trio.abc.ReceiveStream, last: list[str]) -> None:
    """The engine's stderr onto ours, whole lines at a time; ``last`` keeps its last non-empty
    line (an engine that fails to start says why there, as ``coli: error: …``)."""
    pending = b""
    async for chunk in stream:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            sys.stderr.buffer.write(line + b"\n")
            if line.strip():
                last[:] = [line.decode("utf-8", "replace").strip().removeprefix("coli: error: ")]
        sys.stderr.flush()
    if pending:
        sys.stderr.buffer.write(pending + b"\n")
        last[:] = [pending.decode("utf-8", "replace").strip().removeprefix("coli: error: ")]
        sys.stderr.flush()

