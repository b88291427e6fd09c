"""Property and edge-case tests of the mux codec (colibri/io/mux.py, docs/serve_protocol.md).

Round trips through ``encode_request``/``RequestReader`` and ``encode_response``/``ResponseReader``
under every chunking of the byte stream; arbitrary and half-valid input never raises, yields only
documented events, decodes the same whatever the chunking, and resynchronises on the next line; and
each rejection carries the exact code and id.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colibri.io.events import (
    Cancel,
    Data,
    Done,
    EndOfInput,
    Entropy,
    Error,
    ErrorCode,
    ExpertMap,
    Gpu,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    ProtocolError,
    Ready,
    Repin,
    Stat,
    Submit,
    Tiers,
    TopK,
    UnknownLine,
)
from colibri.io.mux import (
    MAX_ID,
    MAX_LINE,
    MAX_PAYLOAD,
    MAX_TOKENS_LIMIT,
    READY_LINE,
    RequestReader,
    ResponseReader,
    encode_request,
    encode_response,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BR, BF = ErrorCode.BAD_REQUEST, ErrorCode.BAD_FRAME
READER_CODES = {ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.EMPTY_PROMPT}
REQUEST_EVENTS = (Submit, Cancel, ProtocolError, EndOfInput)
RESPONSE_EVENTS = (Ready, Stat, Data, TopK, Done, Error, HwInfo, Tiers, ExpertMap, Hits, Repin, Perf,
                   Entropy, Gpus, ProtocolError, UnknownLine)


# ---------------------------------------------------------------- feeding helpers


def chunks(blob: bytes, cuts) -> list[bytes]:
    """``blob`` cut at ``cuts`` (positions, any order, duplicates ignored), no empty pieces."""
    points = sorted({c for c in cuts if 0 < c < len(blob)})
    bounds = [0, *points, len(blob)]
    return [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def bytewise(blob: bytes) -> list[bytes]:
    return [blob[i : i + 1] for i in range(len(blob))]


def read_requests(pieces, eof: bool = True) -> list:
    reader = RequestReader()
    out = []
    for piece in pieces:
        assert piece, "an empty chunk means EOF"
        out += reader.receive_data(piece)
    if eof:
        out += reader.receive_data(b"")
        assert reader.receive_data(b"") == []  # a second EOF: nothing
        assert reader.receive_data(b"CANCEL 1\n") == []  # data after EOF: ignored
    return out


def read_responses(pieces) -> list:
    reader = ResponseReader()
    out = []
    for piece in pieces:
        out += reader.receive_data(piece)
    return out


def all_feeds(blob: bytes, cuts):
    """The ways every property is checked: whole, byte by byte, at hypothesis' cut points."""
    return [[blob] if blob else [], bytewise(blob), chunks(blob, cuts)]


def as_sent(ev):
    """A request as it comes back: unchanged (``encode_request`` writes floats with ``repr``)."""
    return ev


def pe(events) -> list[tuple]:
    """Events reduced to what the error tests pin down: (type, id, code) or the event itself."""
    return [(ProtocolError, e.id, e.code) if isinstance(e, ProtocolError) else e for e in events]


# ---------------------------------------------------------------- strategies

ids = st.integers(1, MAX_ID)
prompts = st.one_of(
    st.text(),
    st.text(alphabet=st.sampled_from("\n\x00\r \x01\x02SUBMITCANCEL0123456789é中😀")),
)
submits = st.builds(
    Submit,
    id=ids,
    slot=st.integers(0, 255),
    max_tokens=st.integers(0, MAX_TOKENS_LIMIT),
    temperature=st.floats(min_value=0, allow_nan=False, allow_infinity=False),
    top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
    prompt=prompts,
    seed=st.none() | st.integers(0, MAX_ID),
)
cancels = st.builds(Cancel, id=ids)
requests = st.one_of(submits, cancels)

