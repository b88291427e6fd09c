"""Property and edge-case tests of the legacy codec (colibri/io/legacy.py; docs/serve_protocol.md).

Inputs (user lines, ``\\x02`` control frames, ``\\x02PROMPT`` frames) and outputs (answer text,
END/ERROR sentinels, STAT) round trip under any chunking; arbitrary input never raises, decodes the
same whatever the chunking and resynchronises; each rejection carries the exact code.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colibri.io import legacy
from colibri.io.events import EndOfInput, ErrorCode, ProtocolError
from colibri.io.legacy import (
    END_LINE,
    ERROR_PREFIX,
    MAX_LINE,
    MAX_PAYLOAD,
    MAX_TOKENS_LIMIT,
    SENTINEL,
    Answer,
    CancelAnswer,
    End,
    Failed,
    LegacyReader,
    More,
    OutputReader,
    RawPrompt,
    Reset,
    UserLine,
    encode_input,
    encode_output,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BR, BF, EP = ErrorCode.BAD_REQUEST, ErrorCode.BAD_FRAME, ErrorCode.EMPTY_PROMPT
READER_CODES = {BF, BR, EP}
OUTPUT_EVENTS = (Answer, End, Failed)


# ---------------------------------------------------------------- feeding helpers


def chunks(blob: bytes, cuts) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(blob)})
    bounds = [0, *points, len(blob)]
    return [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def bytewise(blob: bytes) -> list[bytes]:
    return [blob[i : i + 1] for i in range(len(blob))]


def all_feeds(blob: bytes, cuts):
    return [[blob] if blob else [], bytewise(blob), chunks(blob, cuts)]


def read_inputs(pieces, eof: bool = True) -> list:
    reader = LegacyReader()
    out = []
    for piece in pieces:
        assert piece, "an empty chunk means EOF"
        out += reader.receive_data(piece)
    if eof:
        out += reader.receive_data(b"")
        assert reader.receive_data(b"") == []
        assert reader.receive_data(b"\x02RESET\n") == []
    return out


def merged(events) -> list:
    """Answer chunks joined: how a chunk boundary splits the text is not part of the contract."""
    out: list = []
    for e in events:
        if isinstance(e, Answer):
            if not e.text:
                continue
            if out and isinstance(out[-1], Answer):
                out[-1] = Answer(out[-1].text + e.text)
                continue
        out.append(e)
    return out


def read_outputs(pieces) -> list:
    reader = OutputReader()
    out = []
    for piece in pieces:
        out += reader.receive_data(piece)
    return merged(out)


def g(x: float) -> float:
    return float(f"{x:g}")


def as_sent(ev):
    """What the reader gets back: floats exactly (repr), a user line on one line, no leading \x02."""
    if isinstance(ev, UserLine):
        return UserLine(ev.text.replace("\n", " ").lstrip("\x02"))
    return ev


def as_encoded(ev):
    if isinstance(ev, End):
        return End(ev.emitted, float(f"{ev.tok_s:.2f}"), float(f"{ev.hit_pct:.1f}"),
                   float(f"{ev.rss_gb:.2f}"), ev.prompt_tokens, ev.length_limited)
    return ev


def pe(events) -> list:
    return [(ProtocolError, e.code) if isinstance(e, ProtocolError) else e for e in events]


def is_user_text(text: str) -> bool:
    """Text a UserLine carries unchanged: the reader strips one CR, treats \\x02 as a control frame,
    and rejects blank lines."""
    line = text.replace("\n", " ")
    return bool(line.strip()) and not line.startswith("\x02") and not line.endswith("\r")


# ---------------------------------------------------------------- strategies

finite = st.floats(allow_nan=False, allow_infinity=False)
texts = st.one_of(st.text(), st.text(alphabet=st.sampled_from("\n\x00\r \x01\x02PROMPTRESET0123456789é😀")))
raw_prompts = st.builds(
    RawPrompt,
    prompt=texts.filter(bool),
    max_tokens=st.integers(0, MAX_TOKENS_LIMIT),
    temperature=st.floats(min_value=0, allow_nan=False, allow_infinity=False),
    top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
    slot=st.integers(0, 255),
)
user_lines = st.builds(UserLine, text=texts.filter(is_user_text))
controls = st.sampled_from([Reset(), More(), CancelAnswer()])
inputs = st.one_of(raw_prompts, user_lines, controls)

answers = st.builds(Answer, text=st.binary().map(lambda b: b.replace(b"\x01", b"")))
ends = st.builds(End, emitted=st.integers(0, 2**63), tok_s=finite, hit_pct=finite, rss_gb=finite,
                 prompt_tokens=st.integers(0, 2**63), length_limited=st.booleans())
outputs = st.one_of(answers, ends, st.builds(Failed, code=st.sampled_from(list(ErrorCode))))

INPUT_FRAGMENTS = [
    b"\x02", b"\x02PROMPT ", b"\x02RESET", b"\x02MORE", b"\x02CANCEL", b"PROMPT", b" ", b"\n", b"\r\n",
    b"\r", b"0", b"1", b"5", b"-1", b"0.7", b"1.5", b"nan", b"inf", b"16777217", b"1048577", b"\xff",
    b"\x00", b"\xc3", b"\x02PROMPT 5 16 0.7 0.9\n", b"\x02PROMPT 0 16 0.7 0.9\n", b"\x02PROMPT 3 x 1 1\n",
]
OUTPUT_FRAGMENTS = [
    b"\x01", b"\x01\x01", END_LINE, ERROR_PREFIX, SENTINEL, b"END", b"STAT ", b"STAT 1 2.00 3.0 4.00 5 1",
    b"EMPTY_PROMPT", b"NOPE", b"\n", b" ", b"1", b"x", b"\xff", b"\xc3",
]
input_mixtures = st.lists(
    st.one_of(inputs.map(encode_input), st.sampled_from(INPUT_FRAGMENTS), st.binary(max_size=12)),
    max_size=16,
).map(b"".join)
output_mixtures = st.lists(
    st.one_of(outputs.map(encode_output), st.sampled_from(OUTPUT_FRAGMENTS), st.binary(max_size=12)),
    max_size=16,
).map(b"".join)
cut_lists = st.lists(st.integers(0, 1 << 16), max_size=12)


def check_input_events(events: list) -> None:
    for e in events:
        assert isinstance(e, legacy.LegacyInput), e
        if isinstance(e, ProtocolError):
            assert e.code in READER_CODES
        elif isinstance(e, RawPrompt):
            assert e.prompt and 0 <= e.max_tokens <= MAX_TOKENS_LIMIT and e.slot >= 0
            assert math.isfinite(e.temperature) and e.temperature >= 0 and 0 < e.top_p <= 1
        elif isinstance(e, UserLine):
            assert e.text.strip() and "\n" not in e.text and not e.text.startswith("\x02")
    assert [i for i, e in enumerate(events) if isinstance(e, EndOfInput)] == [len(events) - 1]


# ---------------------------------------------------------------- round trips


@SETTINGS
@given(evs=st.lists(inputs, max_size=6), cuts=cut_lists)
def test_inputs_round_trip_any_chunking(evs, cuts):
    blob = b"".join(map(encode_input, evs))
    expected = [as_sent(e) for e in evs] + [EndOfInput()]
    for pieces in all_feeds(blob, cuts):
        assert read_inputs(pieces) == expected


def test_user_line_newlines_become_spaces():
    assert read_inputs([encode_input(UserLine("one\ntwo"))]) == [UserLine("one two"), EndOfInput()]


def test_user_line_cannot_inject_a_control_frame():
    events = read_inputs([encode_input(UserLine("\x02RESET"))])
    assert not isinstance(events[0], Reset)


@SETTINGS
@given(evs=st.lists(outputs, max_size=8), cuts=cut_lists)
def test_outputs_round_trip_any_chunking(evs, cuts):
    blob = b"".join(map(encode_output, evs))
    expected = merged([as_encoded(e) for e in evs])
    for pieces in all_feeds(blob, cuts):
        assert read_outputs(pieces) == expected


# ---------------------------------------------------------------- arbitrary input


@MANY
@given(blob=st.binary(max_size=300) | input_mixtures, cuts=cut_lists)
def test_legacy_reader_survives_anything_and_ignores_chunking(blob, cuts):
    feeds = all_feeds(blob, cuts)
    first = read_inputs(feeds[0])
    check_input_events(first)
    for pieces in feeds[1:]:
        assert read_inputs(pieces) == first


@SETTINGS
@given(blob=input_mixtures)
def test_decoded_inputs_re_encode_to_themselves(blob):
    for ev in read_inputs([blob] if blob else []):
        if isinstance(ev, ProtocolError | EndOfInput):
            continue
        if isinstance(ev, UserLine) and not is_user_text(ev.text):
            continue  # "a\r\r": one CR stripped on the way in, the other on the way back
        assert read_inputs([encode_input(ev)]) == [as_sent(ev), EndOfInput()]


@MANY
@given(garbage=input_mixtures, cuts=cut_lists)
def test_legacy_reader_resynchronises_on_the_next_line(garbage, cuts):
    """Without a PROMPT frame in the garbage nothing can swallow the next line."""
    assume(b"PROMPT" not in garbage)
    blob = garbage + b"\n\x02RESET\n"
    for pieces in all_feeds(blob, cuts):
        events = read_inputs(pieces)
        check_input_events(events)
        assert events[-2:] == [Reset(), EndOfInput()]


@MANY
@given(blob=st.binary(max_size=300) | output_mixtures, cuts=cut_lists)
def test_output_reader_survives_anything_and_ignores_chunking(blob, cuts):
    feeds = all_feeds(blob, cuts)
    first = read_outputs(feeds[0])
    for e in first:
        assert isinstance(e, OUTPUT_EVENTS), e
        if isinstance(e, Answer):
            assert b"\x01" not in e.text
        elif isinstance(e, Failed):
            assert isinstance(e.code, ErrorCode)
    for pieces in feeds[1:]:
        assert read_outputs(pieces) == first


@MANY
@given(garbage=output_mixtures, cuts=cut_lists)
def test_output_reader_resynchronises_on_the_next_line(garbage, cuts):
    """Without an END sentinel in the garbage (after which any line is the STAT line) a \\n ends
    whatever the garbage started, and the next END and STAT decode."""
    assume(b"END" not in garbage)
    blob = garbage + b"\n" + END_LINE + b"\nSTAT 1 2.00 3.0 4.00 5 1\n"
    for pieces in all_feeds(blob, cuts):
        assert read_outputs(pieces)[-1] == End(1, 2.0, 3.0, 4.0, 5, True)


# ---------------------------------------------------------------- inputs, case by case

HEAD = b"\x02PROMPT 5 100 0.7 0.9"


@pytest.mark.parametrize(("blob", "expected"), [
    # user lines
    (b"hello world\n", [UserLine("hello world")]),
    (b"hello world\r\n", [UserLine("hello world")]),
    (b"hello", [UserLine("hello")]),  # the last line, unterminated at EOF
    (b"hello\r", [UserLine("hello")]),
    (b"a\x00b\n", [UserLine("a\x00b")]),
    (b"caf\xc3\xa9\n", [UserLine("café")]),
    (b"one\ntwo\r\nthree\n", [UserLine("one"), UserLine("two"), UserLine("three")]),
    (b"\n", [(ProtocolError, EP)]),
    (b"\r\n", [(ProtocolError, EP)]),
    (b" \t \n", [(ProtocolError, EP)]),
    (b"\xff\xfe\n", [(ProtocolError, BR)]),
    (b"\xc3\n", [(ProtocolError, BR)]),
    # control frames
    (b"\x02RESET\n", [Reset()]),
    (b"\x02RESET\r\n", [Reset()]),
    (b"\x02MORE\n", [More()]),
    (b"\x02MORE", [More()]),
    (b"\x02RESET now\n", [(ProtocolError, BR)]),
    (b"\x02reset\n", [(ProtocolError, BR)]),
    (b"\x02 RESET\n", [(ProtocolError, BR)]),
    (b"\x02\n", [(ProtocolError, BR)]),
    (b"\x02FOO\n", [(ProtocolError, BR)]),
    # PROMPT frames, with and without slot
    (HEAD + b"\nhello\n", [RawPrompt("hello", 100, 0.7, 0.9, 0)]),
    (HEAD + b" 3\nhello\n", [RawPrompt("hello", 100, 0.7, 0.9, 3)]),
    (HEAD + b"\r\nhello\n", [RawPrompt("hello", 100, 0.7, 0.9, 0)]),
    (b"\x02PROMPT 10 100 0 1\nhello\nyou!\n", [RawPrompt("hello\nyou!", 100, 0.0, 1.0, 0)]),
    (b"\x02PROMPT 2 1048576 0.7 0.9\n\xc3\xa9\n", [RawPrompt("é", 1 << 20, 0.7, 0.9, 0)]),
    (HEAD + b"\nhello\n\x02RESET\n", [RawPrompt("hello", 100, 0.7, 0.9, 0), Reset()]),
    # bad PROMPT fields: rejected, the payload skipped
    (b"\x02PROMPT 5 x 0.7 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 -1 0.7 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 1048577 0.7 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 hot 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 nan 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 inf 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 -0.5 0.9\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 0.7 0\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 0.7 1.5\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (b"\x02PROMPT 5 100 0.7 nan\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (HEAD + b" x\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (HEAD + b" -1\nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    (HEAD + b" \nhello\n\x02RESET\n", [(ProtocolError, BR), Reset()]),
    # ... and when the payload's frame is broken too, that is reported
    (b"\x02PROMPT 5 x 0.7 0.9\nhelloX\n\x02RESET\n", [(ProtocolError, BR), (ProtocolError, BF), Reset()]),
    # an unreadable byte count or a wrong field count: the payload is read as lines
    (b"\x02PROMPT x 100 0.7 0.9\nhello\n", [(ProtocolError, BR), UserLine("hello")]),
    (b"\x02PROMPT -5 100 0.7 0.9\nhello\n", [(ProtocolError, BR), UserLine("hello")]),
    (b"\x02PROMPT 5 100 0.7\nhello\n", [(ProtocolError, BR), UserLine("hello")]),
    (HEAD + b" 1 2\nhello\n", [(ProtocolError, BR), UserLine("hello")]),
    # empty and non-UTF-8 prompts
    (b"\x02PROMPT 0 100 0.7 0.9\n\n", [(ProtocolError, EP)]),
    (b"\x02PROMPT 2 100 0.7 0.9\n\xff\xfe\n\x02MORE\n", [(ProtocolError, BR), More()]),
    # framing: payload not followed by \n (CRLF included), byte counts that lie
    (b"\x02PROMPT 2 100 0.7 0.9\nhiX\n\x02RESET\n", [(ProtocolError, BF), Reset()]),
    (HEAD + b"\r\nhello\r\n\x02RESET\n", [(ProtocolError, BF), Reset()]),
    (b"\x02PROMPT 1 100 0.7 0.9\nhello\n\x02RESET\n", [(ProtocolError, BF), Reset()]),
    (b"\x02PROMPT 4 100 0.7 0.9\nhi\n\x02RESET\n\x02MORE\n", [(ProtocolError, BF), More()]),
    # EOF inside a frame
    (HEAD + b"\nhel", [(ProtocolError, BF)]),
    (HEAD + b"\nhello", [(ProtocolError, BF)]),
    (HEAD + b"\n", [(ProtocolError, BF)]),
    (HEAD, [(ProtocolError, BF)]),  # a header cut by EOF is not silently dropped
    (HEAD + b" 1", [(ProtocolError, BF)]),
    (b"\x02PROMPT 5 x 0.7 0.9", [(ProtocolError, BR), (ProtocolError, BF)]),
    (b"", []),
])
def test_inputs(blob, expected):
    for pieces in all_feeds(blob, [1, 8, 21, 22]):
        assert pe(read_inputs(pieces)) == [*expected, EndOfInput()]


def test_cancel_control_frame():
    """``\\x02CANCEL``, colibri's extension: stops the answer in progress."""
    assert pe(read_inputs([b"\x02CANCEL\r\n\x02CANCEL x\n"])) == [CancelAnswer(), (ProtocolError, BR),
                                                                  EndOfInput()]
    assert read_inputs([encode_input(CancelAnswer())]) == [CancelAnswer(), EndOfInput()]


