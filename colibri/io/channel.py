"""The Channel binary protocol (docs/channel_protocol.md), both directions, sans-IO.

``encode(msg_id, message) -> bytes`` writes a frame of either direction (a host its requests, the
engine its replies); ``FrameReader(accept).receive_data(bytes)`` reads them into ``Frame``,
``BadFrame``, ``FatalFrame`` and ``EndOfInput`` events (``accept="inbound"``: the engine's side).
``decode_payload(op, payload)`` is the payload half alone, raising ``PayloadError``. The messages:
``channel_frames.py``.

The envelope, 16 bytes little-endian: magic u32 (0x53554C58), version u16 (1), msg_id u16 (the
request's on its replies, 0 on unsolicited frames), opcode u16, reserved u16 (0), payload_len u32.

- Fatal (``FatalFrame``; the engine answers ERROR msg_id 0 and exits): a wrong magic, a version
  that is not 1, a payload_len over ``max_payload``. The stream cannot be resynchronised, and the
  reader produces nothing more (later data and EOF included). A wrong magic or version byte is
  fatal as soon as it arrives: a peer writing text at the engine gets its ERROR, not a hang.
- Recoverable (``BadFrame`` with the frame's msg_id, once the whole frame has arrived; the reader
  goes on with the next frame): an opcode this side does not read (unassigned, or of the other
  direction) is UNKNOWN_OPCODE; a payload its message's layout refuses is MALFORMED_PAYLOAD. A
  refused frame's payload is skipped as it arrives, never buffered.
- **Decision**, the header's reserved field: non-zero is MALFORMED_PAYLOAD with the frame's msg_id,
  the frame skipped (an unknown opcode is reported first). A peer that sets it means something
  this codec does not know (a flag changing how the payload reads, say): reading on as if it were
  0 would guess. Reserved bytes in payloads (STREAM_CONTENT/THOUGHT, TURN_COMPLETE,
  SNAPSHOT_STATUS, SET_CONFIG's tail) are held to 0 the same way; the encoder writes zeros.

Payloads are exact: a length that disagrees with the payload's size, trailing bytes, text that is
not UTF-8 (but for the raw token text of STREAM_CONTENT/THOUGHT and AUTONOMIC_RESULT, which may
end inside a character) are MALFORMED_PAYLOAD. SET_CONFIG is 41 bytes (37 of fields, 4 reserved)
or 37; the encoder writes 41. RESUME may be empty (CONTINUE); the encoder writes the byte. Values
a field holds but the engine may refuse (a NaN temperature, a data type it does not serve) decode:
ranges are the engine's. The encoder raises ValueError for what the decoder would refuse.

Limits: a reader buffers at most one header and one payload of ``max_payload`` bytes (64 MiB or
less), known from its header before any of it is kept; SET_SYSTEM's JSON nests ``MAX_JSON_DEPTH``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

from colibri.io import channel_frames as cf
from colibri.io.channel_frames import HEADER_SIZE, MAX_PAYLOAD, ErrorCode, Event, Message, Op

HEADER = struct.Struct("<IHHHHI")  # magic, version, msg_id, opcode, reserved, payload_len
# The header's first six bytes are fixed: a wrong one is fatal as soon as it arrives.
_PREFIX = HEADER.pack(cf.MAGIC, cf.VERSION, 0, 0, 0, 0)[:6]
# msg_id is a u16 on the wire; the host picks them, 0 is for unsolicited frames.
MAX_MSG_ID = 0xFFFF
# SET_SYSTEM: a system prompt's JSON is a few levels deep (tools, their JSON-schema parameters);
# 64 levels is far past any, and bounds the work a hostile document makes the engine do.
MAX_JSON_DEPTH = 64
# SET_CONFIG: the fields of spec §4.6 (37 bytes), then 4 reserved zero bytes (the notes' Decision).
CONFIG = struct.Struct("<fffIIfIfIB")
CONFIG_RESERVED = 4
# A u16-prefixed string's ceiling (Error's detail is cut to it).
MAX_U16 = 0xFFFF

_B, _H, _I = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I")
_BB, _HH = struct.Struct("<BB"), struct.Struct("<HH")
# The fixed part of each layout; a u16-prefixed string or text follows where noted.
_MEM_QUERY = struct.Struct("<BBHQfff")  # then the query (rest)
_STREAM = struct.Struct("<IQQBB")  # token_id, clock, active_layer_mask, token_type, reserved; text16
_TURN = struct.Struct("<IIfB3s")  # ..., stop_reason, 3 reserved
_MEM_RESPONSE = struct.Struct("<BBHI")  # injected_count, status, next_cursor, total; timestamps
_STATUS = struct.Struct("<BBHHHfII")
_SNAPSHOT_STATUS = struct.Struct("<BBHQ")  # status, reserved, active_slots, clock; stream_id16
_AUTONOMIC = struct.Struct("<HIfff")  # then text16
_EMPTY: dict[int, type] = {Op.ABORT: cf.Abort, Op.MEM_COMMIT: cf.MemCommit, Op.PING: cf.Ping,
                           Op.SHUTDOWN: cf.Shutdown, Op.PONG: cf.Pong}


class PayloadError(Exception):
    """A payload its opcode's layout refuses (or an opcode this codec does not know)."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(code, detail)
        self.code, self.detail = code, detail


