"""The Channel binary codec (colibri/io/channel.py, docs/channel_protocol.md).

Byte-exact layouts of every opcode against hand-packed structs; round trips of every message
under every chunking; arbitrary bytes (no exception, at most one FatalFrame and nothing after it,
bounded buffering); every error code the reader produces, with its msg_id, and that a refused
frame leaves the next one readable; SET_CONFIG's 37/41-byte decision; what the encoder refuses.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import fields, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.io import channel_frames as cf
from colibri.io.channel import (
    MAX_JSON_DEPTH,
    FrameReader,
    PayloadError,
    decode_payload,
    encode,
    encode_payload,
)
from colibri.io.channel_frames import HEADER_SIZE, MAGIC, MAX_PAYLOAD, VERSION, ErrorCode, Op

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MP, UO = ErrorCode.MALFORMED_PAYLOAD, ErrorCode.UNKNOWN_OPCODE


def header(msg_id: int, op: int, n: int, reserved: int = 0, magic: int = MAGIC, version: int = VERSION,
           ) -> bytes:
    return struct.pack("<IHHHHI", magic, version, msg_id, op, reserved, n)


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def rounded(m):
    """A message as it comes back: its floats rounded to f32."""
    return replace(m, **{f.name: f32(getattr(m, f.name)) for f in fields(m) if isinstance(getattr(m, f.name),
                                                                                          float)})


def chunks(blob: bytes, cuts) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(blob)})
    bounds = [0, *points, len(blob)]
    return [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def feeds(blob: bytes, cuts=()) -> list[list[bytes]]:
    return [[blob] if blob else [], [blob[i : i + 1] for i in range(len(blob))], chunks(blob, cuts)]


def read(pieces, accept: str = "inbound", max_payload: int = MAX_PAYLOAD) -> list:
    reader = FrameReader(accept, max_payload)
    out = []
    for piece in pieces:
        out += reader.receive_data(piece)
        assert reader.buffered < HEADER_SIZE + max_payload
    return out + reader.receive_data(b"")


def codes(events) -> list:
    """Events reduced to what the error tests pin down: (type, msg_id, code) of a refusal."""
    return [(type(e), e.msg_id, e.code) if isinstance(e, cf.BadFrame | cf.FatalFrame) else e for e in events]


def accept_of(op: int) -> str:
    return "inbound" if op in cf.INBOUND else "outbound"


def probe_frame(accept: str, msg_id: int = 99) -> tuple[bytes, cf.Frame]:
    """A good frame to follow a bad one: read, it shows the reader kept in step."""
    m = cf.Ping() if accept == "inbound" else cf.Pong()
    return encode(msg_id, m), cf.Frame(msg_id, m)


# ---------------------------------------------------------------- byte-exact layouts


TOOLS_JSON = (b'{"instructions": "Be brief.", "tools": [{"name": "add", "parameters": {}}], '
              b'"tool_choice": "auto"}')
LAYOUTS = [
    (cf.StreamInput(cf.DataType.TEXT, cf.INPUT_FLAG_DIRECT, "héllo".encode()),
     struct.pack("<BB", 0, 1) + "héllo".encode()),
    (cf.StreamInput.of_tokens([1, 70000], cf.INPUT_FLAG_REASON), struct.pack("<BB2I", 1, 2, 1, 70000)),
    (cf.StreamInput(cf.DataType.EMBEDDINGS, 0, b"\x00\x3c\x00\xbc"), b"\x02\x00\x00\x3c\x00\xbc"),
    (cf.StreamInput(cf.DataType.IMAGE, 0, b"\x89PNG"), b"\x04\x00\x89PNG"),
    (cf.Abort(), b""),
    (cf.MemQuery(1, 5, 7, 2**40, 0.5, 0.25, 2.0, "cats"),
     struct.pack("<BBHQfff", 1, 5, 7, 2**40, 0.5, 0.25, 2.0) + b"cats"),
    (rounded(cf.SetConfig()), struct.pack("<fffIIfIfIB", 0.7, 0.95, 0.05, 64, 4096, 1.10, 64, 0.02, 512, 0)
     + bytes(4)),
    (cf.ToolReturn("call_1", True, '{"ok": 1}'), struct.pack("<H", 6) + b"call_1" + struct.pack("<BI", 1, 9)
     + b'{"ok": 1}'),
    (cf.MemCommit(), b""),
    (cf.SetSystem("Be brief.", ({"name": "add", "parameters": {}},), {"tool_choice": "auto"}), TOOLS_JSON),
    (cf.SnapshotSave("/tmp/s.snap", "stream-1"), struct.pack("<H", 11) + b"/tmp/s.snap" + struct.pack("<H", 8)
     + b"stream-1"),
    (cf.SnapshotLoad("/tmp/é.snap"), "/tmp/é.snap".encode()),
    (cf.Resume(cf.RESUME_CLOSE_THOUGHT), b"\x01"),
    (cf.Resume(), b"\x00"),
    (cf.Ping(), b""),
    (cf.Shutdown(), b""),
    (cf.ProbeAutonomic(1, (10, 20, 30), "Yes?"), struct.pack("<HH3II", 1, 3, 10, 20, 30, 4) + b"Yes?"),
    (cf.StreamContent(42, 7, 0b1011, cf.TOKEN_TEXT, b"\xc3"),  # half of "é": raw bytes, not checked
     struct.pack("<IQQBBH", 42, 7, 11, 0, 0, 1) + b"\xc3"),
    (cf.StreamThought(43, 8, 2**63, cf.TOKEN_CONTROL, b"<think>"),
     struct.pack("<IQQBBH", 43, 8, 2**63, 3, 0, 7) + b"<think>"),
    (cf.TurnComplete(10, 250, 40.0, cf.StopReason.MAX_TOKENS), struct.pack("<IIfB3x", 10, 250, 40.0, 1)),
    (cf.ToolCall(3, "add", '{"a": 1}'), struct.pack("<HH", 3, 3) + b'add{"a": 1}'),
    (cf.MemResponse(cf.MemStatus.OK, 5, 300, (1, 2**64 - 1)),
     struct.pack("<BBHI2Q", 2, 0, 5, 300, 1, 2**64 - 1)),
    (cf.MemResponse(cf.MemStatus.ARCHIVE_EMPTY, 0, 0, ()), struct.pack("<BBHI", 0, 2, 0, 0)),
    (cf.Status(cf.EngineStatus.GENERATING, 1, 2, 3, cf.STATUS_SATURATED, 12.5, 100, 1000),
     struct.pack("<BBHHHfII", 2, 1, 2, 3, 1, 12.5, 100, 1000)),
    (cf.SnapshotStatus(cf.SnapshotState.LOADED, 4, 2**40, "stream-1"),
     struct.pack("<BBHQH", 1, 0, 4, 2**40, 8) + b"stream-1"),
    (cf.AutonomicResult(cf.SELECTED_GENERATIVE, 20, 0.75, 0.5, 1.25, b"ok"),
     struct.pack("<HIfffH", 0xFFFF, 20, 0.75, 0.5, 1.25, 2) + b"ok"),
    (cf.Pong(), b""),
    (cf.Error(ErrorCode.BUSY, "busy"), struct.pack("<HH", 6, 4) + b"busy"),
]


def test_layouts_cover_every_opcode():
    assert {m.OP for m, _ in LAYOUTS} == set(Op)


@pytest.mark.parametrize(("message", "payload"), LAYOUTS, ids=[f"{m.OP.name}-{i}" for i, (m, _) in
                                                                 enumerate(LAYOUTS)])
def test_layout(message, payload):
    frame = encode(0x1234, message)
    magic, version, msg_id, op, reserved, n = struct.unpack_from("<IHHHHI", frame)
    assert (magic, version, msg_id, op, reserved, n) == (0x53554C58, 1, 0x1234, message.OP, 0, len(payload))
    assert frame[:4] == b"XLUS" and frame[HEADER_SIZE:] == payload
    assert decode_payload(message.OP, payload) == message
    assert read([frame], accept_of(message.OP)) == [cf.Frame(0x1234, message), cf.EndOfInput(False)]


@pytest.mark.parametrize(("op", "payload", "message"), [
    (Op.RESUME, b"", cf.Resume(cf.RESUME_CONTINUE)),  # an empty RESUME continues
    (Op.SET_CONFIG, struct.pack("<fffIIfIfIB", 1, 0.5, 0, 1, 2, 1, 3, 0.25, 4, 15),  # 37 bytes: no tail
     cf.SetConfig(1, 0.5, 0, 1, 2, 1, 3, 0.25, 4, 15)),
    (Op.SET_CONFIG, struct.pack("<fffIIfIfIB4x", 1, 0.5, 0, 1, 2, 1, 3, 0.25, 4, 255),  # unknown bits kept
     cf.SetConfig(1, 0.5, 0, 1, 2, 1, 3, 0.25, 4, 255)),
    (Op.STREAM_INPUT, b"\x09\xff\x01", cf.StreamInput(9, 255, b"\x01")),  # any data type decodes
    (Op.STREAM_INPUT, b"\x00\x00", cf.StreamInput(0, 0, b"")),
    (Op.ERROR, struct.pack("<HH", 1000, 0), cf.Error(1000)),  # an unknown code is an int
    (Op.TURN_COMPLETE, struct.pack("<IIfB3x", 0, 0, 0, 9), cf.TurnComplete(0, 0, 0.0, 9)),
    (Op.SET_SYSTEM, b"{}", cf.SetSystem()),
    (Op.SET_SYSTEM, b'{"instructions": "", "tools": []}',
     cf.SetSystem("", (), {"instructions": "", "tools": []})),
])
def test_decodes(op, payload, message):
    assert decode_payload(op, payload) == message
    assert read([header(7, op, len(payload)) + payload], accept_of(op)) == [cf.Frame(7, message),
                                                                           cf.EndOfInput(False)]


def test_set_config_37_and_41_bytes_accepted_40_and_reserved_refused():
    fields37 = struct.pack("<fffIIfIfIB", 0.5, 0.9, 0.1, 40, 100, 1.5, 32, 0.25, 0, cf.CONFIG_THINKING_GATE)
    want = cf.SetConfig(0.5, f32(0.9), f32(0.1), 40, 100, 1.5, 32, 0.25, 0, 8)
    assert decode_payload(Op.SET_CONFIG, fields37) == want
    assert decode_payload(Op.SET_CONFIG, fields37 + bytes(4)) == want
    assert encode_payload(want) == fields37 + bytes(4)
    for bad in (fields37[:36], fields37 + bytes(3), fields37 + bytes(5), fields37 + b"\x00\x00\x00\x01"):
        events = read([header(3, Op.SET_CONFIG, len(bad)) + bad])
        assert codes(events) == [(cf.BadFrame, 3, MP), cf.EndOfInput()]


def test_stream_input_helpers():
    m = cf.StreamInput.of_text("héllo 中", cf.INPUT_FLAG_DIRECT)
    assert m.text() == "héllo 中" and m.flags == cf.INPUT_FLAG_DIRECT and m.data_type == cf.DataType.TEXT
    assert cf.StreamInput.of_tokens((5, 2**32 - 1)).token_ids() == (5, 2**32 - 1)
    assert cf.StreamInput(cf.DataType.TOKENS, 0, b"").token_ids() == ()


def test_set_system_completes_raw_and_keeps_extra_keys():
    m = cf.SetSystem("Be brief.")
    assert m.raw == {"instructions": "Be brief."} and decode_payload(Op.SET_SYSTEM, encode_payload(m)) == m
    m = decode_payload(Op.SET_SYSTEM, TOOLS_JSON)
    assert m.instructions == "Be brief." and m.tools == ({"name": "add", "parameters": {}},)
    assert m.raw["tool_choice"] == "auto" and encode_payload(m) == TOOLS_JSON


def test_nan_and_infinity_decode_and_re_encode_the_same():
    payload = encode_payload(cf.SetConfig(temperature=math.nan, top_p=math.inf))
    m = decode_payload(Op.SET_CONFIG, payload)
    assert math.isnan(m.temperature) and m.top_p == math.inf and encode_payload(m) == payload


# ---------------------------------------------------------------- round trips

u8, u16, u32, u64 = (st.integers(0, 2**b - 1) for b in (8, 16, 32, 64))
f32s = st.floats(width=32, allow_nan=False)  # exactly an f32: comes back equal
texts = st.text(max_size=24)
paths = st.text(min_size=1, max_size=24).filter(lambda p: "\x00" not in p)
json_scalars = st.none() | st.booleans() | st.integers(-(10**20), 10**20) | texts | st.floats(allow_nan=False,
                                                                                             allow_infinity=False)
tools = st.fixed_dictionaries({"name": texts}, optional={"description": texts, "parameters": st.dictionaries(
    texts, json_scalars | st.lists(json_scalars, max_size=3), max_size=3)})
inbound = st.one_of(
    st.builds(cf.StreamInput, st.just(cf.DataType.TEXT), u8, texts.map(str.encode)),
    st.builds(cf.StreamInput, st.just(cf.DataType.TOKENS), u8,
              st.lists(u32, max_size=6).map(lambda ids: struct.pack(f"<{len(ids)}I", *ids))),
    st.builds(cf.StreamInput, st.just(cf.DataType.EMBEDDINGS), u8,
              st.binary(max_size=8).map(lambda b: b + b)),
    st.builds(cf.StreamInput, st.integers(3, 255), u8, st.binary(max_size=16)),
    st.builds(cf.Abort), st.builds(cf.MemCommit), st.builds(cf.Ping), st.builds(cf.Shutdown),
    st.builds(cf.MemQuery, u8, u8, u16, u64, f32s, f32s, f32s, texts),
    st.builds(cf.SetConfig, f32s, f32s, f32s, u32, u32, f32s, u32, f32s, u32, u8),
    st.builds(cf.ToolReturn, texts, st.booleans(), texts),
    st.builds(cf.SetSystem, texts, st.lists(tools, max_size=3).map(tuple),
              st.dictionaries(st.sampled_from(["tool_choice", "x"]), json_scalars, max_size=2)),
    st.builds(cf.SnapshotSave, paths, texts), st.builds(cf.SnapshotLoad, paths),
    st.builds(cf.Resume, st.sampled_from([cf.RESUME_CONTINUE, cf.RESUME_CLOSE_THOUGHT])),
    st.builds(cf.ProbeAutonomic, u16, st.lists(u32, max_size=6).map(tuple), texts),
)
outbound = st.one_of(
    st.builds(cf.StreamContent, u32, u64, u64, u8, st.binary(max_size=8)),
    st.builds(cf.StreamThought, u32, u64, u64, u8, st.binary(max_size=8)),
    st.builds(cf.TurnComplete, u32, u32, f32s, u8),
    st.builds(cf.ToolCall, u16, texts, texts),
    st.builds(cf.MemResponse, u8, u16, u32, st.lists(u64, max_size=5).map(tuple)),
    st.builds(cf.Status, u8, u8, u16, u16, u16, f32s, u32, u32),
    st.builds(cf.SnapshotStatus, u8, u16, u64, texts),
    st.builds(cf.AutonomicResult, u16, u32, f32s, f32s, f32s, st.binary(max_size=8)),
    st.builds(cf.Pong), st.builds(cf.Error, u16, texts),
)
cut_lists = st.lists(st.integers(0, 1 << 10), max_size=12)


@pytest.mark.parametrize(("accept", "messages"), [("inbound", inbound), ("outbound", outbound)])
@SETTINGS
@given(data=st.data())
def test_round_trip_in_any_chunking(accept, messages, data):
    frames = data.draw(st.lists(st.tuples(u16, messages), max_size=5))
    blob = b"".join(encode(i, m) for i, m in frames)
    for _, m in frames:
        assert decode_payload(m.OP, encode_payload(m)) == m
    expected = [cf.Frame(i, m) for i, m in frames] + [cf.EndOfInput(False)]
    for pieces in feeds(blob, data.draw(cut_lists)):
        assert read(pieces, accept) == expected


# ---------------------------------------------------------------- arbitrary bytes

FRAGMENTS = [
    header(1, Op.PING, 0), header(2, Op.STREAM_INPUT, 3), header(3, Op.PONG, 2), header(4, 0x99, 1),
    header(5, Op.SET_CONFIG, 41), header(6, Op.PING, 0, reserved=1), header(7, Op.ERROR, MAX_PAYLOAD + 1),
    header(8, Op.PING, 0, version=2), encode(9, cf.StreamInput.of_text("hi")), encode(10, cf.Pong()),
    encode(11, cf.Error(5, "x")), b"XLUS", b"XLUS\x01\x00", b"\x00", b"\xff", b"\x01",
]
readers = st.sampled_from([("inbound", MAX_PAYLOAD), ("outbound", MAX_PAYLOAD), ("inbound", 0),
                           ("outbound", 8)])


def check_events(events: list, accept: str, max_payload: int) -> None:
    """At most one FatalFrame, last (nothing after it); else one EndOfInput, last; fields in range;
    every Frame's message of the accepted direction, and it re-encodes to itself."""
    fatal = [i for i, e in enumerate(events) if isinstance(e, cf.FatalFrame)]
    ends = [i for i, e in enumerate(events) if isinstance(e, cf.EndOfInput)]
    assert (fatal, ends) in (([len(events) - 1], []), ([], [len(events) - 1])), events
    ops = cf.INBOUND if accept == "inbound" else cf.OUTBOUND
    for e in events:
        if isinstance(e, cf.Frame):
            assert 0 <= e.msg_id <= 0xFFFF and e.message.OP in ops
            assert len(encode_payload(e.message)) <= max(max_payload, 41)  # SET_CONFIG's 37 become 41
            again = read([encode(e.msg_id, e.message)], accept)
            assert encode(e.msg_id, again[0].message) == encode(e.msg_id, e.message)
        elif isinstance(e, cf.BadFrame):
            assert 0 <= e.msg_id <= 0xFFFF and e.code in (UO, MP) and e.detail
        elif isinstance(e, cf.FatalFrame):
            assert e.msg_id == 0 and e.code in (ErrorCode.BAD_MAGIC, ErrorCode.BAD_VERSION,
                                                ErrorCode.PAYLOAD_TOO_LARGE)


