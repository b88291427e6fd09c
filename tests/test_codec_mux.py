"""Round trips of the mux codec (colibri/io/mux.py, docs/serve_protocol.md), and the helpers and
strategies its other test files share.

Every request ``encode_request`` writes, ``RequestReader`` reads back unchanged, and every response
``encode_response`` writes, ``ResponseReader`` reads back at the encoder's precision, under every
chunking of the byte stream. Arbitrary input: tests/test_codec_mux_arbitrary.py; each rejection,
case by case: tests/test_codec_mux_errors.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    Gpu,
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
)
from colibri.io.mux import (
    MAX_ID,
    MAX_TOKENS_LIMIT,
    RequestReader,
    ResponseReader,
    encode_request,
    encode_response,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BR, BF = ErrorCode.BAD_REQUEST, ErrorCode.BAD_FRAME


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
    grammar=st.none() | st.text(min_size=1),
    speculative=st.none() | st.just(False),
)
cancels = st.builds(Cancel, id=ids)
stops = st.builds(Stop, id=ids)
requests = st.one_of(submits, cancels, stops)

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
              prompt_tokens=nonneg, length_limited=st.booleans(), saved=st.sampled_from([None, False, True])),
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
    st.builds(Accept, id=ids, prompt_tokens=nonneg),
    st.builds(Prof, wall=finite, prompt_tokens=nonneg, completion_tokens=nonneg, t_edisk=finite,
              t_ewait=finite, t_emm=finite, t_attn=finite, t_head=finite, forwards=nonneg),
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
                        rounded(ev.rss_gb, 2), ev.prompt_tokens, ev.length_limited, ev.saved)
        case HwInfo():
            return HwInfo(ev.cores, rounded(ev.ram_total_gb, 1), rounded(ev.ram_avail_gb, 1), ev.ngpu,
                          rounded(ev.vram_total_gb, 1), ev.cpu_name, ev.gpu_name)
        case Tiers():
            return Tiers(ev.vram_experts, ev.ram_experts, ev.disk_experts, rounded(ev.vram_gb, 2),
                         rounded(ev.ram_gb, 2))
        case Perf():
            times = [rounded(t, 4) for t in (ev.dt, ev.t_edisk, ev.t_ewait, ev.t_emm, ev.t_attn, ev.t_kvb,
                                             ev.t_head)]
            return Perf(ev.id, *times, ev.reused_tokens, ev.prefilled_tokens, ev.drafted_tokens,
                        ev.accepted_tokens)
        case Prof():
            t = [rounded(x, 4) for x in (ev.wall, ev.t_edisk, ev.t_ewait, ev.t_emm, ev.t_attn, ev.t_head)]
            return Prof(t[0], ev.prompt_tokens, ev.completion_tokens, *t[1:], ev.forwards)
        case Entropy():
            return Entropy(tuple(rounded(b, 3) for b in ev.bits))
        case Gpus():
            return Gpus(tuple(Gpu(rounded(x.used_gb, 2), rounded(x.total_gb, 2), x.experts) for x in ev.gpus))
    return ev


cut_lists = st.lists(st.integers(0, 1 << 16), max_size=12)


# ---------------------------------------------------------------- request round trips


@SETTINGS
@given(reqs=st.lists(requests, max_size=6), cuts=cut_lists)
def test_requests_round_trip_any_chunking(reqs, cuts):
    blob = b"".join(map(encode_request, reqs))
    expected = [as_sent(r) for r in reqs] + [EndOfInput()]
    for pieces in all_feeds(blob, cuts):
        assert read_requests(pieces) == expected


def test_floats_round_trip_exactly():
    """The sampler gets the temperature and top_p the server asked for, to the last bit (``:g``
    would keep 6 significant digits)."""
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
        Submit(6, 0, 1, 0.7, 0.9, "x", grammar='root ::= "a\\n" | "é"\n'),
        Submit(7, 0, 1, 0.7, 0.9, "x", seed=3, grammar="start: %json {}"),
        Submit(8, 0, 1, 0.7, 0.9, "", prompt_ids=(1, 2), grammar="g"),
    ]:
        assert read_requests([encode_request(req)]) == [as_sent(req), EndOfInput()]


def test_pipelined_requests_in_one_chunk():
    reqs = [Submit(1, 0, 16, 0.7, 0.9, "a\nb"), Cancel(1), Submit(2, 1, 0, 0.0, 1.0, "\x00"), Cancel(2)]
    assert read_requests([b"".join(map(encode_request, reqs))]) == [*reqs, EndOfInput()]


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
    Done(4, 10, 12.34, 56.7, 1.23, 42, True, False),
    Done(4, 10, 12.34, 56.7, 1.23, 42, False, True),
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
    Perf(8, 1.5, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 100, 23, 40, 31),
    Entropy((1.5, 2.25, 0.0)),
    Entropy(()),
    Gpus((Gpu(10.5, 80.0, 64), Gpu(0.0, 24.0, 0))),
    Gpus(()),
])
def test_each_response_kind_round_trips(event):
    blob = encode_response(event)
    for pieces in all_feeds(blob, [3, 7]):
        assert read_responses(pieces) == [as_encoded(event)]


# ---------------------------------------------------------------- SUBMIT_IDS


@SETTINGS
@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=50), st.integers(1, 1 << 40))
def test_submit_ids_round_trip(ids, rid):
    sub = Submit(rid, 0, 16, 0.0, 1.0, "", None, tuple(ids))
    blob = encode_request(sub)
    assert blob.startswith(b"SUBMIT_IDS ")
    assert read_requests([blob]) == [sub, EndOfInput()]


@pytest.mark.parametrize("payload", [b"", b"1,,2", b"1,a", b" 1", b"-1", b"1," + b"9" * 30])
def test_submit_ids_payload_must_be_ids(payload):
    blob = f"SUBMIT_IDS 4 0 {len(payload)} 16 0.7 0.9\n".encode() + payload + b"\nCANCEL 9\n"
    events = read_requests([blob])
    assert [type(e) for e in events] == [ProtocolError, Cancel, EndOfInput]
    assert events[0].id == 4 and events[0].code == ErrorCode.BAD_REQUEST


def test_prof_counts_are_exact_and_an_infinite_count_is_a_bad_frame():
    """Found by hypothesis: PROF's counts went through float and lost 1 past 2**53; and a count
    of ``inf`` raised OverflowError out of the reader instead of a BAD_FRAME."""
    big = 2**53 + 1
    [prof] = ResponseReader().receive_data(f"PROF 0.5 {big} 2 0 0 0 0 0 {big}\n".encode())
    assert (prof.prompt_tokens, prof.forwards) == (big, big)
    [bad] = ResponseReader().receive_data(b"PROF 0.5 inf 2 0 0 0 0 0 3\n")
    assert isinstance(bad, ProtocolError) and bad.code == ErrorCode.BAD_FRAME
