"""The Channel protocol's messages (docs/channel_protocol.md), one dataclass each.

Inbound messages flow host -> engine (opcodes 0x0001..0x00FF), outbound ones engine -> host
(0x0101..0x01FF); each class names its opcode in ``OP``. Fields hold the wire's values: integers
in their field's range, floats as read from an f32 (so a float the encoder rounds to f32 comes
back rounded), enum-valued fields as the enum's member when the value is one, the plain int
otherwise (a peer may send a value this side does not know; equality with the int holds either
way). ``Frame``, ``BadFrame``, ``FatalFrame`` and ``EndOfInput`` are what a reader produces
(``colibri/io/channel.py``).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import ClassVar

MAGIC = 0x53554C58
VERSION = 1
HEADER_SIZE = 16
# The protocol's ceiling on payload_len (64 MiB): a reader never buffers more than one header and
# this much, and refuses a larger count as a stream it cannot trust.
MAX_PAYLOAD = 67_108_864


class Op(enum.IntEnum):
    # inbound: host -> engine
    STREAM_INPUT = 0x0001
    ABORT = 0x0002
    MEM_QUERY = 0x0003
    SET_CONFIG = 0x0004
    TOOL_RETURN = 0x0005
    MEM_COMMIT = 0x0006
    SET_SYSTEM = 0x0007
    SNAPSHOT_SAVE = 0x0008
    SNAPSHOT_LOAD = 0x0009
    RESUME = 0x000A
    PING = 0x000E
    SHUTDOWN = 0x000F
    PROBE_AUTONOMIC = 0x0012
    # outbound: engine -> host
    STREAM_CONTENT = 0x0101
    STREAM_THOUGHT = 0x0102
    TURN_COMPLETE = 0x0103
    TOOL_CALL = 0x0104
    MEM_RESPONSE = 0x0105
    STATUS = 0x0106
    SNAPSHOT_STATUS = 0x0107
    AUTONOMIC_RESULT = 0x010C
    PONG = 0x010E
    ERROR = 0x01FF


class ErrorCode(enum.IntEnum):
    BAD_MAGIC = 1
    BAD_VERSION = 2
    PAYLOAD_TOO_LARGE = 3
    UNKNOWN_OPCODE = 4
    MALFORMED_PAYLOAD = 5
    BUSY = 6
    UNSUPPORTED_DATA_TYPE = 7
    UNSUPPORTED_FEATURE = 8
    SNAPSHOT_SAVE_FAILED = 16
    SNAPSHOT_LOAD_FAILED = 17
    INTERNAL = 255


class StopReason(enum.IntEnum):
    END_OF_TURN = 0
    MAX_TOKENS = 1
    ABORTED = 2
    TOOL_CALL = 3
    ELASTIC_YIELD = 4


class DataType(enum.IntEnum):
    TEXT = 0
    TOKENS = 1  # []u32
    EMBEDDINGS = 2  # [][hidden_dim]f16
    AUDIO = 3  # 16 kHz 16-bit mono PCM
    IMAGE = 4  # JPEG or PNG
    PATCHES = 5  # raw RGB/RGBA patch tensors


class EngineStatus(enum.IntEnum):
    IDLE = 0
    ENCODING = 1
    GENERATING = 2
    MEMORY = 3
    CONSOLIDATING = 4


class SnapshotState(enum.IntEnum):
    SAVED = 0
    LOADED = 1
    EXISTS = 2


class MemStatus(enum.IntEnum):
    OK = 0
    NO_MATCHES = 1
    ARCHIVE_EMPTY = 2


INPUT_FLAG_DIRECT = 0x01  # bypass the outer chat-turn wrappers
INPUT_FLAG_REASON = 0x02  # ask for deliberate reasoning
RESUME_CONTINUE = 0
RESUME_CLOSE_THOUGHT = 1
# STREAM_CONTENT / STREAM_THOUGHT token_type
TOKEN_TEXT = 0
TOKEN_AUDIO = 1
TOKEN_IMAGE = 2
TOKEN_CONTROL = 3
# SET_CONFIG flags bits
CONFIG_CRITIQUE = 1
CONFIG_QUIESCENCE = 2
CONFIG_MEMORY_INJECTION = 4
CONFIG_THINKING_GATE = 8
# STATUS flags bits
STATUS_SATURATED = 1
# AUTONOMIC_RESULT selected_index of a generative probe (no candidate won)
SELECTED_GENERATIVE = 0xFFFF


# ---------------------------------------------------------------- inbound (host -> engine)


@dataclass(frozen=True, slots=True)
class StreamInput:
    """Input into layer 0. The codec checks lengths only (TOKENS whole u32s, EMBEDDINGS whole f16s,
    TEXT valid UTF-8); the engine answers a data type it does not serve."""

    OP: ClassVar[Op] = Op.STREAM_INPUT
    data_type: int
    flags: int
    data: bytes

    @classmethod
    def of_text(cls, text: str, flags: int = 0) -> StreamInput:
        return cls(DataType.TEXT, flags, text.encode("utf-8"))

    @classmethod
    def of_tokens(cls, ids: tuple[int, ...] | list[int], flags: int = 0) -> StreamInput:
        return cls(DataType.TOKENS, flags, struct.pack(f"<{len(ids)}I", *ids))

    def text(self) -> str:
        return self.data.decode("utf-8")

    def token_ids(self) -> tuple[int, ...]:
        return struct.unpack(f"<{len(self.data) // 4}I", self.data[: len(self.data) // 4 * 4])


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop decoding now, keep the state: the turn ends with STOP_ABORTED."""

    OP: ClassVar[Op] = Op.ABORT


