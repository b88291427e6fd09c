"""Write the seed corpus fuzz/corpus/channel/ (``python fuzz/make_channel_corpus.py``) for
fuzz_channel.py: one valid frame of every opcode, sessions of several frames, and the edge and error
cases tests/test_codec_channel.py pins down (truncation, bad magic and version, oversized lengths,
unknown opcodes, the reserved field, malformed payloads), and the sessions that crashed the engine
or wrote past its context (issue 38).

The frames are packed here with ``struct``, not with the codec, so a codec bug cannot shape its
own seeds. A separate file from make_corpus.py (the line protocols' seeds).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HERE = Path(__file__).parent
MAGIC, VERSION, MAX_PAYLOAD = 0x53554C58, 1, 67_108_864


def frame(op: int, payload: bytes = b"", msg_id: int = 1, reserved: int = 0, n: int | None = None,
          magic: int = MAGIC, version: int = VERSION) -> bytes:
    """A header and payload; ``n`` overrides the payload_len (a lying or oversized count)."""
    n = len(payload) if n is None else n
    return struct.pack("<IHHHHI", magic, version, msg_id, op, reserved, n) + payload


def s16(raw: bytes) -> bytes:
    return struct.pack("<H", len(raw)) + raw


def s32(raw: bytes) -> bytes:
    return struct.pack("<I", len(raw)) + raw


CONFIG = struct.pack("<fffIIfIfIB", 0.7, 0.95, 0.05, 64, 4096, 1.10, 64, 0.02, 512, 0b1111)
SYSTEM = json.dumps({"instructions": "You are terse.", "tools": [
    {"name": "add", "description": "a + b", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}}}], "tool_choice": "auto"}).encode()
PING, PONG = frame(0x000E, msg_id=0xABCD), frame(0x010E, msg_id=0xABCD)

VALID = {  # one frame of every opcode
    "stream_input_text": frame(0x0001, b"\x00\x00" + "Hello, café 中文 😀".encode(), msg_id=2),
    "stream_input_tokens": frame(0x0001, b"\x01\x03" + struct.pack("<3I", 1, 42, 151_643), msg_id=3),
    "stream_input_embeddings": frame(0x0001, b"\x02\x00" + struct.pack("<4e", 0.5, -1, 2, 0)),
    "stream_input_image": frame(0x0001, b"\x04\x00\x89PNG\r\n\x1a\n"),
    "abort": frame(0x0002, msg_id=9),
    "mem_query": frame(0x0003, struct.pack("<BBHQfff", 1, 8, 0, 1_700_000_000, 0.6, 0.3, 0.1) + b"cats"),
    "set_config": frame(0x0004, CONFIG + bytes(4)),
    "tool_return": frame(0x0005, s16(b"call_1") + b"\x00" + s32(b'{"sum": 3}')),
    "mem_commit": frame(0x0006),
    "set_system": frame(0x0007, SYSTEM),
    "snapshot_save": frame(0x0008, s16(b"/var/lib/colibri/a.snap") + s16(b"stream-1")),
    "snapshot_load": frame(0x0009, b"/var/lib/colibri/a.snap"),
    "resume": frame(0x000A, b"\x01"),
    "ping": frame(0x000E, msg_id=0xFFFF),
    "shutdown": frame(0x000F, msg_id=0),
    "probe_autonomic": frame(0x0012, struct.pack("<HH2I", 1, 2, 9454, 2822) + s32(b"Yes or no?")),
    "stream_content": frame(0x0101, struct.pack("<IQQBBH", 9906, 17, 0xFFFF, 0, 0, 5) + b"Hello"),
    "stream_thought": frame(0x0102, struct.pack("<IQQBBH", 100, 18, 1, 3, 0, 1) + b"\xe4"),  # part of a char
    "turn_complete": frame(0x0103, struct.pack("<IIfB3x", 42, 1234, 34.5, 0)),
    "tool_call": frame(0x0104, struct.pack("<HH", 1, 3) + b'add{"a": 1, "b": 2}'),
    "mem_response": frame(0x0105, struct.pack("<BBHI2Q", 2, 0, 3, 120, 1_700_000_000, 1_700_000_100)),
    "status": frame(0x0106, struct.pack("<BBHHHfII", 2, 1, 1, 7, 1, 40.0, 12, 4096), msg_id=0),
    "snapshot_status": frame(0x0107, struct.pack("<BBHQ", 0, 0, 1, 99) + s16(b"stream-1")),
    "autonomic_result": frame(0x010C, struct.pack("<HIfffH", 0, 9454, 0.93, 0.2, 1.5, 3) + b"Yes"),
    "pong": frame(0x010E, msg_id=0xFFFF),
    "error": frame(0x01FF, struct.pack("<H", 4) + s16(b"opcode 0x0099 is not assigned")),
}

EDGES = {
    # the protocol's two spellings, sessions
    "set_config_37": frame(0x0004, CONFIG),
    "resume_empty": frame(0x000A),
    "session_inbound": (frame(0x0007, SYSTEM, 1) + frame(0x0004, CONFIG + bytes(4), 2)
                        + frame(0x0001, b"\x00\x02Why?", 3) + frame(0x000A, b"", 4) + frame(0x0002, b"", 5)
                        + frame(0x000E, b"", 6) + frame(0x000F, b"", 7)),
    "session_outbound": (frame(0x0106, bytes(20), 0) + frame(0x0106, b"\x01" + bytes(19), 3)
                         + frame(0x0102, struct.pack("<IQQBBH", 5, 1, 3, 0, 0, 2) + b"Hm", 3)
                         + frame(0x0101, struct.pack("<IQQBBH", 6, 2, 3, 0, 0, 2) + b"\xc3", 3)
                         + frame(0x0101, struct.pack("<IQQBBH", 7, 3, 3, 0, 0, 1) + b"\xa9", 3)
                         + frame(0x0104, struct.pack("<HH", 1, 3) + b"add{}", 3)
                         + frame(0x0103, struct.pack("<IIfB3x", 3, 10, 300.0, 3), 3)
                         + frame(0x0106, bytes(20), 0)),
    "empty_frames": frame(0x0002) + frame(0x0006) + frame(0x000E) + frame(0x010E) + frame(0x000F),
    # framing: truncated, fatal
    "truncated_header": frame(0x000E)[:11],
    "truncated_payload": frame(0x0001, b"\x00\x00Hello")[:20],
    "bad_magic": frame(0x000E, magic=0x53554C59) + PING,
    "bad_magic_text": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad_magic_big_endian": frame(0x000E, magic=0x584C5553),
    "bad_version": frame(0x000E, version=2) + PING,
    "bad_version_zero": PING + frame(0x010E, version=0),
    "oversized_length": frame(0x0001, b"\x00\x00hi", n=MAX_PAYLOAD + 1) + PING,
    "max_length_header": frame(0x0001, b"\x00\x00", n=MAX_PAYLOAD),
    "good_then_fatal": PING + PONG + b"\xffXLUS" + PING,
    # recoverable: unknown and wrong-direction opcodes, the reserved field
    "unknown_opcode": (frame(0x0099, b"abc", 5) + frame(0x0000, b"", 6) + frame(0xFFFF, b"\x00", 7)
                       + PING + PONG),
    "wrong_direction": frame(0x0101, bytes(24), 8) + frame(0x0001, b"\x00\x00hi", 9) + PING + PONG,
    "reserved_header": frame(0x000E, reserved=1) + frame(0x0001, b"\x00\x00x", reserved=0x8000) + PING + PONG,
    # malformed payloads, each followed by a good frame
    "bad_empty_payloads": (frame(0x000E, b"\x00") + frame(0x0002, b"x") + frame(0x010E, b"\x00")
                           + PING + PONG),
    "bad_stream_input": (frame(0x0001, b"\x01\x00abc") + frame(0x0001, b"\x00\x00\xff\xfe")
                         + frame(0x0001, b"\x02\x00abc") + frame(0x0001, b"\x00") + PING),
    "bad_set_config": (frame(0x0004, CONFIG + bytes(3)) + frame(0x0004, CONFIG + b"\x00\x00\x00\x01")
                       + frame(0x0004, CONFIG[:36]) + PING),
    "bad_tool_return": (frame(0x0005, s16(b"c") + b"\x02" + s32(b"x"))
                        + frame(0x0005, s16(b"c") + b"\x00" + struct.pack("<I", 99) + b"x")
                        + frame(0x0005, s16(b"c") + b"\x00" + s32(b"x") + b"!") + PING),
    "bad_set_system": (frame(0x0007, b"not json") + frame(0x0007, b"[1]") + frame(0x0007, b'{"tools": [{}]}')
                       + frame(0x0007, b'{"x": NaN}') + frame(0x0007, b'{"x": "\\ud800"}')
                       + frame(0x0007, b"[" * 70 + b"]" * 70) + frame(0x0007, b'{"instructions": 1}') + PING),
    "bad_snapshot": (frame(0x0008, s16(b"") + s16(b"s")) + frame(0x0008, s16(b"a\x00") + s16(b""))
                     + frame(0x0009, b"") + frame(0x0009, b"a\x00b") + frame(0x000A, b"\x02") + PING),
    "bad_probe": (frame(0x0012, struct.pack("<HH", 1, 5) + bytes(8))
                  + frame(0x0012, struct.pack("<HHI", 1, 0, 9) + b"abc") + PING),
    "bad_outbound": (frame(0x0101, struct.pack("<IQQBBH", 1, 2, 3, 0, 0, 9) + b"ab")
                     + frame(0x0102, struct.pack("<IQQBBH", 1, 2, 3, 0, 7, 0))
                     + frame(0x0103, struct.pack("<IIfB3s", 1, 2, 3.0, 0, b"\x00\x01\x00"))
                     + frame(0x0105, struct.pack("<BBHI", 3, 0, 0, 0) + bytes(8))
                     + frame(0x0107, struct.pack("<BBHQH", 0, 1, 0, 0, 0)) + frame(0x0106, bytes(19))
                     + frame(0x01FF, struct.pack("<HH", 5, 4) + b"ab") + PONG),
}



def config(**fields: float) -> bytes:
    """A SET_CONFIG payload, CONFIG's values with ``fields`` in place (flags 0)."""
    values = {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05, "top_k": 64, "max_tokens": 4096,
              "repeat_penalty": 1.10, "repeat_window": 64, "quiescence_threshold": 0.02,
              "thinking_budget": 512, "flags": 0} | fields
    return struct.pack("<fffIIfIfIB", *values.values())


