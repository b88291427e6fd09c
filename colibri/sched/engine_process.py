"""``coli engine``: the engine process. Loads the model, restores the slots, then serves one of the
three protocols on stdin/stdout until EOF or SIGTERM, finishing in-flight requests first.

One skeleton for every protocol: a trio nursery holds the writer (the only task that writes
stdout), the step loop, a SIGTERM watcher, the session reading stdin (``mux_session.py``,
``legacy_session.py``, ``channel_session.py``: each owns its frames and extras) and a task per
request.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from colibri.hostinfo import GIB
from colibri.model.interface import EngineModel
from colibri.model.kv_cache import DEFAULT_KV_TYPE
from colibri.sched.compute import ComputeThread
from colibri.sched.engine import Engine
from colibri.sched.session import Session
from colibri.sched.speculation import Speculation, resolve
from colibri.settings import prefill_chunks
from colibri.state_files import check_state_dir

if TYPE_CHECKING:
    from colibri.model.loader import Budget

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
    prefill_chunk: int | None  # None: the defaults for the model (``settings.prefill_chunks``)
    protocol: str  # "mux" | "legacy" | "channel"
    topk: bool
    perf: bool = False  # SERVE_PERF=1: the spec's PERF, ENTROPY and GPUS lines before each DONE
    max_tokens: int = 512  # legacy: answer length when the client gives none
    ram_budget: Budget = None  # resident expert copies (MoE): bytes or experts per layer; None: no limit
    kv_type: str = DEFAULT_KV_TYPE  # the KV cache's element type (colibri.model.kv_cache.KV_TYPES)
    cap: int | None = None  # the C engine's positional cap as given (reported once the model loads)
    speculative: str = "off"  # the draft source (speculation.SPECULATIVE_MODES)
    draft_max: int = 16
    draft_min: int = 0


def run_engine(cfg: EngineConfig) -> int:
    """Load the model and serve until EOF or SIGTERM; the exit status."""
    from colibri.model.loader import Model
    from colibri.model.sampling import load_kernels

    if cfg.state_dir is not None:
        check_state_dir(cfg.state_dir)  # no other user can plant files in it (state_files.py)
    with ComputeThread() as compute:  # the model loads and computes on one thread (compute.py)
        mtp = cfg.speculative in ("mtp", "auto") and cfg.draft_max > 0  # its NextN layer, if it has one
        model = compute.call(lambda: Model(cfg.model_path, ram_budget=cfg.ram_budget, kv_type=cfg.kv_type,
                                           mtp=mtp))
        compute.call(load_kernels)  # a sampled request's first token does not wait for it
        n_ctx = min(cfg.n_ctx, model.hp.context_length)
        speculation = resolve(cfg.speculative, cfg.draft_max, model.hp.arch, model.has_draft_layer,
                              cfg.draft_min)
        if cfg.cap is not None:
            print(f"coli engine: {cap_report(cfg.cap, model)}", file=sys.stderr, flush=True)
        return trio.run(_main, cfg, model, n_ctx, compute, speculation)


def cap_report(cap: int, model: EngineModel) -> str:
    """What the C engine's positional cap came to on this model: a host passes one whatever the
    model (colibri's gateway: 0 or 8), so where it means nothing the engine says so."""
    store = model.experts
    if store is None:
        return f"cap {cap} ignored: {model.hp.arch!r} is a dense model, with no experts to keep in RAM"
    budget = "no limit" if store.budget is None else f"{store.budget / GIB:.2f} GiB"
    what = f"{cap} experts per MoE layer" if cap else "0 (auto: --ram-budget or its default)"
    return f"cap {what}: resident experts' budget {budget} over {store.shape[0]} MoE layers"


async def _main(cfg: EngineConfig, model: EngineModel, n_ctx: int, compute: ComputeThread,
                speculation: Speculation) -> int:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    out_send, out_recv = trio.open_memory_channel[bytes](OUTPUT_BUFFER)
    chunks = prefill_chunks(cfg.prefill_chunk, model.experts is not None, model.streams_experts)
    engine = Engine(model, cfg.n_slots, n_ctx, cfg.state_dir, chunks, compute,
                    topk=cfg.topk, perf=cfg.perf,
                    speculation=speculation)
    await engine.run_model(engine.restore)
    status = 0
    async with trio.open_nursery() as outer:
        outer.start_soon(_writer, out_recv, stdout)
        async with trio.open_nursery() as work:
            work.start_soon(engine.run)
            with _session(cfg, engine, out_send, work) as session:
                await session.open()
                with trio.CancelScope() as reading:
                    work.start_soon(_on_sigterm, reading)
                    status = await session.read(partial(stdin.receive_some, READ_SIZE))
                await session.close(status)
                await engine.idle.wait()  # EOF or SIGTERM: in-flight requests finish first
            work.cancel_scope.cancel()
        await engine.save_usage()
        await out_send.aclose()
    return status


@contextmanager
def _session(cfg: EngineConfig, engine: Engine, out: trio.MemorySendChannel[bytes],
             work: trio.Nursery) -> Iterator[Session]:
    """The protocol's session, with what it holds open (the Channel's episodic memory)."""
    if cfg.protocol == "mux":
        from colibri.sched.mux_session import MuxSession
        yield MuxSession(engine, out, work)
    elif cfg.protocol == "legacy":
        from colibri.sched.legacy_session import LegacySession
        yield LegacySession(engine, out, work, cfg.max_tokens)
    else:
        from colibri.sched.channel_session import ChannelSession
        from colibri.sched.memory import MEMORY_FILE, EpisodicMemory
        with EpisodicMemory(None if cfg.state_dir is None else cfg.state_dir / MEMORY_FILE) as memory:
            yield ChannelSession(engine, out, work, memory)


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