def _as(enum_cls: Any, value: int) -> int:
    """An enum-valued field: its member when the value is one, the int otherwise."""
    try:
        return enum_cls(value)
    except ValueError:
        return value


class _Cursor:
    """A payload read front to back: running short is malformed (so are bytes left at the end)."""

    def __init__(self, op: int, data: bytes) -> None:
        self.name, self.data, self.pos = Op(op).name, data, 0

    def error(self, what: str) -> PayloadError:
        return PayloadError(ErrorCode.MALFORMED_PAYLOAD, f"{self.name}: {what}")

    def fixed(self, layout: struct.Struct) -> tuple:
        return layout.unpack(self.take(layout.size))

    def take(self, n: int) -> bytes:
        if len(self.data) - self.pos < n:
            raise self.error(f"{n} bytes wanted at {self.pos} of {len(self.data)}: too short")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def rest(self) -> bytes:
        return self.take(len(self.data) - self.pos)

    def bytes16(self) -> bytes:
        return self.take(*self.fixed(_H))

    def utf8(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("text is not UTF-8") from None

    def zero(self, raw: bytes | int) -> None:
        if any(raw) if isinstance(raw, bytes) else raw:
            raise self.error("reserved bytes are not 0")


# ---------------------------------------------------------------- checks the encoder shares


def _check_input(c: _Cursor, data_type: int, data: bytes) -> None:
    if data_type == cf.DataType.TOKENS and len(data) % 4:
        raise c.error(f"{len(data)} bytes of token ids is not a multiple of 4")
    if data_type == cf.DataType.EMBEDDINGS and len(data) % 2:
        raise c.error(f"{len(data)} bytes of f16 embeddings is not a multiple of 2")
    if data_type == cf.DataType.TEXT:
        c.utf8(data)


def _path(c: _Cursor, raw: bytes) -> str:
    path = c.utf8(raw)
    if not path or "\x00" in path:
        raise c.error("a path is empty or holds a NUL")
    return path


def _finite(text: str) -> float:
    """A JSON number (or NaN, Infinity: not JSON) that ``json.dumps`` can write back."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a double's range or not JSON")
    return value


def _check_json(c: _Cursor, value: object) -> None:
    """Nesting within MAX_JSON_DEPTH, every string (keys too) encodable as UTF-8 (a lone surrogate
    escape is not): iteratively, so a deep document costs no recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise c.error("a string holds a lone surrogate") from None
        elif isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise c.error(f"JSON nested over {MAX_JSON_DEPTH} deep")
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            stack += [(x, depth + 1) for x in items]


def _system(c: _Cursor) -> cf.SetSystem:
    """Strict JSON (no NaN, no number past a double's range: what ``json.dumps`` writes back)."""
    text = c.utf8(c.rest())
    try:
        obj = json.loads(text, parse_float=_finite, parse_constant=_finite)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's stack
        raise c.error("not JSON") from None
    if not isinstance(obj, dict):
        raise c.error("not a JSON object")
    _check_json(c, obj)
    instructions, tools = obj.get("instructions", ""), obj.get("tools", [])
    if not isinstance(instructions, str):
        raise c.error("instructions is not a string")
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                              for t in tools):
        raise c.error("tools is not a list of objects with a string name")
    return cf.SetSystem(instructions, tuple(tools), obj)


