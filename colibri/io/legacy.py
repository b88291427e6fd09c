"""The legacy protocol (single slot, interactive; ``coli chat``), sans-IO.

Input: a plain line is a user message; control frames start with ``\\x02``:
``\\x02RESET`` clears the conversation, ``\\x02MORE`` continues an answer cut by the token limit,
``\\x02CANCEL`` (colibri's addition) stops the answer in progress,
``\\x02PROMPT <bytes> <max_tokens> <temperature> <top_p> [kv_slot]\\n<prompt>\\n`` sends a fully
rendered prompt (the pre-mux API mode). Output: the answer as raw UTF-8 text, then the END sentinel
line and a STAT line. A rejected input is answered ``\\x01\\x01ERROR <CODE>\\x01\\x01``, then END and
STAT, so a client waiting for END never hangs. Framing errors resynchronise as in the mux protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from colibri.io.buffer import ReceiveBuffer
from colibri.io.events import EndOfInput, ErrorCode, ProtocolError
from colibri.io.framing import (
    FrameReader,
    Item,
    Line,
    Overlong,
    Payload,
    Truncated,
    Unframed,
    Unterminated,
)

# Engine output: answer text never holds \x01 (the engine drops it), so \x01\x01 can only start a
# sentinel line.
SENTINEL = b"\x01\x01"
END_LINE = b"\x01\x01END\x01\x01"
ERROR_PREFIX = b"\x01\x01ERROR "  # \x01\x01ERROR <CODE>\x01\x01: no answer text can look like it
# Client input: a leading \x02 marks a control frame; nobody types it, and encode_input strips it.
CONTROL = b"\x02"
# An interactive line is typed by a person or pasted: 1 MiB bounds what we buffer.
MAX_LINE = 1 << 20
# Largest PROMPT payload, as the mux protocol's SUBMIT (a rendered prompt; mux.MAX_PAYLOAD): 16 MiB
# is far past any context and bounds what a client can make the engine buffer.
MAX_PAYLOAD = 16 << 20
# The most tokens a PROMPT may ask for, as the mux protocol: past any context length.
MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class UserLine:
    """A plain line: the user's next message (the engine applies the chat template)."""

    text: str


@dataclass(frozen=True)
class Reset:
    """``\\x02RESET``: forget the conversation."""


@dataclass(frozen=True)
class More:
    """``\\x02MORE``: continue an answer the token limit cut."""


@dataclass(frozen=True)
class CancelAnswer:
    """``\\x02CANCEL`` (a colibri extension): stop the answer being generated, keep the program."""


@dataclass(frozen=True)
class RawPrompt:
    """``\\x02PROMPT``: a prompt the client rendered itself (the pre-mux API mode)."""

    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    slot: int = 0


@dataclass(frozen=True)
class Answer:
    """Part of an answer's text (engine -> client)."""

    text: bytes


@dataclass(frozen=True)
class End:
    """End of an answer: the END sentinel and the STAT line (fields as the mux DONE's STAT)."""

    emitted: int = 0
    tok_s: float = 0.0
    hit_pct: float = 0.0
    rss_gb: float = 0.0
    prompt_tokens: int = 0
    length_limited: bool = False


@dataclass(frozen=True)
class Failed:
    """A rejected input (engine -> client): ``ERROR <CODE>`` then End."""

    code: ErrorCode


LegacyInput = UserLine | Reset | More | CancelAnswer | RawPrompt | ProtocolError | EndOfInput