@dataclass(frozen=True, slots=True)
class MemQuery:
    OP: ClassVar[Op] = Op.MEM_QUERY
    mode: int
    top_k: int
    cursor: int
    timestamp: int
    w_vec: float
    w_temporal: float
    w_pinned: float
    query: str


@dataclass(frozen=True, slots=True)
class SetConfig:
    """Sampling settings. Floats travel as f32; ranges are the engine's to check (NaN decodes)."""

    OP: ClassVar[Op] = Op.SET_CONFIG
    temperature: float = 0.7
    top_p: float = 0.95
    min_p: float = 0.05
    top_k: int = 64
    max_tokens: int = 4096
    repeat_penalty: float = 1.10
    repeat_window: int = 64
    quiescence_threshold: float = 0.02
    thinking_budget: int = 512
    flags: int = 0


@dataclass(frozen=True, slots=True)
class ToolReturn:
    OP: ClassVar[Op] = Op.TOOL_RETURN
    call_id: str
    is_error: bool
    result: str


@dataclass(frozen=True, slots=True)
class MemCommit:
    """Flush the memory staging buffer to disk."""

    OP: ClassVar[Op] = Op.MEM_COMMIT


@dataclass(frozen=True, slots=True)
class SetSystem:
    """The system prompt: ``raw`` is the whole JSON object (the engine may read more keys than
    ``instructions`` and ``tools``, say ``tool_choice``). Built with fields that ``raw`` does not
    hold, ``raw`` is rebuilt: they come first, then its other keys; so a message says one thing, and
    round-trips."""

    OP: ClassVar[Op] = Op.SET_SYSTEM
    instructions: str = ""
    tools: tuple[dict, ...] = ()
    raw: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        raw_tools = self.raw.get("tools", [])
        if self.raw.get("instructions", "") == self.instructions and raw_tools == list(self.tools):
            return
        raw: dict = {"instructions": self.instructions} if self.instructions else {}
        if self.tools:
            raw["tools"] = list(self.tools)
        raw.update((k, v) for k, v in self.raw.items() if k not in ("instructions", "tools"))
        object.__setattr__(self, "raw", raw)


@dataclass(frozen=True, slots=True)
class SnapshotSave:
    OP: ClassVar[Op] = Op.SNAPSHOT_SAVE
    path: str
    stream_id: str


@dataclass(frozen=True, slots=True)
class SnapshotLoad:
    OP: ClassVar[Op] = Op.SNAPSHOT_LOAD
    path: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Continue after STOP_ELASTIC_YIELD: RESUME_CONTINUE or RESUME_CLOSE_THOUGHT."""

    OP: ClassVar[Op] = Op.RESUME
    action: int = RESUME_CONTINUE


@dataclass(frozen=True, slots=True)
class Ping:
    OP: ClassVar[Op] = Op.PING


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Flush, then exit 0."""

    OP: ClassVar[Op] = Op.SHUTDOWN