def test_oversized_prompt_payload_is_skipped():
    """A byte count over MAX_PAYLOAD: rejected, and its payload skipped as the mux reader does
    (its lines must not become user messages)."""
    n = MAX_PAYLOAD + 1
    payload = b"tell me\n" * (n // 8) + b"x" * (n % 8)
    blob = f"\x02PROMPT {n} 100 0.7 0.9\n".encode() + payload + b"\n\x02RESET\n"
    for pieces in [[blob], chunks(blob, range(0, len(blob), 1 << 20))]:
        assert pe(read_inputs(pieces)) == [(ProtocolError, BR), Reset(), EndOfInput()]
    assert pe(read_inputs([blob[: 1 << 20]])) == [(ProtocolError, BR), EndOfInput()]  # EOF while skipping


def test_line_too_long():
    blob = b"a" * (MAX_LINE + 1) + b"\n\x02RESET\n"
    for pieces in [[blob], chunks(blob, [10, MAX_LINE, MAX_LINE + 1, MAX_LINE + 2])]:
        assert pe(read_inputs(pieces)) == [(ProtocolError, BF), Reset(), EndOfInput()]
    assert pe(read_inputs([b"a" * (MAX_LINE + 5)])) == [(ProtocolError, BF), EndOfInput()]


def test_longest_line_with_crlf_is_accepted_whatever_the_chunking():
    """MAX_LINE bytes plus a CR: the CR is not part of the message, in one piece or in two."""
    blob = b"a" * MAX_LINE + b"\r\n\x02RESET\n"
    for pieces in [[blob], chunks(blob, [MAX_LINE + 1])]:
        assert read_inputs(pieces) == [UserLine("a" * MAX_LINE), Reset(), EndOfInput()]


# ---------------------------------------------------------------- outputs, case by case

STAT = b"STAT 12 34.56 78.9 1.23 45 1\n"


@pytest.mark.parametrize(("blob", "expected"), [
    (b"Hello, " + b"world\n" + END_LINE + b"\n" + STAT,
     [Answer(b"Hello, world\n"), End(12, 34.56, 78.9, 1.23, 45, True)]),
    (ERROR_PREFIX + b"EMPTY_PROMPT" + SENTINEL + b"\n" + END_LINE + b"\nSTAT 0 0.00 0.0 0.00 0 0\n",
     [Failed(EP), End()]),
    (ERROR_PREFIX + b"NOPE" + SENTINEL + b"\n", [Failed(BR)]),  # an unknown code: still a failure
    (ERROR_PREFIX + b"\xff" + SENTINEL + b"\n", [Failed(BR)]),
    (ERROR_PREFIX + SENTINEL + b"\n", [Failed(BR)]),
    (ERROR_PREFIX + b"\n", []),  # not a sentinel line: dropped
    (END_LINE + b"\nnot a stat line\n", [End()]),
    (END_LINE + b"\n\n", [End()]),
    (b"caf\xc3\xa9 " + END_LINE + b"\n" + STAT + b"more",
     [Answer(b"caf\xc3\xa9 "), End(12, 34.56, 78.9, 1.23, 45, True), Answer(b"more")]),
    (b"\x01\x01WHAT\x01\x01\nafter", [Answer(b"after")]),  # an unknown sentinel line is dropped
    (b"text\x01\x01END", [Answer(b"text")]),  # a sentinel is held back until its line is complete
    (END_LINE + b"\nSTAT 1 2", []),  # ... and so is the STAT line
])
def test_outputs(blob, expected):
    for pieces in all_feeds(blob, [1, 5, 9, 20]):
        assert read_outputs(pieces) == expected


def test_output_byte_by_byte():
    evs = [Answer("Hello, wörld 😀\n".encode()), End(3, 12.345, 99.99, 1.5, 7, False),
           Failed(ErrorCode.CANCELLED), End(), Answer(b"next"), End(1, 1.0, 1.0, 1.0, 1, True)]
    blob = b"".join(map(encode_output, evs))
    reader = OutputReader()
    out = []
    for piece in bytewise(blob):
        out += reader.receive_data(piece)
    assert merged(out) == [as_encoded(e) for e in evs]
