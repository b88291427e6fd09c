"""Drive a real ``coli engine`` process over its stdin/stdout from trio tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import trio

from colibri.io.events import Data, Done, Error, Ready, Submit
from colibri.io.mux import ResponseReader, encode_request

STARTUP_TIMEOUT = 120  # a cold numba cache compiles the kernels first
REQUEST_TIMEOUT = 300


def chat_prompt(question: str, system: str | None = None) -> str:
    """SmolLM2's chat template, as the server renders it before SUBMIT."""
    sys_text = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return (f"<|im_start|>system\n{sys_text}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n")


@dataclass
class Outcome:
    text: bytes = b""
    events: list = field(default_factory=list)
    final: Done | Error | None = None
    finished: trio.Event = field(default_factory=trio.Event)


class EngineProcess:
    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.outcomes: dict[int, Outcome] = defaultdict(Outcome)
        self.unsolicited: list = []  # events for no request (handshake, id-0 errors)
        self.errors: list[Error] = []
        self.ready = trio.Event()
        self.closed = trio.Event()
        self.read_ends: list[type] = []  # the last event each read of stdout completed

    @classmethod
    async def start(cls, nursery: trio.Nursery, *args: str, env: dict[str, str] | None = None,
                    stderr=None) -> EngineProcess:
        cmd = [sys.executable, "-m", "colibri", "engine", *args]
        # PERF lines as ``coli serve`` asks for them (the tests read their figures); a test of the
        # gateway's view passes SERVE_PERF=0.
        full_env = {**os.environ, "SERVE_PERF": "1", **(env or {})}
        proc = await trio.lowlevel.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=stderr, env=full_env)
        engine = cls(proc)
        nursery.start_soon(engine._read)
        with trio.fail_after(STARTUP_TIMEOUT):
            await engine.ready.wait()
        return engine

    async def _read(self) -> None:
        reader = ResponseReader()
        while True:
            data = await self.proc.stdout.receive_some(1 << 16)
            if not data:
                break
            events = reader.receive_data(data)
            if events:
                self.read_ends.append(type(events[-1]))
            for event in events:
                if isinstance(event, Ready):
                    self.ready.set()
                rid = getattr(event, "id", 0)
                if isinstance(event, Error):
                    self.errors.append(event)
                if not rid:
                    self.unsolicited.append(event)
                    continue
                out = self.outcomes[rid]
                out.events.append(event)
                if isinstance(event, Data):
                    out.text += event.text
                if isinstance(event, Done | Error):
                    out.final = event
                    out.finished.set()
        self.closed.set()

    async def send(self, data: bytes) -> None:
        await self.proc.stdin.send_all(data)

    async def submit(self, rid: int, prompt: str, slot: int = 0, max_tokens: int = 24,
                     temperature: float = 0.0, top_p: float = 1.0) -> Outcome:
        await self.send(encode_request(Submit(rid, slot, max_tokens, temperature, top_p, prompt)))
        return self.outcomes[rid]

    async def result(self, rid: int) -> Outcome:
        out = self.outcomes[rid]
        with trio.fail_after(REQUEST_TIMEOUT):
            await out.finished.wait()
        return out

    async def run(self, rid: int, prompt: str, **kw) -> Outcome:
        await self.submit(rid, prompt, **kw)
        return await self.result(rid)

    async def close(self) -> int:
        """EOF on stdin: the engine drains and exits."""
        await self.proc.stdin.aclose()
        with trio.fail_after(REQUEST_TIMEOUT):
            await self.closed.wait()
            return await self.proc.wait()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)


def engine_args(state_dir: Path | None, *extra: str, slots: int = 1, ctx: int = 1024) -> list[str]:
    base = ["--kv-slots", str(slots), "--ctx", str(ctx)]
    base += ["--state-dir", str(state_dir)] if state_dir else ["--no-persist"]
    return base + list(extra)