INF, NAN = float("inf"), float("nan")
WEATHER = json.dumps({"instructions": "Be helpful.", "tool_choice": "required", "tools": [
    {"name": "get_weather", "description": "Get the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]}).encode()
HARDENING = {  # issue 38's Channel cases: each was an engine crash or a write past --ctx
    "hardening_repeat_penalty_denormal": (frame(0x0004, config(repeat_penalty=1e-45), 1)
                                          + frame(0x0001, b"\x00\x00Hello", 2) + PING),
    "hardening_config_non_finite": b"".join(
        frame(0x0004, config(**{name: value}), i + 1)
        for i, (name, value) in enumerate((name, value) for name in (
            "temperature", "top_p", "min_p", "repeat_penalty", "quiescence_threshold")
            for value in (NAN, INF, -INF))) + PING,
    "hardening_tool_return_overlong": (frame(0x0007, WEATHER, 1) + frame(0x0004, config(temperature=0.0), 2)
                                       + frame(0x0001, b"\x00\x00What is the weather in Paris?", 3)
                                       + frame(0x0005, s16(b"1") + b"\x00" + s32(b"x " * 50_000), 4)
                                       + frame(0x0008, s16(b"/tmp/after.snap") + s16(b"s"), 5) + PING),
    "hardening_context_edge": (frame(0x0007, b"{}", 1) + frame(0x0004, config(temperature=0.0), 2)
                               + frame(0x0001, b"\x00\x01" + ", ".join(str(i) for i in range(1, 121)).encode()
                                       + b",", 3)
                               + frame(0x0008, s16(b"/tmp/edge.snap") + s16(b"edge"), 4)
                               + frame(0x0009, b"/tmp/edge.snap", 5) + frame(0x0001, b"\x00\x00And then?", 6)
                               + PING),
}


def write(seeds: dict[str, bytes]) -> None:
    folder = HERE / "corpus" / "channel"
    folder.mkdir(parents=True, exist_ok=True)
    for stem, data in seeds.items():
        (folder / stem).write_bytes(data)


if __name__ == "__main__":
    write(VALID | EDGES | HARDENING)
    print(f"{len(VALID) + len(EDGES) + len(HARDENING)} channel seeds")
