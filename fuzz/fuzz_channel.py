"""Fuzz the Channel binary codec (colibri/io/channel.py): FrameReader in both directions.

Every input is read by three readers (inbound, outbound, and inbound with a 64-byte
``max_payload``), each three ways: whole, byte by byte, and in chunks whose sizes the input's first
eight bytes choose (``(b % 23) + 1`` bytes each, cycled: a frame's own magic cuts its header at
varied places; the bytes stay part of the stream). ``check`` asserts:

- no exception escapes a reader, and it never holds a header and ``max_payload`` bytes or more;
- only Frame, BadFrame, FatalFrame and EndOfInput come out, the same whatever the chunking; a
  BadFrame is UNKNOWN_OPCODE or MALFORMED_PAYLOAD, a FatalFrame BAD_MAGIC, BAD_VERSION or
  PAYLOAD_TOO_LARGE with msg_id 0;
- at most one FatalFrame, and it is last; else one EndOfInput, last; nothing after either (more
  data, a second EOF);
- the events are those of a second, plain walk of the frames (``skeleton``): where each frame
  starts and ends, what is fatal, which frames are refused before their payload is looked at;
- every decoded message is of the reader's direction, re-encodes, and reads back as a message that
  encodes the same; its payload re-encodes to the bytes it came from, except where the protocol
  allows two spellings (SET_CONFIG's 37 bytes, an empty RESUME, SET_SYSTEM's JSON, NaN floats);
- resynchronisation: an input that ends between frames, followed by a PING (a PONG outbound),
  reads as the same events and then that frame.

Run: ``python fuzz/fuzz_channel.py fuzz/out/channel fuzz/corpus/channel -dict=fuzz/channel.dict``
(needs atheris); ``check`` alone needs only colibri, for replaying a corpus (tests/test_fuzz_corpus.py).
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import fields

from colibri.io.channel import FrameReader, PayloadError, decode_payload, encode
from colibri.io.channel_frames import (
    HEADER_SIZE,
    INBOUND,
    MAGIC,
    MAX_PAYLOAD,
    OUTBOUND,
    VERSION,
    BadFrame,
    EndOfInput,
    ErrorCode,
    FatalFrame,
    Frame,
    Op,
    Ping,
    Pong,
)

READERS = [("inbound", MAX_PAYLOAD), ("outbound", MAX_PAYLOAD), ("inbound", 64)]
BAD_CODES = {ErrorCode.UNKNOWN_OPCODE, ErrorCode.MALFORMED_PAYLOAD}
FATAL_CODES = {ErrorCode.BAD_MAGIC, ErrorCode.BAD_VERSION, ErrorCode.PAYLOAD_TOO_LARGE}
PREFIX = struct.pack("<IH", MAGIC, VERSION)
RESYNC_ID = 0xABCD
EVENTS = (Frame, BadFrame, FatalFrame, EndOfInput)


def feeds(data: bytes) -> list[list[bytes]]:
    """The chunkings every input is read in: whole, byte by byte, and as the input's head chooses."""
    sizes = [(b % 23) + 1 for b in data[:8]]
    planned, i, k = [], 0, 0
    while i < len(data):
        planned.append(data[i : i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return [[data] if data else [], [data[i : i + 1] for i in range(len(data))], planned]


def read(pieces: list[bytes], accept: str, max_payload: int) -> list:
    reader = FrameReader(accept, max_payload)
    out: list = []
    for piece in pieces:
        out += reader.receive_data(piece)
        assert reader.buffered < HEADER_SIZE + max_payload, "buffered past one frame"
    out += reader.receive_data(b"")
    assert reader.receive_data(b"") == [], "a second EOF gave events"
    assert reader.receive_data(encode(1, Ping())) == [], "data after the end gave events"
    return out


def skeleton(data: bytes, accept: str, max_payload: int) -> list[tuple]:
    """What a reader must make of ``data``, walked frame by frame without the codec: ("payload",
    msg_id, op, bytes) for a frame whose payload decides (a Frame or a MALFORMED BadFrame), ("bad",
    msg_id, code) for one refused by its header, then ("fatal", code) or ("eof", partial)."""
    ops = INBOUND if accept == "inbound" else OUTBOUND
    out: list[tuple] = []
    pos = 0
    while True:
        head = data[pos : pos + HEADER_SIZE]
        wrong = [i for i, b in enumerate(head[: len(PREFIX)]) if b != PREFIX[i]]
        if wrong:
            return out + [("fatal", ErrorCode.BAD_MAGIC if wrong[0] < 4 else ErrorCode.BAD_VERSION)]
        if len(head) < HEADER_SIZE:
            return out + [("eof", bool(head))]
        _, _, msg_id, op, reserved, n = struct.unpack("<IHHHHI", head)
        if n > max_payload:
            return out + [("fatal", ErrorCode.PAYLOAD_TOO_LARGE)]
        if len(data) - pos - HEADER_SIZE < n:
            return out + [("eof", True)]
        payload, pos = data[pos + HEADER_SIZE : pos + HEADER_SIZE + n], pos + HEADER_SIZE + n
        if op not in ops:
            out.append(("bad", msg_id, ErrorCode.UNKNOWN_OPCODE))
        elif reserved:
            out.append(("bad", msg_id, ErrorCode.MALFORMED_PAYLOAD))
        else:
            out.append(("payload", msg_id, op, payload))


def has_nan(message) -> bool:
    values = (getattr(message, f.name) for f in fields(message))
    return any(isinstance(v, float) and math.isnan(v) for v in values)


def same(a, b) -> bool:
    """Equal messages, events or lists of them, NaN fields equal to NaN fields."""
    return a == b or (type(a) is type(b) and repr(a) == repr(b))


def check_message(msg_id: int, op: int, payload: bytes, message, accept: str) -> None:
    assert message.OP == op, (message, op)
    once = encode(msg_id, message)
    again = read([once], accept, MAX_PAYLOAD)
    assert len(again) == 2 and isinstance(again[0], Frame) and again[0].msg_id == msg_id, (message, again)
    assert same(again[0].message, message) and encode(msg_id, again[0].message) == once, (message, again)
    two_spellings = (op == Op.SET_CONFIG and len(payload) == 37) or (op == Op.RESUME and not payload)
    if not (two_spellings or op == Op.SET_SYSTEM or has_nan(message)):
        assert once[HEADER_SIZE:] == payload, (message, payload)


def check_events(data: bytes, events: list, accept: str, max_payload: int) -> None:
    expected = skeleton(data, accept, max_payload)
    assert len(events) == len(expected) and all(isinstance(e, EVENTS) for e in events), (events, expected)
    for event, want in zip(events, expected, strict=True):
        match want:
            case ("fatal", code):
                assert isinstance(event, FatalFrame) and (event.msg_id, event.code) == (0, code), want
                assert code in FATAL_CODES and event.detail
            case ("eof", partial):
                assert event == EndOfInput(partial), (event, want)
            case ("bad", msg_id, code):
                assert isinstance(event, BadFrame) and (event.msg_id, event.code) == (msg_id, code), want
                assert code in BAD_CODES and event.detail
            case ("payload", msg_id, op, payload):
                if isinstance(event, BadFrame):
                    assert event.msg_id == msg_id and event.code == ErrorCode.MALFORMED_PAYLOAD, (event, want)
                    try:
                        decode_payload(op, payload)
                        raise AssertionError(f"decode_payload took what the reader refused: {event}")
                    except PayloadError as e:
                        assert e.code == event.code
                else:
                    assert isinstance(event, Frame) and event.msg_id == msg_id, (event, want)
                    check_message(msg_id, op, payload, event.message, accept)


def check(data: bytes) -> None:
    for accept, max_payload in READERS:
        whole, *others = feeds(data)
        events = read(whole, accept, max_payload)
        for pieces in others:
            assert same(read(pieces, accept, max_payload), events), "events depend on the chunking"
        check_events(data, events, accept, max_payload)
        if events[-1] == EndOfInput(False):
            m = Ping() if accept == "inbound" else Pong()
            resynced = read([data + encode(RESYNC_ID, m)], accept, max_payload)
            assert same(resynced, events[:-1] + [Frame(RESYNC_ID, m), EndOfInput(False)]), "no resync"


if __name__ == "__main__":
    import atheris

    atheris.instrument_all()  # colibri.io is imported already: instrument what is loaded
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