class LegacyReader:
    """Engine side: bytes from the client -> inputs."""

    def __init__(self) -> None:
        # The header kept until its payload arrives: a RawPrompt with an empty prompt, or None for a
        # rejected header whose payload is still read (its lines are not user messages).
        self._frames: FrameReader[RawPrompt | None] = FrameReader(MAX_LINE + 1)  # + 1: a CR
        self._eof = False

    def receive_data(self, data: bytes) -> list[LegacyInput]:
        """Feed bytes (``b""`` means end of input) and return the complete inputs."""
        if self._eof:
            return []
        if data:
            self._frames.feed(data)
        out: list[LegacyInput] = []
        while (item := self._frames.next_item()) is not None:
            out.extend(self._interpret(item))
        if not data:
            self._eof = True
            tail = self._frames.close()
            if isinstance(tail, Unterminated):  # a last line without its \n is still a line ...
                out.extend(self._line(tail.data))
                tail = self._frames.close()  # ... and if it was a PROMPT header, its payload is missing
            if isinstance(tail, Truncated):
                out.append(ProtocolError(0, ErrorCode.BAD_FRAME, "EOF in a PROMPT frame"))
            out.append(EndOfInput())
        return out

    def _interpret(self, item: Item[RawPrompt | None]) -> list[LegacyInput]:
        match item:
            case Line(data=line):
                return self._line(line)
            case Payload(header=None):
                return []  # the header was answered already
            case Payload(header=header, data=payload):
                try:
                    text = payload.decode("utf-8")
                except UnicodeDecodeError:
                    return [ProtocolError(0, ErrorCode.BAD_REQUEST, "payload is not UTF-8")]
                if not text:
                    return [ProtocolError(0, ErrorCode.EMPTY_PROMPT)]
                return [replace(header, prompt=text)]
            case Unframed():
                return [ProtocolError(0, ErrorCode.BAD_FRAME, "payload not followed by newline")]
            case Overlong():
                return [ProtocolError(0, ErrorCode.BAD_FRAME, "line too long")]
        return []  # no other items

    def _line(self, line: bytes) -> list[LegacyInput]:
        """A line: a user message, a control frame, or a PROMPT header (its payload follows)."""
        if line.endswith(b"\r"):
            line = line[:-1]  # a terminal or a Windows client: the CR is not part of the message
        if len(line) > MAX_LINE:
            return [ProtocolError(0, ErrorCode.BAD_FRAME, "line too long")]
        if not line.startswith(CONTROL):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                return [ProtocolError(0, ErrorCode.BAD_REQUEST, "line is not UTF-8")]
            if not text.strip():
                return [ProtocolError(0, ErrorCode.EMPTY_PROMPT)]
            return [UserLine(text)]
        fields = line[1:].split(b" ")
        if fields == [b"RESET"]:
            return [Reset()]
        if fields == [b"MORE"]:
            return [More()]
        if fields == [b"CANCEL"]:
            return [CancelAnswer()]
        if fields[0] != b"PROMPT" or len(fields) not in (5, 6):
            return [ProtocolError(0, ErrorCode.BAD_REQUEST, f"unknown control frame {line[:32]!r}")]
        return self._prompt(fields)

    def _prompt(self, fields: list[bytes]) -> list[LegacyInput]:
        """A ``PROMPT <bytes> <max_tokens> <temperature> <top_p> [kv_slot]`` header: nothing yet
        (the payload follows) or its rejection."""
        try:
            n = int(fields[1]) if fields[1].isdigit() else -1
        except ValueError:  # more digits than int() converts
            n = -1
        if n < 0:  # where the payload ends is unknown: its lines are read as lines
            return [ProtocolError(0, ErrorCode.BAD_REQUEST, "bad PROMPT byte count")]
        if n > MAX_PAYLOAD:
            self._frames.skip_payload(n)  # as the mux reader: the payload's lines are not user messages
            return [ProtocolError(0, ErrorCode.BAD_REQUEST, f"payload over {MAX_PAYLOAD} bytes")]
        try:
            if not fields[2].isdigit() or int(fields[2]) > MAX_TOKENS_LIMIT:
                raise ValueError
            temperature, top_p = float(fields[3]), float(fields[4])
            slot = int(fields[5]) if len(fields) == 6 and fields[5].isdigit() else 0
            if len(fields) == 6 and not fields[5].isdigit():
                raise ValueError
            if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1):
                raise ValueError
        except ValueError:
            self._frames.expect_payload(n, None)
            return [ProtocolError(0, ErrorCode.BAD_REQUEST, "bad PROMPT field")]
        self._frames.expect_payload(n, RawPrompt("", int(fields[2]), temperature, top_p, slot))
        return []