# ---------------------------------------------------------------- decoders (arguments read in order)


def _stream_input(c: _Cursor) -> cf.StreamInput:
    (data_type, flags), data = c.fixed(_BB), c.rest()
    _check_input(c, data_type, data)
    return cf.StreamInput(_as(cf.DataType, data_type), flags, data)


def _set_config(c: _Cursor) -> cf.SetConfig:
    if len(c.data) not in (CONFIG.size, CONFIG.size + CONFIG_RESERVED):
        raise c.error(f"{len(c.data)} bytes, not {CONFIG.size + CONFIG_RESERVED} (or {CONFIG.size})")
    config = cf.SetConfig(*c.fixed(CONFIG))
    c.zero(c.rest())
    return config


def _tool_return(c: _Cursor) -> cf.ToolReturn:
    call_id, (is_error,) = c.utf8(c.bytes16()), c.fixed(_B)
    if is_error not in (0, 1):
        raise c.error(f"is_error is {is_error}, not 0 or 1")
    return cf.ToolReturn(call_id, bool(is_error), c.utf8(c.take(*c.fixed(_I))))


def _resume(c: _Cursor) -> cf.Resume:
    action = c.rest()
    if action not in (b"", b"\x00", b"\x01"):
        raise c.error("action is not empty, 0 or 1")
    return cf.Resume(action[0] if action else cf.RESUME_CONTINUE)


def _probe(c: _Cursor) -> cf.ProbeAutonomic:
    max_decode_tokens, count = c.fixed(_HH)
    candidates = c.fixed(struct.Struct(f"<{count}I"))
    return cf.ProbeAutonomic(max_decode_tokens, candidates, c.utf8(c.take(*c.fixed(_I))))


def _stream(cls: type[cf.StreamContent] | type[cf.StreamThought]) -> Callable[[_Cursor], Message]:
    def decode(c: _Cursor) -> Message:
        *fields, reserved = c.fixed(_STREAM)
        c.zero(reserved)
        return cls(*fields, c.bytes16())
    return decode


def _turn_complete(c: _Cursor) -> cf.TurnComplete:
    *fields, stop_reason, reserved = c.fixed(_TURN)
    c.zero(reserved)
    return cf.TurnComplete(*fields, _as(cf.StopReason, stop_reason))


def _mem_response(c: _Cursor) -> cf.MemResponse:
    count, status, *fields = c.fixed(_MEM_RESPONSE)
    return cf.MemResponse(_as(cf.MemStatus, status), *fields, c.fixed(struct.Struct(f"<{count}Q")))


def _status(c: _Cursor) -> cf.Status:
    status, *fields = c.fixed(_STATUS)
    return cf.Status(_as(cf.EngineStatus, status), *fields)


def _snapshot_status(c: _Cursor) -> cf.SnapshotStatus:
    status, reserved, *fields = c.fixed(_SNAPSHOT_STATUS)
    c.zero(reserved)
    return cf.SnapshotStatus(_as(cf.SnapshotState, status), *fields, c.utf8(c.bytes16()))


