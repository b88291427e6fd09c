"""The mux codec on arbitrary and half-valid input (colibri/io/mux.py, docs/serve_protocol.md).

Whatever the bytes, both readers never raise, yield only documented events with fields in range,
decode the same whatever the chunking, re-encode what they decoded, and resynchronise on the next
line (unless a byte-counted header may swallow it).
"""

from __future__ import annotations

import math

from hypothesis import assume, given
from hypothesis import strategies as st
from test_codec_mux import (
    MANY,
    SETTINGS,
    all_feeds,
    as_sent,
    cancels,
    cut_lists,
    read_requests,
    read_responses,
    requests,
    responses,
)

from colibri.io.events import (
    Accept,
    Cancel,
    Data,
    Done,
    EndOfInput,
    Entropy,
    Error,
    ErrorCode,
    ExpertMap,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    Prof,
    ProtocolError,
    Ready,
    Repin,
    Stat,
    Stop,
    Submit,
    Tiers,
    TopK,
    UnknownLine,
)
from colibri.io.mux import (
    MAX_ID,
    MAX_LINE,
    MAX_TOKENS_LIMIT,
    READY_LINE,
    encode_request,
    encode_response,
)

READER_CODES = {ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.EMPTY_PROMPT}
REQUEST_EVENTS = (Submit, Cancel, Stop, ProtocolError, EndOfInput)
RESPONSE_EVENTS = (Ready, Stat, Accept, Data, TopK, Done, Error, HwInfo, Tiers, ExpertMap, Hits, Repin, Perf,
                   Prof, Entropy, Gpus, ProtocolError, UnknownLine)


# Pieces of half-valid input: verbs, separators, numbers at and past every limit, junk.
REQUEST_FRAGMENTS = [
    b"SUBMIT ", b"CANCEL ", b" ", b"\n", b"\r\n", b"0", b"1", b"7", b"255", b"256", b"-1", b"+1",
    b"18446744073709551615", b"18446744073709551616", b"1048576", b"1048577", b"0.7", b"1", b"1.5",
    b"nan", b"inf", b"-inf", b"1e999", b"\xff", b"\x00", b"\xc3", b"\xa9", b"X" * (MAX_LINE + 1),
    b"SUBMIT 1 0 5 16 0.7 0.9\n", b"SUBMIT 1 0 0 1 1 1\n", b"SUBMIT 0 0 3 1 1 1\n",
    b"SUBMIT 1 0 16777217 1 1 1\n", b"SUBMIT 1 0 2 1 1 1 9\n", b" 18446744073709551615\n",
]
RESPONSE_FRAGMENTS = [
    b"DATA ", b"DONE ", b"STAT ", b"ERROR ", b"TOPK ", b"HWINFO ", b"TIERS ", b"EMAP ", b"HITS ",
    b"REPIN ", b"PERF ", b"ENTROPY ", b"GPUS ", READY_LINE, b" ", b"\n", b"|", b"-", b"0", b"1", b"5",
    b"-1", b"0.5", b"nan", b"inf", b"ff", b"f", b"zz", b"CANCELLED", b"CONTEXT_EXCEEDED", b"NOPE",
    b"\xff", b"\x00", b"DATA 1 1\n", b"DATA 1 -1\n", b"DATA 1 3\n", b"PERF 1", b"TOPK 1 5",
]

request_frames = requests.map(encode_request)
response_frames = responses.map(encode_response)
request_mixtures = st.lists(
    st.one_of(request_frames, st.sampled_from(REQUEST_FRAGMENTS), st.binary(max_size=12)), max_size=16
).map(b"".join)
response_mixtures = st.lists(
    st.one_of(response_frames, st.sampled_from(RESPONSE_FRAGMENTS), st.binary(max_size=12)), max_size=16
).map(b"".join)
request_garbage = st.lists(
    st.one_of(st.sampled_from([f for f in REQUEST_FRAGMENTS if b"SUBMIT" not in f]),
              cancels.map(encode_request), st.binary(max_size=12)),
    max_size=16,
).map(b"".join)
response_garbage = st.lists(
    st.one_of(st.sampled_from([f for f in RESPONSE_FRAGMENTS if b"DATA" not in f]),
              responses.filter(lambda e: not isinstance(e, Data)).map(encode_response),
              st.binary(max_size=12)),
    max_size=16,
).map(b"".join)


