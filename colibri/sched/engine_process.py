"""``coli engine``: the engine process. Loads the model, restores the slots, then serves one of the
three protocols on stdin/stdout until EOF or SIGTERM, finishing in-flight requests first. The mux
protocol's reader is here; the legacy protocol's single conversation is ``legacy_session.py``, the
Channel protocol's ``channel_session.py`` (its frame loop is here).

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

from colibri.io import channel, mux
from colibri.io import channel_frames as cf
from colibri.io.events import Cancel, EndOfInput, Error, ErrorCode, ProtocolError, Ready, Stat, Stop, Submit
from colibri.model.interface import EngineModel
from colibri.sched import telemetry
from colibri.sched.compute import ComputeThread
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
    protocol: str  # "mux" | "legacy" | "channel"
    topk: bool
    perf: bool = False  # SERVE_PERF=1: the spec's PERF, ENTROPY and GPUS lines before each DONE
    max_tokens: int = 512  # legacy: answer length when the client gives none
    ram_budget: int | None = None  # bytes of resident expert copies (MoE); None: no limit
    kv_type: str = "f16"  # the KV cache's element type (colibri.model.kv_cache.KV_TYPES)


def run_engine(cfg: EngineConfig) -> int:
    """Load the model and serve until EOF or SIGTERM; the exit status."""
    from colibri.model.loader import Model
    from colibri.model.sampling import load_kernels

    with ComputeThread() as compute:  # the model loads and computes on one thread (compute.py)
        model = compute.call(lambda: Model(cfg.model_path, ram_budget=cfg.ram_budget, kv_type=cfg.kv_type))
        compute.call(load_kernels)  # a sampled request's first token does not wait for it
        n_ctx = min(cfg.n_ctx, model.hp.context_length)
        return trio.run(_main, cfg, model, n_ctx, compute)


async def _main(cfg: EngineConfig, model: EngineModel, n_ctx: int, compute: ComputeThread) -> int:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    out_send, out_recv = trio.open_memory_channel[bytes](OUTPUT_BUFFER)
    if cfg.protocol == "channel":
        return await _main_channel(cfg, model, n_ctx, stdin, stdout, out_send, out_recv, compute)
    encode = mux.encode_response if cfg.protocol == "mux" else legacy_encoder()

    async def emit(event) -> None:
        data = encode(event)
        if data:
            await out_send.send(data)

    engine = Engine(model, cfg.n_slots, n_ctx, cfg.state_dir, cfg.prefill_chunk, emit, compute,
                    topk=cfg.topk, perf=cfg.perf)
    await engine.run_model(engine.restore)
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


async def _main_channel(cfg: EngineConfig, model: EngineModel, n_ctx: int, stdin, stdout, out_send,
                        out_recv, compute: ComputeThread) -> int:
    """The Channel protocol: STATUS(idle) when ready, then frames until SHUTDOWN, EOF or SIGTERM
    (exit 0), or a frame that breaks the stream (ERROR with msg_id 0, exit 2: nothing after it
    can be trusted, and nothing persisted is touched)."""
    from colibri.sched.channel_session import ChannelSession
    from colibri.sched.memory import MEMORY_FILE, EpisodicMemory

    async def send(msg_id: int, message: object) -> None:
        await out_send.send(channel.encode(msg_id, message))

    async def no_events(event) -> None:  # every Channel request has its own emit
        return None

    engine = Engine(model, cfg.n_slots, n_ctx, cfg.state_dir, cfg.prefill_chunk, no_events, compute)
    await engine.run_model(engine.restore)
    status = 0
    with EpisodicMemory(None if cfg.state_dir is None else cfg.state_dir / MEMORY_FILE) as memory:
        async with trio.open_nursery() as outer:
            outer.start_soon(_writer, out_recv, stdout)
            async with trio.open_nursery() as work:
                work.start_soon(engine.run)
                session = ChannelSession(engine, send, work, memory)
                await session.status(0, cf.EngineStatus.IDLE)
                with trio.CancelScope() as reading:
                    work.start_soon(_on_sigterm, reading)
                    status = await _read_channel(stdin, session)
                await session.close(commit=status == 0)
                await engine.idle.wait()
                work.cancel_scope.cancel()
            await engine.save_usage()
            await out_send.aclose()
    return status


async def _read_channel(stdin: trio.lowlevel.FdStream, session) -> int:
    """Frames -> the session, in order; the exit status."""
    reader = channel.FrameReader("inbound")
    while not session.shutdown:
        data = await stdin.receive_some(READ_SIZE)
        for event in reader.receive_data(data):
            match event:
                case cf.Frame(msg_id=msg_id, message=message):
                    await session.handle(msg_id, message)
                    if session.shutdown:
                        return 0
                case cf.BadFrame(msg_id=msg_id, code=code, detail=detail):
                    await session.error(msg_id, code, detail)
                case cf.FatalFrame(code=code, detail=detail):
                    print(f"colibri: channel: {code.name}: {detail}", file=sys.stderr, flush=True)
                    await session.error(0, code, detail)
                    return 2
                case cf.EndOfInput():
                    return 0
    return 0


async def _writer(lines: trio.MemoryReceiveChannel[bytes], stdout: trio.lowlevel.FdStream) -> None:
    """The output, one write for what a step emits: a token's DATA and TOPK are two items, and two
    writes wake the reader twice (on two cores, each wake-up takes a core from the compute)."""
    async with stdout:
        async for data in lines:
            await trio.lowlevel.checkpoint()  # the emitting task finishes its step's events first
            batch = [data]
            while True:
                try:
                    batch.append(lines.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            try:
                await stdout.send_all(b"".join(batch))
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