_DECODERS: dict[int, Callable[[_Cursor], Message]] = {
    Op.STREAM_INPUT: _stream_input,
    Op.MEM_QUERY: lambda c: cf.MemQuery(*c.fixed(_MEM_QUERY), c.utf8(c.rest())),
    Op.SET_CONFIG: _set_config,
    Op.TOOL_RETURN: _tool_return,
    Op.SET_SYSTEM: _system,
    Op.SNAPSHOT_SAVE: lambda c: cf.SnapshotSave(_path(c, c.bytes16()), c.utf8(c.bytes16())),
    Op.SNAPSHOT_LOAD: lambda c: cf.SnapshotLoad(_path(c, c.rest())),
    Op.RESUME: _resume,
    Op.PROBE_AUTONOMIC: _probe,
    Op.STREAM_CONTENT: _stream(cf.StreamContent),
    Op.STREAM_THOUGHT: _stream(cf.StreamThought),
    Op.TURN_COMPLETE: _turn_complete,
    Op.TOOL_CALL: lambda c: cf.ToolCall(*c.fixed(_H), c.utf8(c.bytes16()), c.utf8(c.rest())),
    Op.MEM_RESPONSE: _mem_response,
    Op.STATUS: _status,
    Op.SNAPSHOT_STATUS: _snapshot_status,
    Op.AUTONOMIC_RESULT: lambda c: cf.AutonomicResult(*c.fixed(_AUTONOMIC), c.bytes16()),
    Op.ERROR: lambda c: cf.Error(_as(ErrorCode, *c.fixed(_H)), c.utf8(c.bytes16())),
}


def decode_payload(op: int, payload: bytes) -> Message:
    """The message a frame of opcode ``op`` carries (either direction); raises PayloadError."""
    if op in _EMPTY:
        if payload:
            raise PayloadError(ErrorCode.MALFORMED_PAYLOAD, f"{Op(op).name}: {len(payload)} bytes, not 0")
        return _EMPTY[op]()
    decoder = _DECODERS.get(op)
    if decoder is None:
        raise PayloadError(ErrorCode.UNKNOWN_OPCODE, f"opcode 0x{op:04x} is not assigned")
    c = _Cursor(op, bytes(payload))
    message = decoder(c)
    if c.pos != len(payload):
        raise c.error(f"{len(payload) - c.pos} bytes past the end of the message")
    return message


# ---------------------------------------------------------------- encoders


def _b16(raw: bytes) -> bytes:
    return _H.pack(len(raw)) + raw


def _s16(text: str) -> bytes:
    return _b16(text.encode("utf-8"))


def _s32(text: str) -> bytes:
    return _I.pack(len(raw := text.encode("utf-8"))) + raw


def _encode_path(op: Op, path: str) -> bytes:
    _path(_Cursor(op, b""), raw := path.encode("utf-8"))
    return raw


def _encode_input(m: cf.StreamInput) -> bytes:
    _check_input(_Cursor(Op.STREAM_INPUT, b""), m.data_type, m.data)
    return _BB.pack(m.data_type, m.flags) + m.data