# ---------------------------------------------------------------- invariants


def check_request_events(events: list, eof: bool = True) -> None:
    for e in events:
        assert isinstance(e, REQUEST_EVENTS), e
        if isinstance(e, Submit):
            assert 1 <= e.id <= MAX_ID and 0 <= e.slot <= 255 and 0 <= e.max_tokens <= MAX_TOKENS_LIMIT
            assert math.isfinite(e.temperature) and e.temperature >= 0 and 0 < e.top_p <= 1
            assert isinstance(e.prompt, str) and (e.seed is None or 0 <= e.seed <= MAX_ID)
        elif isinstance(e, Cancel):
            assert 1 <= e.id <= MAX_ID
        elif isinstance(e, ProtocolError):
            assert e.code in READER_CODES and 0 <= e.id <= MAX_ID
    ends = [i for i, e in enumerate(events) if isinstance(e, EndOfInput)]
    assert ends == ([len(events) - 1] if eof else [])


def check_response_events(events: list) -> None:
    for e in events:
        assert isinstance(e, RESPONSE_EVENTS), e
        if isinstance(e, ProtocolError):
            assert e.code == ErrorCode.BAD_FRAME
        elif isinstance(e, UnknownLine):
            assert b"\n" not in e.line


# ---------------------------------------------------------------- arbitrary input


@MANY
@given(blob=st.binary(max_size=300) | request_mixtures, cuts=cut_lists)
def test_request_reader_survives_anything_and_ignores_chunking(blob, cuts):
    feeds = all_feeds(blob, cuts)
    first = read_requests(feeds[0])
    check_request_events(first)
    for pieces in feeds[1:]:
        assert read_requests(pieces) == first


@SETTINGS
@given(blob=request_mixtures)
def test_decoded_requests_re_encode_to_themselves(blob):
    for ev in read_requests([blob] if blob else []):
        if isinstance(ev, Submit | Cancel):
            assert read_requests([encode_request(ev)]) == [as_sent(ev), EndOfInput()]


@MANY
@given(garbage=request_garbage, cuts=cut_lists)
def test_request_reader_resynchronises_on_the_next_line(garbage, cuts):
    """Without a SUBMIT header in the garbage no payload can swallow the next line: after a \\n,
    the next request decodes."""
    assume(b"SUBMIT" not in garbage)
    blob = garbage + b"\n" + b"CANCEL 7\n"
    for pieces in all_feeds(blob, cuts):
        events = read_requests(pieces)
        check_request_events(events)
        assert events[-2:] == [Cancel(7), EndOfInput()]


@MANY
@given(blob=st.binary(max_size=300) | response_mixtures, cuts=cut_lists)
def test_response_reader_survives_anything_and_ignores_chunking(blob, cuts):
    feeds = all_feeds(blob, cuts)
    first = read_responses(feeds[0])
    check_response_events(first)
    for pieces in feeds[1:]:
        assert read_responses(pieces) == first


@SETTINGS
@given(blob=response_mixtures)
def test_decoded_responses_re_encode_stably(blob):
    """Whatever the reader made of the input re-encodes, and decodes to what it encodes."""
    for ev in read_responses([blob]):
        if isinstance(ev, ProtocolError | UnknownLine):
            continue
        once = encode_response(ev)
        (again,) = read_responses([once])
        assert type(again) is type(ev)
        assert encode_response(again) == once


@MANY
@given(garbage=response_garbage, cuts=cut_lists)
def test_response_reader_resynchronises_on_the_next_line(garbage, cuts):
    assume(b"DATA" not in garbage)
    blob = garbage + b"\n" + b"REPIN 1 2 3 4\n"
    for pieces in all_feeds(blob, cuts):
        events = read_responses(pieces)
        check_response_events(events)
        assert events[-1] == Repin(1, 2, 3, 4)