@SETTINGS
@given(st.lists(st.sampled_from(FRAGMENTS) | st.binary(max_size=20), max_size=10), cut_lists, readers)
def test_arbitrary_bytes(parts, cuts, reader_args):
    blob = b"".join(parts)
    runs = [read(pieces, *reader_args) for pieces in feeds(blob, cuts)]  # read() checks the buffering
    assert runs[0] == runs[1] == runs[2], "events depend on the chunking"
    check_events(runs[0], *reader_args)
    reader = FrameReader(*reader_args)
    reader.receive_data(blob)
    reader.receive_data(b"")
    assert reader.receive_data(encode(1, cf.Ping())) == [] and reader.receive_data(b"") == []


@SETTINGS
@given(st.binary(max_size=64), st.sampled_from(["inbound", "outbound"]))
def test_random_bytes_never_raise(blob, accept):
    check_events(read([blob], accept), accept, MAX_PAYLOAD)


# ---------------------------------------------------------------- refusals, with their msg_id


@pytest.mark.parametrize(("blob", "code"), [
    (b"G", ErrorCode.BAD_MAGIC),  # the first wrong byte is enough: no waiting for a header
    (b"GET / HTTP/1.1\r\n\r\n", ErrorCode.BAD_MAGIC),
    (header(5, Op.PING, 0, magic=0x53554C59), ErrorCode.BAD_MAGIC),
    (header(5, Op.PING, 0, magic=0x584C5553), ErrorCode.BAD_MAGIC),  # big-endian magic
    (header(5, Op.PING, 0, version=2), ErrorCode.BAD_VERSION),
    (header(5, Op.PING, 0, version=0)[:5], ErrorCode.BAD_VERSION),
    (header(5, Op.PING, 0, version=0x0101), ErrorCode.BAD_VERSION),
    (header(5, Op.PING, MAX_PAYLOAD + 1), ErrorCode.PAYLOAD_TOO_LARGE),
    (header(5, 0x99, 0xFFFFFFFF), ErrorCode.PAYLOAD_TOO_LARGE),  # before the opcode is looked at
])
def test_fatal(blob, code):
    good, frame = probe_frame("inbound", 1)
    for pieces in feeds(good + blob):
        assert codes(read(pieces)) == [frame, (cf.FatalFrame, 0, code)]  # nothing after it, not even EOF
    reader = FrameReader()
    assert codes(reader.receive_data(blob + good)) == [(cf.FatalFrame, 0, code)]
    assert reader.receive_data(good) == [] and reader.receive_data(b"") == [] and reader.buffered == 0