def _encode_system(m: cf.SetSystem) -> bytes:
    """``raw`` (which holds ``instructions`` and ``tools``: SetSystem sees to it) as JSON, checked
    by the decoder: what it would refuse is a ValueError here."""
    try:
        payload = json.dumps(m.raw, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except TypeError as e:
        raise ValueError(f"SET_SYSTEM: {e}") from None
    _system(_Cursor(Op.SET_SYSTEM, payload))
    return payload


def _encode_error(m: cf.Error) -> bytes:
    """The engine's refusals must always encode: an unencodable character becomes U+FFFD, and a
    detail over 65535 bytes is cut at the last whole character that fits."""
    detail = m.detail.encode("utf-8", errors="replace")
    if len(detail) > MAX_U16:
        detail = detail[:MAX_U16].decode("utf-8", errors="ignore").encode("utf-8")
    return _H.pack(m.code) + _b16(detail)


# Out-of-range values (a bool that is not, an action not 0 or 1 is packed as -1) are struct.error.
_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    cf.StreamInput: _encode_input,
    cf.MemQuery: lambda m: _MEM_QUERY.pack(m.mode, m.top_k, m.cursor, m.timestamp, m.w_vec, m.w_temporal,
                                           m.w_pinned) + m.query.encode("utf-8"),
    cf.SetConfig: lambda m: CONFIG.pack(m.temperature, m.top_p, m.min_p, m.top_k, m.max_tokens,
                                        m.repeat_penalty, m.repeat_window, m.quiescence_threshold,
                                        m.thinking_budget, m.flags) + bytes(CONFIG_RESERVED),
    cf.ToolReturn: lambda m: (_s16(m.call_id) + _B.pack(int(m.is_error) if m.is_error in (0, 1) else -1)
                              + _s32(m.result)),
    cf.SetSystem: _encode_system,
    cf.SnapshotSave: lambda m: _b16(_encode_path(Op.SNAPSHOT_SAVE, m.path)) + _s16(m.stream_id),
    cf.SnapshotLoad: lambda m: _encode_path(Op.SNAPSHOT_LOAD, m.path),
    cf.Resume: lambda m: _B.pack(m.action if m.action in (0, 1) else -1),
    cf.ProbeAutonomic: lambda m: (_HH.pack(m.max_decode_tokens, len(m.candidates))
                                  + struct.pack(f"<{len(m.candidates)}I", *m.candidates) + _s32(m.prompt)),
    cf.StreamContent: lambda m: _STREAM.pack(m.token_id, m.clock, m.active_layer_mask, m.token_type, 0)
    + _b16(m.text),
    cf.StreamThought: lambda m: _ENCODERS[cf.StreamContent](m),
    cf.TurnComplete: lambda m: _TURN.pack(m.tokens, m.elapsed_ms, m.tok_per_sec, m.stop_reason, b""),
    cf.ToolCall: lambda m: _H.pack(m.call_id) + _s16(m.name) + m.arguments.encode("utf-8"),
    cf.MemResponse: lambda m: (_MEM_RESPONSE.pack(len(m.timestamps), m.status, m.next_cursor,
                                                  m.total_injected_tokens)
                               + struct.pack(f"<{len(m.timestamps)}Q", *m.timestamps)),
    cf.Status: lambda m: _STATUS.pack(m.status, m.is_gpu, m.active_slots, m.archived_diffs, m.flags,
                                      m.tok_per_sec, m.current_tok, m.total_tok),
    cf.SnapshotStatus: lambda m: (_SNAPSHOT_STATUS.pack(m.status, 0, m.active_slots, m.clock)
                                  + _s16(m.stream_id)),
    cf.AutonomicResult: lambda m: (_AUTONOMIC.pack(m.selected_index, m.winning_token, m.confidence,
                                                   m.entropy, m.cost_ms) + _b16(m.text)),
    cf.Error: _encode_error,
}


def encode_payload(message: Message) -> bytes:
    """A message's payload alone; ValueError for a field out of its range or one the decoder would
    refuse (TypeError for what is not a Channel message)."""
    if type(message) in _EMPTY.values():
        return b""
    encoder = _ENCODERS.get(type(message))
    if encoder is None:
        raise TypeError(f"not a Channel message: {message!r}")
    try:
        payload = encoder(message)
    except (struct.error, OverflowError) as e:
        raise ValueError(f"{type(message).__name__}: {e}") from None
    except PayloadError as e:
        raise ValueError(e.detail) from None
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"{type(message).__name__}: payload of {len(payload)} bytes over {MAX_PAYLOAD}")
    return payload


def encode(msg_id: int, message: Message) -> bytes:
    """One frame: header and payload. ``msg_id`` is 0..65535 (ValueError otherwise)."""
    if not isinstance(msg_id, int) or not 0 <= msg_id <= MAX_MSG_ID:
        raise ValueError(f"msg_id {msg_id!r} is not 0..{MAX_MSG_ID}")
    payload = encode_payload(message)
    return HEADER.pack(cf.MAGIC, cf.VERSION, msg_id, message.OP, 0, len(payload)) + payload


# ---------------------------------------------------------------- the reader