@dataclass(frozen=True, slots=True)
class ProbeAutonomic:
    OP: ClassVar[Op] = Op.PROBE_AUTONOMIC
    max_decode_tokens: int
    candidates: tuple[int, ...]
    prompt: str


# ---------------------------------------------------------------- outbound (engine -> host)


@dataclass(frozen=True, slots=True)
class StreamContent:
    """One token of the answer. ``text`` is raw bytes: a token may hold part of a UTF-8 character."""

    OP: ClassVar[Op] = Op.STREAM_CONTENT
    token_id: int
    clock: int
    active_layer_mask: int
    token_type: int
    text: bytes


@dataclass(frozen=True, slots=True)
class StreamThought:
    """One token of the reasoning channel; the layout of StreamContent."""

    OP: ClassVar[Op] = Op.STREAM_THOUGHT
    token_id: int
    clock: int
    active_layer_mask: int
    token_type: int
    text: bytes


@dataclass(frozen=True, slots=True)
class TurnComplete:
    OP: ClassVar[Op] = Op.TURN_COMPLETE
    tokens: int
    elapsed_ms: int
    tok_per_sec: float
    stop_reason: int


@dataclass(frozen=True, slots=True)
class ToolCall:
    OP: ClassVar[Op] = Op.TOOL_CALL
    call_id: int
    name: str
    arguments: str  # JSON text, passed through: the host parses it


@dataclass(frozen=True, slots=True)
class MemResponse:
    OP: ClassVar[Op] = Op.MEM_RESPONSE
    status: int
    next_cursor: int
    total_injected_tokens: int
    timestamps: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Status:
    OP: ClassVar[Op] = Op.STATUS
    status: int
    is_gpu: int
    active_slots: int
    archived_diffs: int
    flags: int
    tok_per_sec: float
    current_tok: int
    total_tok: int


@dataclass(frozen=True, slots=True)
class SnapshotStatus:
    OP: ClassVar[Op] = Op.SNAPSHOT_STATUS
    status: int
    active_slots: int
    clock: int
    stream_id: str


@dataclass(frozen=True, slots=True)
class AutonomicResult:
    OP: ClassVar[Op] = Op.AUTONOMIC_RESULT
    selected_index: int
    winning_token: int
    confidence: float
    entropy: float
    cost_ms: float
    text: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    OP: ClassVar[Op] = Op.PONG


@dataclass(frozen=True, slots=True)
class Error:
    """The engine's refusal; ``detail`` is cut to 65535 bytes (a whole character) when encoded."""

    OP: ClassVar[Op] = Op.ERROR
    code: int
    detail: str = ""


Inbound = (StreamInput | Abort | MemQuery | SetConfig | ToolReturn | MemCommit | SetSystem | SnapshotSave
           | SnapshotLoad | Resume | Ping | Shutdown | ProbeAutonomic)
Outbound = (StreamContent | StreamThought | TurnComplete | ToolCall | MemResponse | Status | SnapshotStatus
            | AutonomicResult | Pong | Error)
Message = Inbound | Outbound

INBOUND: dict[int, type] = {cls.OP: cls for cls in Inbound.__args__}
OUTBOUND: dict[int, type] = {cls.OP: cls for cls in Outbound.__args__}


# ---------------------------------------------------------------- reader events


@dataclass(frozen=True, slots=True)
class Frame:
    msg_id: int
    message: Message


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A well-framed frame refused (UNKNOWN_OPCODE, MALFORMED_PAYLOAD): answer it with ERROR of
    its ``msg_id``; the reader goes on with the next frame."""

    msg_id: int
    code: ErrorCode
    detail: str


@dataclass(frozen=True, slots=True)
class FatalFrame:
    """Bad magic, bad version, payload_len over the limit: where the next frame starts is unknown.
    Answer ERROR with ``msg_id`` (always 0: the header is not trusted) and stop reading; the reader
    produces nothing more."""

    code: ErrorCode
    detail: str

    @property
    def msg_id(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class EndOfInput:
    """The peer closed its side; ``partial``: inside a frame (its header or payload cut short)."""

    partial: bool = False


Event = Frame | BadFrame | FatalFrame | EndOfInput