def test_payload_limit_is_the_readers():
    assert codes(read([header(5, Op.STREAM_INPUT, 11) + bytes(11)], max_payload=10)) == [
        (cf.FatalFrame, 0, ErrorCode.PAYLOAD_TOO_LARGE)]
    assert read([header(5, Op.STREAM_INPUT, 10) + bytes(10)], max_payload=10) == [
        cf.Frame(5, cf.StreamInput(0, 0, bytes(8))), cf.EndOfInput(False)]
    reader = FrameReader()  # MAX_PAYLOAD itself is taken: the header alone waits for it
    assert reader.receive_data(header(5, Op.STREAM_INPUT, MAX_PAYLOAD)) == [] and reader.buffered == 0
    with pytest.raises(ValueError):
        FrameReader(max_payload=MAX_PAYLOAD + 1)
    with pytest.raises(ValueError):
        FrameReader("both")


@pytest.mark.parametrize(("accept", "op"), [
    ("inbound", 0x0000), ("inbound", 0x000B), ("inbound", 0x00FF), ("inbound", 0x0100), ("inbound", 0xFFFF),
    ("inbound", Op.PONG), ("inbound", Op.STREAM_CONTENT), ("inbound", Op.ERROR),  # the other direction
    ("outbound", Op.PING), ("outbound", Op.STREAM_INPUT), ("outbound", 0x01FE), ("outbound", 0x0013),
])
def test_unknown_opcode_is_skipped(accept, op):
    good, frame = probe_frame(accept)
    blob = header(0xBEEF, op, 5, reserved=op & 1) + b"\xff" * 5 + good  # reserved or not: UNKNOWN first
    for pieces in feeds(blob, [3, 17, 20]):
        assert codes(read(pieces, accept)) == [(cf.BadFrame, 0xBEEF, UO), frame, cf.EndOfInput(False)]