finite = st.floats(allow_nan=False, allow_infinity=False)
nonneg = st.integers(0, 2**63)
ascii_ish = st.characters(codec="utf-8", exclude_characters="\n")
responses = st.one_of(
    st.just(Ready()),
    st.builds(Stat, rss_gb=finite),
    st.builds(Data, id=ids, text=st.binary() | st.sampled_from([b"\n", b"\n\n", b"a\nb", b"\x00", b""])),
    st.builds(TopK, id=ids,
              candidates=st.lists(st.tuples(finite, st.binary(max_size=8)), max_size=6).map(tuple)),
    st.builds(Done, id=ids, emitted=nonneg, tok_s=finite, hit_pct=finite, rss_gb=finite,
              prompt_tokens=nonneg, length_limited=st.booleans()),
    st.builds(Error, id=ids, code=st.sampled_from(list(ErrorCode)).filter(
        lambda c: c != ErrorCode.CONTEXT_EXCEEDED)),
    st.builds(Error, id=ids, code=st.just(ErrorCode.CONTEXT_EXCEEDED), args=st.tuples(nonneg, nonneg)),
    st.builds(HwInfo, cores=nonneg, ram_total_gb=finite, ram_avail_gb=finite, ngpu=nonneg,
              vram_total_gb=finite,
              cpu_name=st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\n|")),
              gpu_name=st.text(alphabet=ascii_ish)),
    st.builds(Tiers, vram_experts=nonneg, ram_experts=nonneg, disk_experts=nonneg, vram_gb=finite,
              ram_gb=finite),
    st.builds(ExpertMap, rows=nonneg, cols=nonneg, data=st.binary(max_size=64)),
    st.builds(Hits, rows=nonneg, cols=nonneg, data=st.binary(max_size=64)),
    st.builds(Repin, layer=nonneg, expert=nonneg, old_tier=st.integers(0, 2), gpu=nonneg),
    st.builds(Perf, id=ids, dt=finite, t_edisk=finite, t_ewait=finite, t_emm=finite, t_attn=finite,
              t_kvb=finite, t_head=finite, reused_tokens=nonneg, prefilled_tokens=nonneg),
    st.builds(Entropy, bits=st.lists(finite, max_size=8).map(tuple)),
    st.builds(Gpus, gpus=st.lists(st.builds(Gpu, used_gb=finite, total_gb=finite, experts=nonneg),
                                  max_size=4).map(tuple)),
)


def rounded(x: float, digits: int) -> float:
    return float(f"{x:.{digits}f}")


def as_encoded(ev):
    """A response as it comes back: floats at the encoder's precision."""
    match ev:
        case Stat():
            return Stat(rounded(ev.rss_gb, 2))
        case TopK():
            return TopK(ev.id, tuple((rounded(lp, 4), t) for lp, t in ev.candidates))
        case Done():
            return Done(ev.id, ev.emitted, rounded(ev.tok_s, 2), rounded(ev.hit_pct, 1),
                        rounded(ev.rss_gb, 2), ev.prompt_tokens, ev.length_limited)
        case HwInfo():
            return HwInfo(ev.cores, rounded(ev.ram_total_gb, 1), rounded(ev.ram_avail_gb, 1), ev.ngpu,
                          rounded(ev.vram_total_gb, 1), ev.cpu_name, ev.gpu_name)
        case Tiers():
            return Tiers(ev.vram_experts, ev.ram_experts, ev.disk_experts, rounded(ev.vram_gb, 2),
                         rounded(ev.ram_gb, 2))
        case Perf():
            times = [rounded(t, 4) for t in (ev.dt, ev.t_edisk, ev.t_ewait, ev.t_emm, ev.t_attn, ev.t_kvb,
                                             ev.t_head)]
            return Perf(ev.id, *times, ev.reused_tokens, ev.prefilled_tokens)
        case Entropy():
            return Entropy(tuple(rounded(b, 3) for b in ev.bits))
        case Gpus():
            return Gpus(tuple(Gpu(rounded(x.used_gb, 2), rounded(x.total_gb, 2), x.experts) for x in ev.gpus))
    return ev


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
cut_lists = st.lists(st.integers(0, 1 << 16), max_size=12)


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


# ---------------------------------------------------------------- request round trips


@SETTINGS
@given(reqs=st.lists(requests, max_size=6), cuts=cut_lists)
def test_requests_round_trip_any_chunking(reqs, cuts):
    blob = b"".join(map(encode_request, reqs))
    expected = [as_sent(r) for r in reqs] + [EndOfInput()]
    for pieces in all_feeds(blob, cuts):
        assert read_requests(pieces) == expected


