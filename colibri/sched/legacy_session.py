"""The legacy protocol's single conversation (serve_protocol.md, SERVE=1): user lines rendered with
the chat template over the history, RESET, MORE, CANCEL, raw PROMPTs, all on KV slot 0 unless a
PROMPT names another; and the encoder that turns the engine's events into legacy output."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio

from colibri.io import legacy
from colibri.io.events import Data, Done, EndOfInput, Error, ErrorCode, ProtocolError, Submit
from colibri.model.sampling import SamplingParams
from colibri.sched import telemetry
from colibri.sched.engine import Engine
from colibri.sched.requests import Emit, Request


def legacy_encoder() -> Callable[[object], bytes]:
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


class LegacySession:
    """The single conversation of the legacy protocol: user lines are rendered with the chat
    template over the history; RESET forgets it; MORE continues a cut answer; CANCEL stops the
    answer in progress. Inputs are answered one at a time, in order; CANCEL acts at once."""

    def __init__(self, engine: Engine, emit: Emit, work: trio.Nursery, max_tokens: int) -> None:
        """``max_tokens``: the answer length when the client gives none."""
        self.engine, self.emit, self.work, self.max_tokens = engine, emit, work, max_tokens
        self.messages: list[dict[str, str]] = []
        self.current: Request | None = None  # the request generating now
        self.next_id = 1

    async def read(self, receive: Callable[[], Awaitable[bytes]]) -> None:
        """Inputs from ``receive`` (b"" at EOF) until EOF."""
        reader = legacy.LegacyReader()
        queue_send, queue_recv = trio.open_memory_channel(math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._answer_in_order, queue_recv)
            async with queue_send:
                while True:
                    data = await receive()
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
                await self._generate(prompt, self.max_tokens, 0.0, 1.0, 0)
            case legacy.More():
                if not self.messages or self.messages[-1]["role"] != "assistant":
                    await self.emit(Error(0, ErrorCode.EMPTY_PROMPT))
                    return
                prompt = chat.render(self.messages[:-1]) + self.messages[-1]["content"]
                await self._generate(prompt, self.max_tokens, 0.0, 1.0, 0)
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