def test_unknown_opcode_payload_is_not_buffered():
    reader = FrameReader()
    assert reader.receive_data(header(1, 0x99, 1 << 20) + bytes(1 << 19)) == [] and reader.buffered == 0
    assert codes(reader.receive_data(bytes(1 << 19))) == [(cf.BadFrame, 1, UO)]
    with pytest.raises(PayloadError) as e:
        decode_payload(0x99, b"")
    assert e.value.code == UO


def test_reserved_header_field_is_refused_and_skipped():
    for accept, op, payload in (("inbound", Op.PING, b""), ("inbound", Op.STREAM_INPUT, b"\x00\x00hi"),
                                ("outbound", Op.ERROR, b"\x05\x00\x00\x00")):
        good, frame = probe_frame(accept)
        for reserved in (1, 0x8000, 0xFFFF):
            blob = header(21, op, len(payload), reserved) + payload + good
            for pieces in feeds(blob, [5, 11, 16]):
                assert codes(read(pieces, accept)) == [(cf.BadFrame, 21, MP), frame, cf.EndOfInput(False)]


def nested(depth: int) -> bytes:
    return b'{"x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


S16 = struct.Struct("<H").pack
MALFORMED = [
    (Op.STREAM_INPUT, b""), (Op.STREAM_INPUT, b"\x00"), (Op.STREAM_INPUT, b"\x00\x00\xff"),
    (Op.STREAM_INPUT, b"\x00\x00\xc3"), (Op.STREAM_INPUT, b"\x01\x00abc"), (Op.STREAM_INPUT, b"\x02\x00abc"),
    (Op.ABORT, b"\x00"), (Op.MEM_COMMIT, b"x"), (Op.PING, b"\x00"), (Op.SHUTDOWN, b"\x00" * 4),
    (Op.MEM_QUERY, bytes(23)), (Op.MEM_QUERY, bytes(24) + b"\xff"),
    (Op.SET_CONFIG, b""), (Op.SET_CONFIG, bytes(36)), (Op.SET_CONFIG, bytes(38)), (Op.SET_CONFIG, bytes(40)),
    (Op.SET_CONFIG, bytes(42)), (Op.SET_CONFIG, bytes(37) + b"\x01\x00\x00\x00"),
    (Op.SET_CONFIG, bytes(40) + b"\x80"),
    (Op.TOOL_RETURN, b""), (Op.TOOL_RETURN, S16(1) + b"a" + b"\x02" + bytes(4)),  # is_error 2
    (Op.TOOL_RETURN, S16(9) + b"a\x00" + bytes(4)),
    (Op.TOOL_RETURN, S16(1) + b"a\x00" + b"\x05\x00\x00\x00ab"),
    (Op.TOOL_RETURN, S16(1) + b"a\x00" + bytes(4) + b"!"), (Op.TOOL_RETURN, S16(1) + b"\xff\x00" + bytes(4)),
    (Op.SET_SYSTEM, b""), (Op.SET_SYSTEM, b"\xff"), (Op.SET_SYSTEM, b"not json"), (Op.SET_SYSTEM, b"[]"),
    (Op.SET_SYSTEM, b'"x"'), (Op.SET_SYSTEM, b'{"instructions": 5}'), (Op.SET_SYSTEM, b'{"tools": {}}'),
    (Op.SET_SYSTEM, b'{"tools": [1]}'), (Op.SET_SYSTEM, b'{"tools": [{}]}'),
    (Op.SET_SYSTEM, b'{"tools": [{"name": 1}]}'), (Op.SET_SYSTEM, b'{"x": NaN}'),
    (Op.SET_SYSTEM, b'{"x": -Infinity}'), (Op.SET_SYSTEM, b'{"x": 1e999}'),
    (Op.SET_SYSTEM, b'{"x": "\\ud800"}'),
    (Op.SET_SYSTEM, b'{"\\udfff": 1}'), (Op.SET_SYSTEM, b"\xef\xbb\xbf{}"), (Op.SET_SYSTEM, b"{} {}"),
    (Op.SET_SYSTEM, nested(MAX_JSON_DEPTH + 1)), (Op.SET_SYSTEM, b"[" * 100_000 + b"]" * 100_000),
    (Op.SNAPSHOT_SAVE, S16(0) + S16(0)), (Op.SNAPSHOT_SAVE, S16(3) + b"a\x00b" + S16(0)),
    (Op.SNAPSHOT_SAVE, S16(1) + b"a" + S16(2) + b"x"), (Op.SNAPSHOT_SAVE, S16(1) + b"a" + S16(0) + b"!"),
    (Op.SNAPSHOT_SAVE, S16(1) + b"a"), (Op.SNAPSHOT_LOAD, b""), (Op.SNAPSHOT_LOAD, b"a\x00b"),
    (Op.SNAPSHOT_LOAD, b"\xff"), (Op.RESUME, b"\x02"), (Op.RESUME, b"\x00\x00"),
    (Op.PROBE_AUTONOMIC, b"\x01\x00"), (Op.PROBE_AUTONOMIC, struct.pack("<HHI", 1, 2, 5) + bytes(4)),
    (Op.PROBE_AUTONOMIC, struct.pack("<HHI", 1, 0, 3) + b"ab"),
    (Op.PROBE_AUTONOMIC, struct.pack("<HHI", 1, 0, 0) + b"!"),
    (Op.PROBE_AUTONOMIC, struct.pack("<HHI", 1, 0, 1) + b"\xff"),
    (Op.STREAM_CONTENT, struct.pack("<IQQBBH", 1, 2, 3, 0, 0, 2) + b"a"),
    (Op.STREAM_CONTENT, struct.pack("<IQQBBH", 1, 2, 3, 0, 1, 0)), (Op.STREAM_THOUGHT, bytes(24) + b"!"),
    (Op.STREAM_THOUGHT, bytes(23)), (Op.TURN_COMPLETE, bytes(15)), (Op.TURN_COMPLETE, bytes(17)),
    (Op.TURN_COMPLETE, bytes(15) + b"\x01"), (Op.TOOL_CALL, b"\x01\x00\x05\x00abc"),
    (Op.TOOL_CALL, b"\x01\x00\x01\x00a\xff"), (Op.MEM_RESPONSE, struct.pack("<BBHI", 2, 0, 0, 0) + bytes(8)),
    (Op.MEM_RESPONSE, struct.pack("<BBHI", 0, 0, 0, 0) + b"!"),
    (Op.STATUS, bytes(19)), (Op.STATUS, bytes(21)),
    (Op.SNAPSHOT_STATUS, struct.pack("<BBHQH", 0, 1, 0, 0, 0)),
    (Op.SNAPSHOT_STATUS, struct.pack("<BBHQH", 0, 0, 0, 0, 1) + b"\xff"),
    (Op.AUTONOMIC_RESULT, struct.pack("<HIfffH", 0, 0, 0, 0, 0, 3) + b"ab"), (Op.AUTONOMIC_RESULT, bytes(19)),
    (Op.PONG, b"\x00"), (Op.ERROR, b"\x05\x00"), (Op.ERROR, b"\x05\x00\x02\x00a"),
    (Op.ERROR, b"\x05\x00\x01\x00\xff"),
]