class FrameReader:
    """Bytes -> events, whatever the chunking. ``accept``: "inbound" (the engine reads requests) or
    "outbound" (a host reads replies); the other direction's opcodes are UNKNOWN_OPCODE.
    ``max_payload``: the largest payload_len taken; a larger one is fatal. ``buffered``: the bytes
    held, at most one header and one payload (less than ``HEADER_SIZE + max_payload``)."""

    def __init__(self, accept: str = "inbound", max_payload: int = MAX_PAYLOAD) -> None:
        if accept not in ("inbound", "outbound"):
            raise ValueError(f"accept is 'inbound' or 'outbound', not {accept!r}")
        if not 0 <= max_payload <= MAX_PAYLOAD:
            raise ValueError(f"max_payload {max_payload} is not 0..{MAX_PAYLOAD}")
        self.accept, self.max_payload = accept, max_payload
        self._ops = cf.INBOUND if accept == "inbound" else cf.OUTBOUND
        self._head = bytearray()  # the header, as it arrives
        self._body = bytearray()  # the payload of an accepted frame, as it arrives
        # The frame whose payload is awaited: (msg_id, opcode, reserved, payload_len), whether its
        # payload is kept (False: a refused frame, skipped), and how many of its bytes arrived.
        self._frame: tuple[int, int, int, int] | None = None
        self._keep, self._got = False, 0
        self._closed = False  # after EOF or a FatalFrame: nothing more

    @property
    def buffered(self) -> int:
        return len(self._head) + len(self._body)

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes (``b""`` means end of input) and return the events they complete."""
        if self._closed:
            return []
        if not data:
            partial = bool(self._head) or self._frame is not None
            self._close()
            return [cf.EndOfInput(partial)]
        events: list[Event] = []
        view, pos = memoryview(data), 0
        while pos < len(view) and not self._closed:
            pos = self._header(view, pos, events) if self._frame is None else self._payload(view, pos, events)
        return events

    def _close(self) -> None:
        self._closed, self._head, self._body, self._frame = True, bytearray(), bytearray(), None

    def _header(self, view: memoryview, pos: int, events: list[Event]) -> int:
        start = len(self._head)
        take = min(HEADER_SIZE - start, len(view) - pos)
        self._head += view[pos : pos + take]
        for i in range(start, min(len(self._head), len(_PREFIX))):  # the fixed bytes, as they come
            if self._head[i] != _PREFIX[i]:
                code, what = (ErrorCode.BAD_MAGIC, "magic") if i < 4 else (ErrorCode.BAD_VERSION, "version")
                events.append(cf.FatalFrame(code, f"bad {what}: header byte {i} is 0x{self._head[i]:02x}"))
                self._close()
                return len(view)
        if len(self._head) < HEADER_SIZE:
            return pos + take
        _, _, msg_id, op, reserved, n = HEADER.unpack(self._head)
        self._head = bytearray()
        if n > self.max_payload:
            events.append(cf.FatalFrame(ErrorCode.PAYLOAD_TOO_LARGE, f"payload_len {n} > {self.max_payload}"))
            self._close()
            return len(view)
        self._frame, self._keep, self._got = (msg_id, op, reserved, n), op in self._ops and not reserved, 0
        if n == 0:
            self._finish(events)
        return pos + take

    def _payload(self, view: memoryview, pos: int, events: list[Event]) -> int:
        assert self._frame is not None
        take = min(self._frame[3] - self._got, len(view) - pos)
        if self._keep:
            self._body += view[pos : pos + take]
        self._got += take
        if self._got == self._frame[3]:
            self._finish(events)
        return pos + take

    def _finish(self, events: list[Event]) -> None:
        """The frame's last byte arrived: its message, or why it is refused."""
        assert self._frame is not None
        (msg_id, op, reserved, _), payload = self._frame, bytes(self._body)
        self._frame, self._body = None, bytearray()
        if op not in self._ops:
            why = f"is not {self.accept}" if op in cf.INBOUND or op in cf.OUTBOUND else "is not assigned"
            events.append(cf.BadFrame(msg_id, ErrorCode.UNKNOWN_OPCODE, f"opcode 0x{op:04x} {why}"))
        elif reserved:
            events.append(cf.BadFrame(msg_id, ErrorCode.MALFORMED_PAYLOAD,
                                      f"reserved header field is 0x{reserved:04x}, not 0"))
        else:
            try:
                events.append(cf.Frame(msg_id, decode_payload(op, payload)))
            except PayloadError as e:
                events.append(cf.BadFrame(msg_id, e.code, e.detail))