def test_floats_round_trip_exactly():
    """The sampler gets the temperature and top_p the server asked for, to the last bit (they were
    written with ``:g``, 6 significant digits, before the seed field came)."""
    sent = Submit(1, 0, 16, 0.123456789, 1 / 3, "hi", seed=7)
    assert read_requests([encode_request(sent)]) == [sent, EndOfInput()]


def test_submit_limits_round_trip():
    for req in [
        Submit(MAX_ID, 255, MAX_TOKENS_LIMIT, 0.0, 1.0, "x"),
        Submit(1, 0, 0, 1e300, 5e-324, "\x00"),
        Submit(2, 1, 1, -0.0, 1.0, "line one\nline two\n"),
        Submit(3, 0, 1, 0.7, 0.9, ""),  # the reader accepts it; the core answers EMPTY_PROMPT
        Submit(4, 0, 1, 0.7, 0.9, "x", seed=0),
        Submit(5, 0, 1, 0.7, 0.9, "x", seed=MAX_ID),
    ]:
        assert read_requests([encode_request(req)]) == [as_sent(req), EndOfInput()]


# ---------------------------------------------------------------- response round trips


@SETTINGS
@given(resps=st.lists(responses, max_size=8), cuts=cut_lists)
def test_responses_round_trip_any_chunking(resps, cuts):
    blob = b"".join(map(encode_response, resps))
    expected = [as_encoded(r) for r in resps]
    for pieces in all_feeds(blob, cuts):
        assert read_responses(pieces) == expected


@pytest.mark.parametrize("event", [
    Ready(),
    Stat(1.25),
    Data(1, b"hello\nworld\n"),
    Data(2, b""),
    TopK(3, ((-0.1234, b"a"), (-1.5, b""), (-2.0, b"\n"), (-3.0, b" "), (-4.0, b"\xff"))),
    Done(4, 10, 12.34, 56.7, 1.23, 42, True),
    Error(5, ErrorCode.CANCELLED),
    Error(6, ErrorCode.CONTEXT_EXCEEDED, (5000, 4096)),
    HwInfo(16, 62.5, 40.1, 1, 80.0, "AMD EPYC 7763 64-Core Processor", "NVIDIA H100 | 80GB"),
    HwInfo(1, 0.0, 0.0, 0, 0.0, "", ""),
    Tiers(10, 20, 30, 1.5, 2.5),
    ExpertMap(2, 3, bytes([0, 64, 128, 191, 255, 1])),
    Hits(2, 8, b"\x01\x80"),
    ExpertMap(0, 0, b""),
    Repin(3, 17, 1, 0),
    Perf(7, 1.5, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 100, 23),
    Entropy((1.5, 2.25, 0.0)),
    Entropy(()),
    Gpus((Gpu(10.5, 80.0, 64), Gpu(0.0, 24.0, 0))),
    Gpus(()),
])
def test_each_response_kind_round_trips(event):
    blob = encode_response(event)
    for pieces in all_feeds(blob, [3, 7]):
        assert read_responses(pieces) == [as_encoded(event)]


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
    (b"SUBMIT 1 0 2 16 0.7 0.9 1 2\nhi\n", [(ProtocolError, 0, BR), (ProtocolError, 0, BR)]),
    # the optional seed (a seventh field): unsigned, u64
    (b"SUBMIT 5 0 2 16 0.7 0.9 42\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", 42)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 0\nhi\n", [Submit(5, 0, 16, 0.7, 0.9, "hi", 0)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 x\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 \nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 -1\nhi\n", [(ProtocolError, 5, BR)]),
    (b"SUBMIT 5 0 2 16 0.7 0.9 18446744073709551616\nhi\n", [(ProtocolError, 5, BR)]),
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
    blob = f"SUBMIT 5 0 {MAX_ID} 16 0.7 0.9\n".encode() + b"x" * 1000
    assert pe(read_requests([blob])) == [(ProtocolError, 5, BR), EndOfInput()]


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


def test_pipelined_requests_in_one_chunk():
    reqs = [Submit(1, 0, 16, 0.7, 0.9, "a\nb"), Cancel(1), Submit(2, 1, 0, 0.0, 1.0, "\x00"), Cancel(2)]
    assert read_requests([b"".join(map(encode_request, reqs))]) == [*reqs, EndOfInput()]


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
    (b"PERF 1\n", [(ProtocolError, 0, BF)]),  # no timings at all: used to raise TypeError
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