@pytest.mark.parametrize(("op", "payload"), MALFORMED,
                         ids=[f"{op.name}-{i}" for i, (op, _) in enumerate(MALFORMED)])
def test_malformed_payload_is_refused_and_the_next_frame_read(op, payload):
    with pytest.raises(PayloadError) as e:
        decode_payload(op, payload)
    assert e.value.code == MP and e.value.detail
    accept = accept_of(op)
    good, frame = probe_frame(accept)
    blob = header(0x4242, op, len(payload)) + payload + good
    for pieces in feeds(blob, [1, 15, 17, len(blob) - 17])[::2]:  # whole and cut (bytewise: the fuzzer's)
        assert codes(read(pieces, accept)) == [(cf.BadFrame, 0x4242, MP), frame, cf.EndOfInput(False)]


def test_json_depth_limit():
    deepest = decode_payload(Op.SET_SYSTEM, nested(MAX_JSON_DEPTH))  # nested(65) is refused: MALFORMED
    assert json.dumps(deepest.raw).replace(" ", "") == nested(MAX_JSON_DEPTH).decode().replace(" ", "")
    with pytest.raises(ValueError):
        encode_payload(cf.SetSystem(raw=json.loads(nested(MAX_JSON_DEPTH + 1))))


@pytest.mark.parametrize(("blob", "partial"), [
    (b"", False), (encode(1, cf.Ping()), False), (b"XLUS\x01", True), (header(1, Op.PING, 0)[:15], True),
    (header(1, Op.STREAM_INPUT, 4) + b"\x00\x00", True), (header(1, Op.STREAM_INPUT, 2), True),
    (header(1, 0x99, 4) + b"ab", True),  # a refused frame cut short: no BadFrame, only EOF
])
def test_end_of_input(blob, partial):
    for pieces in feeds(blob):
        events = read(pieces)
        assert events[-1] == cf.EndOfInput(partial) and all(isinstance(e, cf.Frame) for e in events[:-1])


