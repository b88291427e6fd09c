"""Drive a real ``coli engine --protocol channel`` over pipes with the project's own codec: the host
side of the protocol (encode requests, decode replies), as a host would."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from colibri.io import channel
from colibri.io import channel_frames as cf

START_TIMEOUT = 180.0  # a cold numba cache compiles the kernels first
REPLY_TIMEOUT = 120.0


def engine_command(*args: str) -> list[str]:
    persist = [] if "--state-dir" in args else ["--no-persist"]
    return [sys.executable, "-m", "colibri", "engine", "--protocol", "channel", "--ctx", "1024",
            *persist, *args]


@dataclass
class TurnFrames:
    """What one turn sent back, in order."""

    frames: list[cf.Frame] = field(default_factory=list)

    def of(self, kind: type) -> list:
        return [f.message for f in self.frames if isinstance(f.message, kind)]

    @property
    def content(self) -> bytes:
        return b"".join(m.text for m in self.of(cf.StreamContent))

    @property
    def thought(self) -> bytes:
        return b"".join(m.text for m in self.of(cf.StreamThought))

    @property
    def complete(self) -> cf.TurnComplete:
        [done] = self.of(cf.TurnComplete)
        return done


class ChannelEngine:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(engine_command(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self.reader = channel.FrameReader("outbound")
        self.pending: list = []
        self.next_id = 1
        ready = self.next_event(START_TIMEOUT)
        assert isinstance(ready, cf.Frame) and ready.msg_id == 0, ready
        assert ready.message.status == cf.EngineStatus.IDLE, ready

    def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, message: object, msg_id: int | None = None) -> int:
        if msg_id is None:
            msg_id, self.next_id = self.next_id, self.next_id % 0xFFFF + 1
        self.write(channel.encode(msg_id, message))
        return msg_id

    def next_event(self, timeout: float = REPLY_TIMEOUT):
        deadline = time.monotonic() + timeout
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no frame in {timeout} s; stderr: {self.stderr_now()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                data = os.read(self.proc.stdout.fileno(), 1 << 16)
                self.pending += self.reader.receive_data(data)
        return self.pending.pop(0)

    def reply(self, message: object, timeout: float = REPLY_TIMEOUT) -> cf.Frame:
        """Send one request and return the first frame that answers it (STATUS frames skipped)."""
        msg_id = self.send(message)
        while True:
            event = self.next_event(timeout)
            assert isinstance(event, cf.Frame), event
            if event.msg_id == msg_id and not isinstance(event.message, cf.Status):
                return event

    def until(self, msg_id: int, kind: type, timeout: float = REPLY_TIMEOUT) -> TurnFrames:
        """Every frame for ``msg_id`` up to and including the first of ``kind``."""
        turn = TurnFrames()
        while True:
            event = self.next_event(timeout)
            assert isinstance(event, cf.Frame), event
            if event.msg_id != msg_id:
                continue
            turn.frames.append(event)
            if isinstance(event.message, kind):
                return turn

    def turn(self, message: object, timeout: float = REPLY_TIMEOUT) -> TurnFrames:
        """A turn-starting request and its frames through TURN_COMPLETE and the STATUS(idle) after."""
        msg_id = self.send(message)
        turn = self.until(msg_id, cf.TurnComplete, timeout)
        after = self.until(msg_id, cf.Status, timeout)
        turn.frames += after.frames
        return turn

    def say(self, text: str, flags: int = 0) -> TurnFrames:
        return self.turn(cf.StreamInput(int(cf.DataType.TEXT), flags, text.encode()))

    def configure(self, **fields) -> None:
        reply = self.send(cf.SetConfig(**fields))
        status = self.until(reply, cf.Status)
        assert not status.of(cf.Error), status.frames

    def stderr_now(self) -> str:
        return "(running)" if self.proc.poll() is None else self.proc.stderr.read().decode(errors="replace")

    def close(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            try:
                self.send(cf.Shutdown())
            except BrokenPipeError:
                pass
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass


def text_input(text: str, flags: int = 0) -> cf.StreamInput:
    return cf.StreamInput(int(cf.DataType.TEXT), flags, text.encode())


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
