"""Each rejection of the mux codec, case by case, with its exact code and id (colibri/io/mux.py,
docs/serve_protocol.md): malformed requests, byte counts that lie, limits, end of input inside a
frame, malformed responses; and where each reader picks up again afterwards.
"""

from __future__ import annotations

import pytest
from test_codec_mux import BF, BR, all_feeds, chunks, pe, read_requests, read_responses

from colibri.io.events import (
    Cancel,
    Data,
    EndOfInput,
    ProtocolError,
    Ready,
    Repin,
    Stop,
    Submit,
    UnknownLine,
)
from colibri.io.mux import (
    MAX_ID,
    MAX_LINE,
    MAX_PAYLOAD,
    MAX_SKIP,
    READY_LINE,
    RequestReader,
    payload_limit,
)

# ---------------------------------------------------------------- request errors, one by one

OK = b" 0 2 16 0.7 0.9\nhi\n"  # the rest of a valid SUBMIT after its id


@pytest.mark.parametrize(("blob", "expected"), [
    # unknown verbs, and known verbs in the wrong case or with stray bytes
    (b"FOO 1\n", [(ProtocolError, 0, BR)]),
    (b"submit 1 0 2 16 0.7 0.9\nhi\n", [(ProtocolError, 0, BR), (ProtocolError, 0, BR)]),
    (b"\n", [(ProtocolError, 0, BR)]),
    (b" CANCEL 7\n", [(ProtocolError, 0, BR)]),
    # wrong field counts: the byte count is not trusted, the payload is read as lines
    (b"CANCEL\n", [(ProtocolError, 0, BR)]),
    (b"CANCEL 1 2\n", [(ProtocolError, 0, BR)]),
    (b"CANCEL  7\n", [(ProtocolError, 0, BR)]),
    (b"SUBMIT 1 0 2 16 0.7\nhi\n", [(ProtocolError, 0, BR), (ProtocolError, 0, BR)]),
    (b"SUBMIT 1 0 2 16 0.7 0.9 0 1 1 2\nhi\n", [(ProtocolError, 0, BR), (ProtocolError, 0, BR)]),
    # the optional grammar (the gateway's seventh field: its byte count, after the prompt's bytes)
    (b"SUBMIT 5 0 2 16 0.7 0.9 3\nhix|y\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", grammar="x|y")]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi")]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 2\nhi\xff\xfe\n", [(ProtocolError, 5, BR)]),  # not UTF-8
    (b"SUBMIT 5 0 2 16 0.7 0.9 1048577\nhi\n", [(ProtocolError, 5, BR)]),  # skipped
    (b"SUBMIT 5 0 2 16 0.7 0.9 x\nhi\n", [(ProtocolError, 5, BR), (ProtocolError, 0, BR)]),
    # the optional seed (ours, an eighth field): unsigned, u64
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 42\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", 42)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 0\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", 0)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 x\nhi\n", [(ProtocolError, 5, BR)]),
    # speculation's switch (ours, a ninth field): 0 off for this request, 1 the engine's setting;
    # the seed before it may be "-", none
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 - 0\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", speculative=False)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 42 1\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", 42)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 - 2\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 -\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi")]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 - x\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 \nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 -1\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0 18446744073709551616\nhi\n", [(ProtocolError, 5, BR)]),
    # STOP (the gateway's): one id, like CANCEL
    (b"STOP 9\n", [Stop(9)]),
    (b"STOP\n", [(ProtocolError, 0, BR)]),
    (b"STOP 0\n", [(ProtocolError, 0, BR)]),
    # non-numeric fields: with a readable byte count the payload is skipped
    (b"CANCEL x\n", [(ProtocolError, 0, BR)]),
    (b"CANCEL 7\r\n", [(ProtocolError, 0, BR)]),
    (b"SUBMIT x" + OK, [(ProtocolError, 0, BR)]),
    (b"SUBMIT 5 x 2 16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 x 0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 warm 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 most\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 two 16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR), (ProtocolError, 0, BR)]),
    (b"SUBMIT 5 0 0x2 16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR), (ProtocolError, 0, BR)]),
    # id 0, ids past u64
    (b"CANCEL 0\n", [(ProtocolError, 0, BR)]),
    (b"SUBMIT 0" + OK, [(ProtocolError, 0, BR)]),
    (b"CANCEL 18446744073709551616\n", [(ProtocolError, 0, BR)]),
    (b"SUBMIT 18446744073709551616" + OK, [(ProtocolError, 0, BR)]),
    (b"CANCEL 18446744073709551615\n", [Cancel(MAX_ID)]),
    # negative numbers
    (b"CANCEL -7\n", [(ProtocolError, 0, BR)]),
    (b"SUBMIT -5" + OK, [(ProtocolError, 0, BR)]),
    (b"SUBMIT 5 -1 2 16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 -2 16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR), (ProtocolError, 0, BR)]),
    (b"SUBMIT 5 0 2 -16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 -0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 -0.9\nhi\n", [(ProtocolError, 5, BR)]),
    # limits
    (b"SUBMIT 5 256 2 16 0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 255 2 16 0.7 0.9\nhi\n", [Submit(5, 255, 16, 0.7, 0.9, "hi")]),
    (b"SUBMIT 5 0 2 1048577 0.7 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 1048576 0.7 0.9\nhi\n", [Submit(5, 0, 1 << 20, 0.7, 0.9, "hi")]),
    # temperature NaN / infinite
    (b"SUBMIT 5 0 2 16 nan 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 inf 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 -inf 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 1e999 0.9\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0 0.9\nhi\n", [Submit(5, 0, 16, 0.0, 0.9, "hi")]),
    # top_p outside (0, 1]
    (b"SUBMIT 5 0 2 16 0.7 0\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.0\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 1.0000001\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 2\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 nan\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 1\nhi\n", [Submit(5, 0, 16, 0.7, 1.0, "hi")]),
    # byte count that lies: shorter (the payload's rest is dropped through its \n) ...
    (b"SUBMIT 5 0 1 16 0.7 0.9\nhello\nCANCEL 7\n", [(ProtocolError, 5, BF), Cancel(7)]),
    # ... and longer: the payload swallows the start of the next request, which is lost
    (b"SUBMIT 5 0 10 16 0.7 0.9\nhi\nCANCEL 7\nCANCEL 8\n", [(ProtocolError, 5, BF), Cancel(8)]),
    # payload not followed by \n, then a valid request
    (b"SUBMIT 5 0 2 16 0.7 0.9\nhiX\nCANCEL 7\n", [(ProtocolError, 5, BF), Cancel(7)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9\nhi\r\nCANCEL 7\n", [(ProtocolError, 5, BF), Cancel(7)]),
    # ... also when the header was rejected (id 0): the frame is still checked
    (b"SUBMIT 0 0 2 16 0.7 0.9\nhiX\nCANCEL 7\n",
     [(ProtocolError, 0, BR), (ProtocolError, 0, BF), Cancel(7)]),
    # invalid UTF-8 payload
    (b"SUBMIT 5 0 2 16 0.7 0.9\n\xff\xfe\nCANCEL 7\n", [(ProtocolError, 5, BR), Cancel(7)]),
    (b"SUBMIT 5 0 1 16 0.7 0.9\n\xc3\nCANCEL 7\n", [(ProtocolError, 5, BR), Cancel(7)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9\n\xc3\xa9\n", [Submit(5, 0, 16, 0.7, 0.9, "é")]),
    # lines at and past MAX_LINE
    (b"X" * MAX_LINE + b"\nCANCEL 7\n", [(ProtocolError, 0, BR), Cancel(7)]),
    (b"X" * (MAX_LINE + 1) + b"\nCANCEL 7\n", [(ProtocolError, 0, BF), Cancel(7)]),
    (b"CANCEL " + b"0" * 400 + b"7\nCANCEL 8\n", [(ProtocolError, 0, BF), Cancel(8)]),
])
def test_request_errors(blob, expected):
    for pieces in all_feeds(blob, [1, 9, 24, 25]):
        assert pe(read_requests(pieces)) == [*expected, EndOfInput()]


def test_oversized_payload_is_skipped():
    n = MAX_PAYLOAD + 1
    blob = f"SUBMIT 5 0 {n} 16 0.7 0.9\n".encode() + b"\n" * n + b"\nCANCEL 7\n"
    for pieces in [[blob], chunks(blob, range(0, len(blob), 1 << 20)), chunks(blob, [30, len(blob) - 5])]:
        assert pe(read_requests(pieces)) == [(ProtocolError, 5, BR), Cancel(7), EndOfInput()]


def test_oversized_payload_count_beyond_u64_digits():
    blob = b"SUBMIT 5 0 99999999999999999999999 16 0.7 0.9\nhi\n"
    assert pe(read_requests([blob])) == [(ProtocolError, 5, BR), (ProtocolError, 0, BR), EndOfInput()]


def test_eof_while_skipping_an_oversized_payload():
    blob = f"SUBMIT 5 0 {MAX_SKIP} 16 0.7 0.9\n".encode() + b"x" * 1000
    assert pe(read_requests([blob])) == [(ProtocolError, 5, BR), EndOfInput()]


def test_a_count_no_payload_could_have_does_not_stall_the_stream():
    """A count past MAX_SKIP (10^12) is not waited for: the next line is read as a request."""
    blob = f"SUBMIT 5 0 {10**12} 16 0.7 0.9\nCANCEL 7\n".encode()
    assert pe(read_requests([blob])) == [(ProtocolError, 5, BR), Cancel(7), EndOfInput()]


def test_the_payload_cap_comes_from_the_context():
    """The engine's reader refuses a payload that cannot fit its context, before reading it."""
    limit = payload_limit(n_ctx=64, bytes_per_token=8)
    assert limit == 512
    reader = RequestReader(max_payload=limit)
    ok = f"SUBMIT 5 0 {limit} 16 0.7 0.9\n".encode() + b"a" * limit + b"\n"
    over = f"SUBMIT 6 0 {limit + 1} 16 0.7 0.9\n".encode() + b"a" * (limit + 1) + b"\nCANCEL 7\n"
    events = reader.receive_data(ok + over)
    assert [type(e) for e in events] == [Submit, ProtocolError, Cancel]
    assert events[1].id == 6 and events[1].code == BR


@pytest.mark.parametrize(("blob", "expected"), [
    (b"SUBMIT 5 0 10 16 0.7 0.9\nabc", [(ProtocolError, 5, BF)]),  # EOF mid-payload
    (b"SUBMIT 5 0 2 16 0.7 0.9\nhi", [(ProtocolError, 5, BF)]),  # EOF before the payload's \n
    (b"SUBMIT 5 0 2 16 0.7 0.9\n", [(ProtocolError, 5, BF)]),
    (b"SUBMIT 0 0 10 16 0.7 0.9\nabc", [(ProtocolError, 0, BR), (ProtocolError, 0, BF)]),
    (b"CANCEL 7", [(ProtocolError, 0, BF)]),  # EOF in a line
    (b"CANCEL 7\nCANC", [Cancel(7), (ProtocolError, 0, BF)]),
    (b"X" * 1000, [(ProtocolError, 0, BF)]),  # a too-long line: one error, not two
    (b"", []),
])
def test_eof(blob, expected):
    for pieces in all_feeds(blob, [5, 26]):
        assert pe(read_requests(pieces)) == [*expected, EndOfInput()]


def test_duplicate_eof_and_data_after_eof():
    reader = RequestReader()
    assert reader.receive_data(b"CANCEL 7\n") == [Cancel(7)]
    assert reader.receive_data(b"") == [EndOfInput()]
    assert reader.receive_data(b"") == []
    assert reader.receive_data(b"CANCEL 8\n") == []
    assert reader.receive_data(b"") == []


# ---------------------------------------------------------------- response errors


@pytest.mark.parametrize(("blob", "expected"), [
    (b"WHAT 1 2\n", [UnknownLine(b"WHAT 1 2")]),
    (b"\n", [UnknownLine(b"")]),
    (b"DONE 1 STAT x\n", [(ProtocolError, 0, BF)]),
    (b"DONE 1\n", [(ProtocolError, 0, BF)]),
    (b"ERROR 1 NOPE\n", [(ProtocolError, 0, BF)]),
    (b"ERROR 1\n", [(ProtocolError, 0, BF)]),
    (b"TOPK 1 5 -0.1 61\n", [(ProtocolError, 0, BF)]),
    (b"TOPK 1 1 -0.1 zz\n", [(ProtocolError, 0, BF)]),
    (b"EMAP 1 2 abc\n", [(ProtocolError, 0, BF)]),
    (b"GPUS 2 1.0 2.0 3\n", [(ProtocolError, 0, BF)]),
    (b"PERF x 1\n", [(ProtocolError, 0, BF)]),
    (b"PERF 1\n", [(ProtocolError, 0, BF)]),  # no timings at all: a ProtocolError, not a TypeError
    (b"DATA 1\n", [(ProtocolError, 0, BF)]),
    (b"DATA 1 x\n", [(ProtocolError, 0, BF)]),
    (b"DATA 1 -1\nhello\n", [(ProtocolError, 0, BF), UnknownLine(b"hello")]),
    (b"DATA 1 2\nhiX\nREPIN 1 2 3 4\n", [(ProtocolError, 1, BF), Repin(1, 2, 3, 4)]),
    (b"DATA 1 1\nabXYZ\nREPIN 1 2 3 4\n", [(ProtocolError, 1, BF), Repin(1, 2, 3, 4)]),
    (b"DATA 1 2\nhi\nDATA 2 0\n\n", [Data(1, b"hi"), Data(2, b"")]),
    (READY_LINE + b"\n", [Ready()]),
    (READY_LINE + b"x\n", [UnknownLine(READY_LINE + b"x")]),
])
def test_response_errors(blob, expected):
    for pieces in all_feeds(blob, [2, 8, 12]):
        assert pe(read_responses(pieces)) == expected
