"""The legacy protocol's session (serve_protocol.md, SERVE=1): one conversation whose user lines are
rendered with the chat template over the history, RESET, MORE, CANCEL, raw PROMPTs, all on KV slot 0
unless a PROMPT names another; and the encoder that turns the engine's events into legacy output.

A user line is the client's text: it goes to tokens by the trust rule (``ModelText.encode_chat``),
so ``<|im_end|>`` typed into ``coli chat`` is text, never the end of a turn. A PROMPT frame is the
explicit opt-in to raw text whose control-token text is parsed (the host renders its own template).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from colibri.io import legacy
from colibri.io.events import Data, Done, EndOfInput, Error, ErrorCode, ProtocolError, Submit
from colibri.model.harmony import split_harmony
from colibri.model.sampling import SamplingParams
from colibri.sched import telemetry
from colibri.sched.engine import Engine
from colibri.sched.requests import Request
from colibri.sched.session import Receive


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

    def __init__(self, engine: Engine, out: trio.MemorySendChannel[bytes], work: trio.Nursery,
                 max_tokens: int) -> None:
        """``max_tokens``: the answer length when the client gives none."""
        self.engine, self.out, self.work, self.max_tokens = engine, out, work, max_tokens
        self.encode = legacy_encoder()
        self.messages: list[dict[str, str]] = []
        # The last answer as generated (its ids and text, over the MOREs that continued it): MORE
        # feeds the ids back as they were; the history holds its text (a harmony reply's answer
        # alone: the template writes its own headers around it).
        self.reply_ids: list[int] = []
        self.reply_text = b""
        self.current: Request | None = None  # the request generating now
        self.next_id = 1

    async def emit(self, event: object) -> None:
        data = self.encode(event)
        if data:
            await self.out.send(data)

    async def open(self) -> None:
        """The legacy protocol has no greeting: the host writes first."""

    async def close(self, status: int) -> None:
        """Nothing of its own to end: the answer in flight finishes in the drain that follows."""

    async def read(self, receive: Receive) -> int:
        """Inputs until EOF, answered one at a time, in order."""
        reader = legacy.LegacyReader()
        queue_send, queue_recv = trio.open_memory_channel(math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._answer_in_order, queue_recv)
            async with queue_send:
                while True:
                    data = await receive()
                    for event in reader.receive_data(data):
                        if isinstance(event, EndOfInput):
                            return 0
                        if isinstance(event, legacy.CancelAnswer):
                            if self.current is not None:
                                self.engine.cancel(self.current.id)
                            continue
                        await queue_send.send(event)

    async def _answer_in_order(self, events) -> None:
        async for event in events:
            await self._handle(event)

    async def _handle(self, event) -> None:
        text = self.engine.model.text
        match event:
            case legacy.Reset():
                self.messages = []
                await self.emit(Done(0, 0, 0.0, 0.0, telemetry.rss_gb(), 0, False))
            case ProtocolError(code=code):
                await self.emit(Error(0, code))
            case legacy.UserLine(text=line):
                self.messages.append({"role": "user", "content": line})
                prompt = text.encode_chat(self.messages)
                self.messages.append({"role": "assistant", "content": ""})
                self.reply_ids, self.reply_text = [], b""
                await self._generate(prompt, self.max_tokens, 0.0, 1.0, 0)
            case legacy.More():
                if not self.messages or self.messages[-1]["role"] != "assistant":
                    await self.emit(Error(0, ErrorCode.EMPTY_PROMPT))
                    return
                await self._generate(text.encode_chat(self.messages[:-1]) + self.reply_ids,
                                     self.max_tokens, 0.0, 1.0, 0)
            case legacy.RawPrompt():
                e = event
                await self._generate(e.prompt, e.max_tokens, e.temperature, e.top_p, e.slot)

    async def _generate(self, prompt: str | list[int], max_tokens: int, temperature: float, top_p: float,
                        slot: int) -> None:
        """``prompt``: token ids (a chat, by the trust rule), or a PROMPT frame's raw text."""
        if isinstance(prompt, str):
            sub = Submit(self.next_id, slot, max_tokens, temperature, top_p, prompt)
        else:
            sub = Submit(self.next_id, slot, max_tokens, temperature, top_p, "", prompt_ids=tuple(prompt))
        self.next_id += 1
        error = self.engine.check(sub)
        if error is not None:
            await self.emit(error)
            return
        text: list[bytes] = []
        ids: list[int] = []
        ended = trio.Event()

        async def capture(event) -> None:
            if isinstance(event, Data):
                text.append(event.text)
                if event.token is not None:
                    ids.append(event.token)
            await self.emit(event)
            if isinstance(event, Done | Error):
                ended.set()

        self.current = self.engine.start(sub, self.work, capture,
                                         SamplingParams(temperature=temperature, top_p=top_p))
        await ended.wait()
        self.current = None
        # (a PROMPT frame's answer is not the conversation's: a host's own rendering, on any slot)
        if self.messages and self.messages[-1]["role"] == "assistant" and not isinstance(prompt, str):
            self.reply_ids += ids
            self.reply_text += b"".join(text)
            reply = self.reply_text.decode("utf-8", errors="replace")
            harmony = self.engine.model.text.tokenizer.harmony
            self.messages[-1]["content"] = split_harmony(reply)[1] if harmony else reply
