"""``coli channel``: a terminal client of the Channel binary protocol, the engine as a child process.

A person can talk to ``coli engine --protocol channel`` without writing a host: a plain line is a
text turn, the slash commands of HELP are the protocol's other requests. Each request gets a fresh
msg_id and the client reads the frames that answer it (the engine's replies carry it). The engine
runs in its own session so that the terminal's Ctrl-C reaches only us: during a turn it becomes
ABORT, at the prompt it is ignored. The reasoning channel is dim on a terminal and ``[thought] ``
lines otherwise; stats, errors and acknowledgements go to stderr, so piped stdout stays parseable.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import enum
import json
import math
import re
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO

import trio

from colibri.io import channel
from colibri.io import channel_frames as cf

HELP = """\
a plain line is a turn (//TEXT sends TEXT beginning with a slash); the requests:
  /think TEXT        a turn with deliberate reasoning     /direct TEXT   a rendered prompt (\\n: newline)
  /system TEXT       the system prompt (starts over)      /tools FILE    instructions and tools (JSON)
  /set KEY=VALUE ..  temperature top_p min_p top_k max_tokens repeat_penalty repeat_window
                     thinking_budget gate=on|off          (/set alone shows them)
  /resume  /close    after an elastic yield: go on, or close the thought and answer
  /probe [N] TEXT    an autonomic probe, N tokens (1)     /ping
  /save PATH [ID]    /load PATH: snapshots                /recall QUERY  /commit: memory
  /return ID TEXT    a tool call's result                 /quit or Ctrl-D leaves; Ctrl-C stops a turn"""

READ_SIZE = 1 << 16
SHUTDOWN_WAIT_S = 60  # SHUTDOWN ends a turn in flight and commits the memory first
DIM, RESET = "\x1b[2m", "\x1b[0m"
_FLOATS = ("temperature", "top_p", "min_p", "repeat_penalty")
_INTS = ("top_k", "max_tokens", "repeat_window", "thinking_budget")
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


class EngineGone(Exception):
    """The engine's output ended (or cannot be read) without a SHUTDOWN asking for it."""


def channel_chat(engine_args: list[str]) -> int:
    """Start ``coli engine --protocol channel`` with ``engine_args`` and talk to it; the exit status."""
    return trio.run(_main, [sys.executable, "-m", "colibri", "engine", "--protocol", "channel", *engine_args])


async def _main(cmd: list[str]) -> int:
    print(f"colibri channel. {HELP}", file=sys.stderr)
    async with trio.open_nursery() as nursery:
        proc = await trio.lowlevel.open_process(cmd, stdin=-1, stdout=-1, start_new_session=True)
        frames_in, frames_out = trio.open_memory_channel[cf.Frame](math.inf)
        client = Client(proc, frames_out)
        nursery.start_soon(client.read_frames, frames_in)
        nursery.start_soon(client.ctrl_c)
        try:
            status = await client.session()
        finally:
            with trio.move_on_after(10, shield=True):
                await proc.stdin.aclose()  # EOF: an engine still running finishes and exits
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
            nursery.cancel_scope.cancel()
    return status


# ---------------------------------------------------------------- what the replies print


def _name(value: int) -> str:
    """An enum-valued field as words ("max tokens"), its number where this side does not know it."""
    return value.name.lower().replace("_", " ") if isinstance(value, enum.Enum) else f"#{value}"


def error_line(e: cf.Error) -> str:
    return f"error: {e.code.name if isinstance(e.code, enum.Enum) else f'code {e.code}'}: {e.detail}"


def stats_line(t: cf.TurnComplete) -> str:
    yielded = t.stop_reason == cf.StopReason.ELASTIC_YIELD
    hint = "  (/resume goes on, /close closes the thought)" if yielded else ""
    return f"[{t.tokens} tokens, {t.tok_per_sec:.1f} tok/s, {t.elapsed_ms} ms, {_name(t.stop_reason)}]{hint}"


def probe_line(r: cf.AutonomicResult) -> str:
    index = "" if r.selected_index == cf.SELECTED_GENERATIVE else f" index={r.selected_index}"
    text = r.text.decode("utf-8", errors="replace")
    shown = f" text={json.dumps(text, ensure_ascii=False)}" if text else ""
    return (f"probe: winner={r.winning_token}{index} confidence={r.confidence:.4f} entropy={r.entropy:.4f} "
            f"cost_ms={r.cost_ms:.2f}{shown}")


def snapshot_line(s: cf.SnapshotStatus) -> str:
    return (f"snapshot {_name(s.status)}: stream_id={json.dumps(s.stream_id, ensure_ascii=False)} "
            f"clock={s.clock} active_slots={s.active_slots}")


def memory_line(m: cf.MemResponse) -> str:
    return (f"recall: {_name(m.status)} turns={len(m.timestamps)} "
            f"injected_tokens={m.total_injected_tokens} next_cursor={m.next_cursor} "
            f"timestamps={list(m.timestamps)}")


def describe(c: cf.SetConfig) -> str:
    gate = "on" if c.flags & cf.CONFIG_THINKING_GATE else "off"
    values = " ".join(f"{k}={getattr(c, k):g}" for k in (*_FLOATS, *_INTS))
    return f"{values} gate={gate}"


def parse_settings(config: cf.SetConfig, words: list[str]) -> cf.SetConfig:
    """``config`` with the named fields changed; ValueError names a word it cannot take."""
    changes: dict[str, float | int] = {}
    flags = config.flags
    for word in words:
        key, sep, value = word.partition("=")
        try:
            if not sep:
                raise ValueError
            if key in _FLOATS:
                changes[key] = float(value)
            elif key in _INTS:
                changes[key] = int(value)
            elif key == "gate" and value in ("on", "off"):
                flags = flags | cf.CONFIG_THINKING_GATE if value == "on" else flags & ~cf.CONFIG_THINKING_GATE
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"/set: {word!r} is not KEY=VALUE of: {' '.join((*_FLOATS, *_INTS))} "
                             "gate=on|off") from None
    return dataclasses.replace(config, flags=flags, **changes)


def unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` in a line: a rendered prompt needs newlines a line cannot hold."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def _need(arg: str, usage: str) -> str:
    if not arg:
        raise ValueError(f"usage: {usage}")
    return arg


class Printer:
    """A turn's tokens on stdout. Thought and content each go through their own incremental UTF-8
    decoder (a token may end inside a character); a switch between them starts a new line."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.decoders = {kind: codecs.getincrementaldecoder("utf-8")(errors="replace")
                         for kind in ("thought", "content")}
        self.kind: str | None = None  # the channel written last
        self.line_start = True

    def write(self, kind: str, data: bytes, final: bool = False) -> None:
        text = self.decoders[kind].decode(data, final)
        if not text:
            return
        if kind != self.kind and self.kind is not None and not self.line_start:
            self.out.write("\n")
            self.line_start = True
        self.kind = kind
        if kind == "thought" and self.tty:
            self.out.write(DIM + text + RESET)
            self.line_start = text.endswith("\n")
        elif kind == "thought":
            for part in re.findall(r"[^\n]*\n|[^\n]+", text):
                self.out.write(("[thought] " if self.line_start else "") + part)
                self.line_start = part.endswith("\n")
        else:
            self.out.write(text)
            self.line_start = text.endswith("\n")
        self.out.flush()

    def end(self) -> None:
        """The turn's text is over: the decoders' tails, and the line ended."""
        for kind in self.decoders:
            self.write(kind, b"", final=True)
        if not self.line_start:
            self.out.write("\n")
            self.out.flush()
        self.kind, self.line_start = None, True


def _input() -> str:
    return input("> " if sys.stdin.isatty() else "")


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _out(text: str) -> None:
    print(text, flush=True)


class Client:
    """One engine, one conversation: the prompt loop, and the frames that answer each request."""

    def __init__(self, proc: trio.Process, frames: trio.MemoryReceiveChannel[cf.Frame]) -> None:
        self.proc, self.frames = proc, frames
        self.send_lock = trio.Lock()  # the prompt loop and Ctrl-C's ABORT both write the pipe
        self.last_id = 0
        self.config = cf.SetConfig()
        self.printer = Printer(sys.stdout, sys.stdout.isatty())
        self.in_turn = False  # Ctrl-C sends ABORT
        self.starting: trio.CancelScope | None = None  # Ctrl-C before the engine is ready leaves
        self.at_prompt = False  # waiting for a line: the engine's end is said at once
        self.gone = False  # its output ended
        self.commands: dict[str, Callable[[str], Awaitable[None]]] = {
            "/think": self._text_turn(cf.INPUT_FLAG_REASON, "/think TEXT"),
            "/direct": self._text_turn(cf.INPUT_FLAG_DIRECT, "/direct TEXT", unescape),
            "/system": lambda a: self._set_system(cf.SetSystem(a)), "/tools": self._tools,
            "/set": self._set, "/resume": lambda _: self.turn(cf.Resume(cf.RESUME_CONTINUE)),
            "/close": lambda _: self.turn(cf.Resume(cf.RESUME_CLOSE_THOUGHT)), "/probe": self._probe,
            "/save": self._save, "/load": self._load, "/recall": self._recall, "/commit": self._commit,
            "/return": self._return, "/ping": self._ping, "/help": self._help,
        }

    # ------------------------------------------------------------ the session

    async def session(self) -> int:
        """Ready, the prompt loop, SHUTDOWN: the exit status."""
        try:
            with trio.CancelScope() as self.starting:
                await self._ready()
            if self.starting.cancelled_caught:
                return 130  # Ctrl-C while the model loads
            self.starting = None
            while True:
                line = await self._prompt()
                if line is None or line.strip() in ("/quit", "/exit"):
                    return await self._quit()
                await self.dispatch(line)
        except EngineGone:
            self._drain()
            with trio.move_on_after(5):
                await self.proc.wait()
            _err(f"colibri: the engine stopped (exit status {self.proc.returncode})")
            return 1

    async def _ready(self) -> None:
        """Until the engine's STATUS(idle) of msg_id 0."""
        while True:
            frame = await self._frame()
            match frame.message:
                case cf.Status(status=cf.EngineStatus.IDLE) if frame.msg_id == 0:
                    return
                case cf.Error() as error:
                    _err(error_line(error))

    async def _prompt(self) -> str | None:
        """A line typed; None at Ctrl-D; EngineGone once the engine's output ended. The thread
        reading the line is never abandoned: one blocked in stdin at exit aborts the interpreter,
        so an engine gone at the prompt is said at once (read_frames) and acted on at the line."""
        self.at_prompt = True
        try:
            while not self.gone:
                try:
                    line = await trio.to_thread.run_sync(_input)
                except EOFError:
                    line = None
                except UnicodeDecodeError as e:
                    _err(f"error: the line is not UTF-8: {e}")
                    continue
                if not self.gone:
                    return line
            raise EngineGone
        finally:
            self.at_prompt = False

    async def _quit(self) -> int:
        """SHUTDOWN, then the engine's exit: 0 if it exits 0."""
        with contextlib.suppress(EngineGone):
            await self.send(cf.Shutdown())
        with trio.move_on_after(SHUTDOWN_WAIT_S):
            async for frame in self.frames:  # until its output ends; late refusals are shown
                if isinstance(frame.message, cf.Error):
                    _err(error_line(frame.message))
            await self.proc.wait()
        if self.proc.returncode is None:
            _err("colibri: the engine did not exit")
        elif self.proc.returncode:
            _err(f"colibri: the engine exited with status {self.proc.returncode}")
        return 0 if self.proc.returncode == 0 else 1

    def _drain(self) -> None:
        """The refusals still buffered when the engine went away: often they say why."""
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
            while True:
                if isinstance((frame := self.frames.receive_nowait()).message, cf.Error):
                    _err(error_line(frame.message))

    async def read_frames(self, out: trio.MemorySendChannel[cf.Frame]) -> None:
        """The engine's stdout as frames; the channel closes when it ends or cannot be trusted."""
        reader = channel.FrameReader("outbound")
        async with out:
            while not self.gone:
                data = await self.proc.stdout.receive_some(READ_SIZE)
                for event in reader.receive_data(data):
                    match event:
                        case cf.Frame():
                            await out.send(event)
                        case cf.BadFrame(code=code, detail=detail):
                            _err(f"colibri: a frame from the engine refused: {code.name}: {detail}")
                        case cf.FatalFrame(code=code, detail=detail):
                            _err(f"colibri: the engine's output cannot be read: {code.name}: {detail}")
                            self.gone = True
                        case cf.EndOfInput():
                            self.gone = True
        if self.at_prompt:  # a frame wait sees the channel's end itself
            _err("\ncolibri: the engine's output ended (Enter leaves)")

    async def ctrl_c(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                if self.starting is not None:
                    self.starting.cancel()
                elif self.in_turn:
                    with contextlib.suppress(EngineGone):  # the turn's frame wait sees it
                        await self.send(cf.Abort())
                else:
                    _err("\n(Ctrl-D or /quit to leave)")

    # ------------------------------------------------------------ requests and their replies

    async def send(self, message: cf.Inbound) -> int:
        """One frame with a fresh msg_id (1..65535, wrapping); ValueError for one the codec refuses."""
        msg_id = self.last_id % channel.MAX_MSG_ID + 1
        data = channel.encode(msg_id, message)
        self.last_id = msg_id
        async with self.send_lock:
            try:
                await self.proc.stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise EngineGone from None
        return msg_id

    async def _frame(self) -> cf.Frame:
        try:
            return await self.frames.receive()
        except trio.EndOfChannel:
            raise EngineGone from None

    async def reply(self, msg_id: int) -> cf.Message:
        """The next message answering ``msg_id``; another id's refusal is shown (it answers late)."""
        while True:
            frame = await self._frame()
            if frame.msg_id == msg_id:
                return frame.message
            if isinstance(frame.message, cf.Error):
                _err(error_line(frame.message))

    async def request(self, message: cf.Inbound, done: Callable[[cf.Message], bool]) -> cf.Message | None:
        """Send, then read the answers until ``done`` takes one; None after an ERROR (shown)."""
        msg_id = await self.send(message)
        while True:
            answer = await self.reply(msg_id)
            if isinstance(answer, cf.Error):
                _err(error_line(answer))
                return None
            if done(answer):
                return answer

    async def turn(self, message: cf.Inbound) -> None:
        """A turn's frames to the terminal, until TURN_COMPLETE (its stats) or an ERROR."""
        msg_id = await self.send(message)
        self.in_turn = True
        try:
            while True:
                match await self.reply(msg_id):
                    case cf.StreamThought(text=text):
                        self.printer.write("thought", text)
                    case cf.StreamContent(text=text):
                        self.printer.write("content", text)
                    case cf.ToolCall(call_id=call_id, name=name, arguments=arguments):
                        self.printer.end()
                        _out(f"[tool call {call_id}] {name} {arguments}")
                        _err(f"(/return {call_id} RESULT answers it)")
                    case cf.TurnComplete() as complete:
                        self.printer.end()
                        _err(stats_line(complete))
                        return
                    case cf.Error() as error:
                        self.printer.end()
                        _err(error_line(error))
                        return
        finally:
            self.in_turn = False
            self.printer.end()

    async def dispatch(self, line: str) -> None:
        text = line.strip()
        if not text:
            return
        name, _, arg = text.partition(" ")
        try:
            if not text.startswith("/") or text.startswith("//"):
                await self.turn(cf.StreamInput.of_text(text[1:] if text.startswith("//") else text))
            elif name in self.commands:
                await self.commands[name](arg.strip())
            else:
                _err(f"unknown command {name}: /help lists them")
        except (ValueError, OSError) as e:  # a request the codec refuses, a file /tools cannot read
            _err(f"error: {e}")

    # ------------------------------------------------------------ the commands

    def _text_turn(self, flags: int, usage: str,
                   edit: Callable[[str], str] = str) -> Callable[[str], Awaitable[None]]:
        return lambda arg: self.turn(cf.StreamInput.of_text(edit(_need(arg, usage)), flags))

    async def _tools(self, arg: str) -> None:
        path = Path(_need(arg, "/tools FILE")).expanduser()
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:  # OSError names the file itself
            raise ValueError(f"{path}: {e}") from None
        if isinstance(obj, list):
            obj = {"tools": obj}
        if not (isinstance(obj, dict) and isinstance(obj.get("tools", []), list)
                and isinstance(obj.get("instructions", ""), str)):
            raise ValueError(f'{path}: not {{"instructions": TEXT, "tools": [...]}}')
        await self._set_system(cf.SetSystem(obj.get("instructions", ""), tuple(obj.get("tools", [])), obj))

    async def _set_system(self, message: cf.SetSystem) -> None:
        if await self.request(message, lambda m: isinstance(m, cf.Status)) is not None:
            _err(f"(system prompt set, {len(message.tools)} tools: the conversation starts over)")

    async def _set(self, arg: str) -> None:
        if not arg:
            return _out(f"settings: {describe(self.config)}")
        config = parse_settings(self.config, arg.split())
        if await self.request(config, lambda m: isinstance(m, cf.Status)) is not None:
            self.config = config
            _err(f"(settings: {describe(config)})")

    async def _probe(self, arg: str) -> None:
        first, _, rest = arg.partition(" ")
        steps = 1
        if first.isdigit():
            steps, arg = int(first), rest.strip()
        await self._show(cf.ProbeAutonomic(steps, (), _need(arg, "/probe [N] TEXT")), cf.AutonomicResult,
                         probe_line)

    async def _save(self, arg: str) -> None:
        words = shlex.split(arg)
        if len(words) not in (1, 2):
            raise ValueError("usage: /save PATH [STREAM_ID]")
        await self._show(cf.SnapshotSave(words[0], words[1] if len(words) == 2 else ""), cf.SnapshotStatus,
                         snapshot_line)

    async def _load(self, arg: str) -> None:
        await self._show(cf.SnapshotLoad(_need(arg, "/load PATH")), cf.SnapshotStatus, snapshot_line)

    async def _recall(self, arg: str) -> None:
        query = cf.MemQuery(0, 3, 0, 0, 1.0, 0.0, 0.0, _need(arg, "/recall QUERY"))
        await self._show(query, cf.MemResponse, memory_line)

    async def _show(self, message: cf.Inbound, answer: type, line: Callable[..., str]) -> None:
        """A request answered by one message of type ``answer``, printed as ``line`` writes it."""
        got = await self.request(message, lambda m: isinstance(m, answer))
        if got is not None:
            _out(line(got))

    async def _commit(self, arg: str) -> None:
        done = lambda m: isinstance(m, cf.Status) and m.status != cf.EngineStatus.CONSOLIDATING  # noqa: E731
        if await self.request(cf.MemCommit(), done) is not None:
            _err("(memory committed)")

    async def _return(self, arg: str) -> None:
        call_id, _, result = arg.partition(" ")
        if not call_id or not result.strip():
            raise ValueError("usage: /return ID TEXT")
        await self.turn(cf.ToolReturn(call_id, False, result.strip()))

    async def _ping(self, arg: str) -> None:
        t0 = time.perf_counter()
        if await self.request(cf.Ping(), lambda m: isinstance(m, cf.Pong)) is not None:
            _out(f"pong ({(time.perf_counter() - t0) * 1000:.1f} ms)")

    async def _help(self, arg: str) -> None:
        _err(HELP)
