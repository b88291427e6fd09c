"""``coli engine``: the engine process. Loads the model, restores the slots, then serves one of the
two protocols on stdin/stdout until EOF or SIGTERM, finishing in-flight requests first.

One trio nursery holds everything: the writer (the only task that writes stdout: one line per
write), the reader (stdin -> codec -> core), the step loop, a SIGTERM watcher, and a task per
request.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from colibri.io import legacy, mux
from colibri.io.events import (
    Cancel,
    Data,
    Done,
    EndOfInput,
    Error,
    ErrorCode,
    ProtocolError,
    Ready,
    Stat,
    Submit,
)
from colibri.model.sampling import SamplingParams
from colibri.sched import telemetry
from colibri.sched.core import Engine

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
    max_tokens: int = 512  # legacy: answer length when the client gives none
    ram_budget: int | None = None  # bytes of resident expert copies (MoE); None: no limit


def serve(cfg: EngineConfig) -> int:
    from colibri.model.loader import Model

    model = Model(cfg.model_path, ram_budget=cfg.ram_budget)
    n_ctx = min(cfg.n_ctx, model.hp.context_length)
    return trio.run(_main, cfg, model, n_ctx)


async def _main(cfg: EngineConfig, model, n_ctx: int) -> int:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    out_send, out_recv = trio.open_memory_channel[bytes](OUTPUT_BUFFER)
    encode = mux.encode_response if cfg.protocol == "mux" else _legacy_encoder()

    async def emit(event) -> None:
        data = encode(event)
        if data:
            await out_send.send(data)

    engine = Engine(model, cfg.n_slots, n_ctx, cfg.state_dir, cfg.prefill_chunk, emit, topk=cfg.topk)
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
                    await _LegacySession(engine, emit, work, cfg).read(stdin)
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


async def _read_mux(stdin, engine: Engine, emit, work: trio.Nursery) -> None:
    reader = mux.RequestReader()
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
                case ProtocolError(id=rid, code=code, detail=detail):
                    print(f"colibri: {code}: {detail}", file=sys.stderr, flush=True)
                    await emit(Error(rid, code))
                case EndOfInput():
                    return


def _legacy_encoder():
    """Core events -> legacy output: the answer's text, then END and STAT."""

    def encode(event) -> bytes:
        match event:
            case Data(text=text):
                return legacy.encode_output(legacy.Answer(text.replace(b"\x01", b"")))
            case Done():
                e = event
                return legacy.encode_output(legacy.End(e.emitted, e.tok_s, e.hit_pct, e.rss_gb,
                                                       e.prompt_tokens, e.length_limited))
            case Error(code=code):
                end = legacy.End(rss_gb=telemetry.rss_gb())
                return legacy.encode_output(legacy.Failed(code)) + legacy.encode_output(end)
        return b""  # telemetry has no place in the legacy protocol

    return encode


class _LegacySession:
    """The single conversation of the legacy protocol: user lines are rendered with the chat
    template over the history; RESET forgets it; MORE continues a cut answer; CANCEL stops the
    answer in progress. Inputs are answered one at a time, in order; CANCEL acts at once."""

    def __init__(self, engine: Engine, emit, work: trio.Nursery, cfg: EngineConfig) -> None:
        self.engine, self.emit, self.work, self.cfg = engine, emit, work, cfg
        self.messages: list[dict[str, str]] = []
        self.current = None  # the request generating now
        self.next_id = 1

    async def read(self, stdin) -> None:
        reader = legacy.LegacyReader()
        queue_send, queue_recv = trio.open_memory_channel(math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._answer_in_order, queue_recv)
            async with queue_send:
                while True:
                    data = await stdin.receive_some(READ_SIZE)
                    for event in reader.receive_data(data):
                        if isinstance(event, EndOfInput):
                            return
                        if isinstance(event, legacy.CancelAnswer):
                            if self.current is not None:
                                self.engine.cancel(self.current.id)
                            continue
                        await queue_send.send(event)

    async def _answer_in_order(self, events) -> None:
        async for event in events:
            await self._handle(event)

    async def _handle(self, event) -> None:
        chat = self.engine.model.chat_template
        match event:
            case legacy.Reset():
                self.messages = []
                await self.emit(Done(0, 0, 0.0, 0.0, telemetry.rss_gb(), 0, False))
            case ProtocolError(code=code):
                await self.emit(Error(0, code))
            case legacy.UserLine(text=text):
                self.messages.append({"role": "user", "content": text})
                prompt = chat.render(self.messages)
                self.messages.append({"role": "assistant", "content": ""})
                await self._generate(prompt, self.cfg.max_tokens, 0.0, 1.0, 0)
            case legacy.More():
                if not self.messages or self.messages[-1]["role"] != "assistant":
                    await self.emit(Error(0, ErrorCode.EMPTY_PROMPT))
                    return
                prompt = chat.render(self.messages[:-1]) + self.messages[-1]["content"]
                await self._generate(prompt, self.cfg.max_tokens, 0.0, 1.0, 0)
            case legacy.RawPrompt():
                e = event
                await self._generate(e.prompt, e.max_tokens, e.temperature, e.top_p, e.slot)

    async def _generate(self, prompt: str, max_tokens: int, temperature: float, top_p: float,
                        slot: int) -> None:
        sub = Submit(self.next_id, slot, max_tokens, temperature, top_p, prompt)
        self.next_id += 1
        error = self.engine.check(sub)
        if error is not None:
            await self.emit(error)
            return
        text: list[bytes] = []
        ended = trio.Event()

        async def capture(event) -> None:
            if isinstance(event, Data):
                text.append(event.text)
            await self.emit(event)
            if isinstance(event, Done | Error):
                ended.set()

        self.current = self.engine.start(
            sub, self.work, SamplingParams(temperature=temperature, top_p=top_p), emit=capture
        )
        await ended.wait()
        self.current = None
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages[-1]["content"] += b"".join(text).decode("utf-8", errors="replace")