# ---------------------------------------------------------------- what the encoder refuses


@pytest.mark.parametrize("message", [
    cf.StreamInput(0, 256, b""), cf.StreamInput(256, 0, b""), cf.StreamInput(cf.DataType.TOKENS, 0, b"abc"),
    cf.StreamInput(cf.DataType.EMBEDDINGS, 0, b"abc"), cf.StreamInput(cf.DataType.TEXT, 0, b"\xff"),
    cf.MemQuery(0, 0, 0, -1, 0, 0, 0, ""), cf.MemQuery(0, 0, 0, 0, 1e39, 0, 0, ""),
    cf.MemQuery(0, 0, 0, 0, 0, 0, 0, "\ud800"), cf.SetConfig(top_k=2**32), cf.SetConfig(flags=256),
    cf.SetConfig(temperature=-1e300), cf.ToolReturn("x" * 65536, False, ""), cf.ToolReturn("a", 2, ""),
    cf.SetSystem(raw={"x": {1, 2}}), cf.SetSystem(raw={"x": math.nan}), cf.SetSystem("x", ({"n": 1},)),
    cf.SetSystem("\udc80"), cf.SnapshotSave("", "s"), cf.SnapshotSave("a\x00", "s"), cf.SnapshotLoad(""),
    cf.SnapshotLoad("a\x00b"), cf.Resume(2), cf.Resume(-1), cf.ProbeAutonomic(1, (2**32,), ""),
    cf.ProbeAutonomic(65536, (), ""), cf.StreamContent(0, 0, 0, 0, bytes(65536)),
    cf.StreamThought(0, 2**64, 0, 0, b""), cf.TurnComplete(-1, 0, 0, 0), cf.TurnComplete(0, 0, 0, 256),
    cf.ToolCall(65536, "", ""), cf.ToolCall(0, "n" * 65536, ""), cf.MemResponse(0, 0, 0, (0,) * 256),
    cf.MemResponse(0, 0, 0, (2**64,)), cf.Status(5, 256, 0, 0, 0, 0, 0, 0),
    cf.SnapshotStatus(0, 0, 0, "s" * 65536), cf.AutonomicResult(0, 0, 0, 0, 0, bytes(65536)),
    cf.Error(65536), cf.Error(-1),
])
def test_encoder_refuses_what_the_decoder_would(message):
    with pytest.raises(ValueError):
        encode(1, message)


