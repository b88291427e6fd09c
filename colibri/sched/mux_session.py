"""The mux protocol's session (serve_protocol.md, SERVE_BATCH=1): SUBMIT, CANCEL, STOP and FORGET
lines from a gateway, each request's events encoded as response lines; READY and the start-up
telemetry first.
"""

from __future__ import annotations

import sys

import trio

from colibri.io import mux
from colibri.io.events import (
    Cancel,
    Data,
    EndOfInput,
    Error,
    ErrorCode,
    Forget,
    ProtocolError,
    Ready,
    Stat,
    Stop,
    Submit,
)
from colibri.sched import telemetry
from colibri.sched.engine import Engine
from colibri.sched.session import Receive


class MuxSession:
    def __init__(self, engine: Engine, out: trio.MemorySendChannel[bytes], work: trio.Nursery) -> None:
        self.engine, self.out, self.work = engine, out, work
        # Slots a FORGET named, forgotten when their next SUBMIT starts: a slot may still be ending
        # its previous request when the FORGET arrives, never when a SUBMIT it admits does.
        self.forgetting: set[int] = set()

    async def emit(self, event: object) -> None:
        if isinstance(event, Data) and not event.text:
            return  # a token whose character is not complete yet: its text comes with the next
        line = mux.encode_response(event)
        try:
            # No yield while there is room: a step's lines (a drafted request's several tokens,
            # each DATA with its TOPK) queue up whole, and the writer sends them in one write
            # once the step loop waits on the next step (engine_process._writer).
            self.out.send_nowait(line)
        except trio.WouldBlock:
            await self.out.send(line)

    @property
    def max_payload(self) -> int:
        """The largest SUBMIT payload that can fit the context: no token is more than the
        vocabulary's longest token in text, nor more than its largest id and a comma as an id."""
        engine = self.engine
        per_token = max(engine.tokenizer.max_token_bytes, len(str(engine.model.hp.n_vocab)) + 1)
        return mux.payload_limit(engine.n_ctx, per_token)

    async def open(self) -> None:
        for event in (Ready(), Stat(telemetry.rss_gb()), telemetry.hwinfo(),
                      *self.engine.expert_telemetry(hits=False)):
            await self.emit(event)

    async def read(self, receive: Receive) -> int:
        """Requests until EOF; a malformed line is answered with its ERROR and reading goes on."""
        reader = mux.RequestReader(max_payload=self.max_payload)
        while True:
            for event in reader.receive_data(await receive()):
                match event:
                    case Submit():
                        error = self.engine.check(event)
                        if error is not None:
                            await self.emit(error)
                        else:
                            if event.slot in self.forgetting:
                                self.forgetting.discard(event.slot)
                                self.engine.forget(event.slot)
                            self.engine.start(event, self.work, self.emit)
                    case Forget(slot=slot):
                        if slot < len(self.engine.slots):
                            self.forgetting.add(slot)
                        else:
                            await self.emit(Error(0, ErrorCode.BAD_REQUEST))
                    case Cancel(id=rid):
                        if not self.engine.cancel(rid):
                            await self.emit(Error(rid, ErrorCode.NOT_FOUND))
                    case Stop(id=rid):
                        if not self.engine.stop(rid):
                            await self.emit(Error(rid, ErrorCode.NOT_FOUND))
                    case ProtocolError(id=rid, code=code, detail=detail):
                        print(f"colibri: {code}: {detail}", file=sys.stderr, flush=True)
                        await self.emit(Error(rid, code))
                    case EndOfInput():
                        return 0

    async def close(self, status: int) -> None:
        """Nothing of its own to end: in-flight requests finish in the drain that follows."""
