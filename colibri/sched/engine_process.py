"""``coli engine``: the engine process. Loads the model, restores the slots, then serves one of the
two protocols on stdin/stdout until EOF or SIGTERM, finishing in-flight requests first. The mux
protocol's reader is here; the legacy protocol's single conversation is ``legacy_session.py``.

One trio nursery holds everything: the writer (the only task that writes stdout: one line per
write), the reader (stdin -> codec -> core), the step loop, a SIGTERM watcher, and a task per
request.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from colibri.io import mux
from colibri.io.events import Cancel, EndOfInput, Error, ErrorCode, ProtocolError, Ready, Stat, Stop, Submit
from colibri.model.interface import EngineModel
from colibri.sched import telemetry
from colibri.sched.engine import Engine
from colibri.sched.legacy_session import LegacySession, legacy_encoder
from colibri.sched.requests import Emit

READ_SIZE = 1 << 16
# Lines buffered between the core and the writer: a slow reader of stdout applies back-pressure
# to the step loop instead of growing memory.
OUTPUT_BUFFER = 256


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_slots: int
    n_ctx: int
    state_dir: Path | None
    prefill_chunk: int
    protocol: str  # "mux" | "legacy"
    topk: bool
    perf: bool = False  # SERVE_PERF=1: the spec's PERF, ENTROPY and GPUS lines before each DONE
    max_tokens: int = 512  # legacy: answer length when the client gives none
    ram_budget: int | None = None  # bytes of resident expert copies (MoE); None: no limit


def run_engine(cfg: EngineConfig) -> int:
    """Load the model and serve until EOF or SIGTERM; the exit status."""
    from colibri.model.loader import Model

    model = Model(cfg.model_path, ram_budget=cfg.ram_budget)
    n_ctx = min(cfg.n_ctx, model.hp.context_length)
    return trio.run(_main, cfg, model, n_ctx)


async def _main(cfg: EngineConfig, model: EngineModel, n_ctx: int) -> int:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    out_send, out_recv = trio.open_memory_channel[bytes](OUTPUT_BUFFER)
    encode = mux.encode_response if cfg.protocol == "mux" else legacy_encoder()

    async def emit(event) -> None:
        data = encode(event)
        if data:
            await out_send.send(data)

    engine = Engine(model, cfg.n_slots, n_ctx, cfg.state_dir, cfg.prefill_chunk, emit, topk=cfg.topk,
                    perf=cfg.perf)
    await trio.to_thread.run_sync(engine.restore)
    async with trio.open_nursery() as outer:
        outer.start_soon(_writer, out_recv, stdout)
        if cfg.protocol == "mux":
            for event in (Ready(), Stat(telemetry.rss_gb()), telemetry.hwinfo(),
                          *engine.expert_telemetry(hits=False)):
                await emit(event)
        async with trio.open_nursery() as work:
            work.start_soon(engine.run)
            with trio.CancelScope() as reading:
                work.start_soon(_on_sigterm, reading)
                if cfg.protocol == "mux":
                    await _read_mux(stdin, engine, emit, work)
                else:
                    session = LegacySession(engine, emit, work, cfg.max_tokens)
                    await session.read(lambda: stdin.receive_some(READ_SIZE))
            await engine.idle.wait()  # EOF or SIGTERM: in-flight requests finish first
            work.cancel_scope.cancel()
        await engine.save_usage()
        await out_send.aclose()
    return 0


async def _writer(lines: trio.MemoryReceiveChannel[bytes], stdout: trio.lowlevel.FdStream) -> None:
    async with stdout:
        async for data in lines:
            try:
                await stdout.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the server went away: nothing left to tell it


async def _on_sigterm(reading: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            reading.cancel()  # stop taking requests; the drain that follows finishes the rest
            return


async def _read_mux(stdin: trio.lowlevel.FdStream, engine: Engine, emit: Emit, work: trio.Nursery) -> None:
    reader = mux.RequestReader(max_payload=engine.max_payload)
    while True:
        data = await stdin.receive_some(READ_SIZE)
        for event in reader.receive_data(data):
            match event:
                case Submit():
                    error = engine.check(event)
                    if error is not None:
                        await emit(error)
                    else:
                        engine.start(event, work)
                case Cancel(id=rid):
                    if not engine.cancel(rid):
                        await emit(Error(rid, ErrorCode.NOT_FOUND))
                case Stop(id=rid):
                    if not engine.stop(rid):
                        await emit(Error(rid, ErrorCode.NOT_FOUND))
                case ProtocolError(id=rid, code=code, detail=detail):
                    print(f"colibri: {code}: {detail}", file=sys.stderr, flush=True)
                    await emit(Error(rid, code))
                case EndOfInput():
                    return