def test_encode_checks_msg_id_and_type():
    for msg_id in (-1, 65536, 1 << 40):
        with pytest.raises(ValueError):
            encode(msg_id, cf.Ping())
    assert encode(65535, cf.Ping())[6:8] == b"\xff\xff" and encode(0, cf.Ping())[6:8] == b"\x00\x00"
    with pytest.raises(TypeError):
        encode(1, cf.Frame(1, cf.Ping()))


def test_error_detail_is_cut_at_a_character_and_always_encodes():
    assert decode_payload(Op.ERROR, encode_payload(cf.Error(1, "é" * 40000))).detail == "é" * 32767
    assert decode_payload(Op.ERROR, encode_payload(cf.Error(1, "a" * 70000))).detail == "a" * 65535
    assert decode_payload(Op.ERROR, encode_payload(cf.Error(1, "bad \ud800"))).detail == "bad ?"


def test_buffering_is_one_frame():
    blob = encode(1, cf.StreamInput(0, 0, b"x" * 5000)) * 3
    reader, out = FrameReader(max_payload=5002), []
    for i in range(0, len(blob), 1000):
        out += reader.receive_data(blob[i : i + 1000])
        assert reader.buffered <= 5002
    assert out == [cf.Frame(1, cf.StreamInput(0, 0, b"x" * 5000))] * 3 and reader.buffered == 0