def encode_output(event: Answer | End | Failed) -> bytes:
    """Engine side: an output's bytes (answer text as it is; END and ERROR as sentinel lines)."""
    match event:
        case Answer(text=text):
            return text
        case End():
            e = event
            return END_LINE + b"\n" + (
                f"STAT {e.emitted} {e.tok_s:.2f} {e.hit_pct:.1f} {e.rss_gb:.2f} "
                f"{e.prompt_tokens} {int(e.length_limited)}\n"
            ).encode()
        case Failed(code=code):
            return ERROR_PREFIX + str(code).encode() + SENTINEL + b"\n"
    raise TypeError(f"not a legacy output: {event!r}")


def encode_input(event: UserLine | Reset | More | CancelAnswer | RawPrompt) -> bytes:
    """Client side: an input's bytes. A user line is made one line that cannot start a control
    frame; PROMPT floats are written with ``repr``, so they arrive exactly."""
    match event:
        case UserLine(text=text):
            # one line, and never a control frame: a leading \x02 is the frames' marker
            return text.replace("\n", " ").lstrip("\x02").encode() + b"\n"
        case Reset():
            return CONTROL + b"RESET\n"
        case More():
            return CONTROL + b"MORE\n"
        case CancelAnswer():
            return CONTROL + b"CANCEL\n"
        case RawPrompt():
            e = event
            payload = e.prompt.encode()
            head = f"PROMPT {len(payload)} {e.max_tokens} {e.temperature!r} {e.top_p!r} {e.slot}\n"
            return CONTROL + head.encode() + payload + b"\n"
    raise TypeError(f"not a legacy input: {event!r}")


class OutputReader:
    """Client side (``coli chat``): engine bytes -> Answer text chunks, Failed, End.

    Answer text never contains ``\\x01`` (the engine drops it), so text flows through up to the
    first ``\\x01``, which starts a sentinel line (END or ERROR) that is held back until complete.
    The text is not line-framed, so this reader takes bytes off a ``ReceiveBuffer`` itself rather
    than through ``FrameReader``; it has no payloads to frame."""

    def __init__(self) -> None:
        self._buf = ReceiveBuffer()
        self._stat_next = False

    def receive_data(self, data: bytes) -> list[Answer | End | Failed]:
        """Feed bytes and return what they complete (text as it arrives, sentinels whole)."""
        self._buf.feed(data)
        out: list[Answer | End | Failed] = []
        while True:
            if self._stat_next:
                line = self._buf.take_line()
                if line is None:
                    return out
                self._stat_next = False
                f = line.decode(errors="replace").split(" ")
                try:
                    out.append(End(int(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5]), f[6] == "1"))
                except (ValueError, IndexError):
                    out.append(End())
                continue
            i = self._buf.find(SENTINEL[:1])
            if i < 0:
                if len(self._buf):
                    out.append(Answer(self._buf.take(len(self._buf)) or b""))
                return out
            if i:
                out.append(Answer(self._buf.take(i) or b""))
                continue
            line = self._buf.take_line()
            if line is None:
                return out
            if line == END_LINE:
                self._stat_next = True
            elif line.startswith(ERROR_PREFIX) and line.endswith(SENTINEL) and len(line) > len(ERROR_PREFIX):
                try:
                    out.append(Failed(ErrorCode(line[len(ERROR_PREFIX) : -len(SENTINEL)].decode())))
                except ValueError:
                    out.append(Failed(ErrorCode.BAD_REQUEST))
