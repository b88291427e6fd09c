"""The framing both line protocols share (colibri/io/framing.py), on its own: byte-counted payloads,
lines over the limit, resynchronisation after a payload whose count lied, and end of input.

A toy codec drives it: ``P <n>`` announces an n-byte payload, ``S <n>`` one to skip, any other line
is a line. The mux and legacy codecs are this plus the meaning of their verbs and fields.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.io.framing import (
    FrameReader,
    Line,
    Overlong,
    Payload,
    Truncated,
    Unframed,
    Unterminated,
)

MAX = 16  # the toy codec's line limit
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def drive(reader: FrameReader[int], data: bytes) -> list:
    """Feed one chunk and interpret every item it completes, as a codec does."""
    reader.feed(data)
    out = []
    while (item := reader.next_item()) is not None:
        out.append(item)
        if isinstance(item, Line) and item.data[:2] in (b"P ", b"S ") and item.data[2:].isdigit():
            n = int(item.data[2:])
            if item.data[:1] == b"P":
                reader.expect_payload(n, n)
            else:
                reader.skip_payload(n)
    return out


def read(pieces: list[bytes]) -> list:
    reader: FrameReader[int] = FrameReader(MAX)
    out = []
    for piece in pieces:
        out += drive(reader, piece)
    return [*out, reader.close()]


def cut(blob: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(blob)}), len(blob)]
    return [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def feeds(blob: bytes, cuts: list[int]) -> list[list[bytes]]:
    return [[blob], [blob[i : i + 1] for i in range(len(blob))], cut(blob, cuts)]


payloads = st.binary(max_size=40)
frames = st.one_of(
    payloads.map(lambda p: b"P %d\n" % len(p) + p + b"\n"),
    payloads.map(lambda p: b"S %d\n" % len(p) + p + b"\n"),
    st.binary(max_size=MAX).filter(lambda b: b"\n" not in b).map(lambda b: b + b"\n"),
)
fragments = st.sampled_from([b"P ", b"S ", b"0", b"3", b"17", b"\n", b"x" * (MAX + 1), b"\r"])
streams = st.lists(st.one_of(frames, fragments, st.binary(max_size=8)), max_size=12).map(b"".join)
cut_lists = st.lists(st.integers(0, 1 << 10), max_size=8)


@SETTINGS
@given(blob=streams, cuts=cut_lists)
def test_items_do_not_depend_on_the_chunking(blob, cuts):
    whole, *others = feeds(blob, cuts)
    expected = read(whole)
    for pieces in others:
        assert read(pieces) == expected


@SETTINGS
@given(bodies=st.lists(payloads, max_size=6), cuts=cut_lists)
def test_payloads_come_back_exactly(bodies, cuts):
    blob = b"".join(b"P %d\n" % len(p) + p + b"\n" for p in bodies)
    expected = []
    for p in bodies:
        expected += [Line(b"P %d" % len(p)), Payload(len(p), p)]
    for pieces in feeds(blob, cuts):
        assert read(pieces) == [*expected, None]


@SETTINGS
@given(blob=streams, cuts=cut_lists)
def test_lines_are_bounded_and_payloads_exact(blob, cuts):
    for item in read(cut(blob, cuts))[:-1]:
        if isinstance(item, Line):
            assert len(item.data) <= MAX and b"\n" not in item.data
        elif isinstance(item, Payload):
            assert len(item.data) == item.header


def test_a_payload_without_its_newline_loses_the_frame_until_the_next_line():
    blob = b"P 2\nhiXYZ\nnext\n"
    for pieces in feeds(blob, [5, 7, 9]):
        assert read(pieces) == [Line(b"P 2"), Unframed(2), Line(b"next"), None]


def test_a_skipped_payload_is_dropped_unread_even_if_its_count_lied():
    # "S 2" then "abc": three bytes are dropped ("ab" and the byte where its newline should be)
    assert read([b"S 2\nabc\nnext\n"]) == [Line(b"S 2"), Line(b""), Line(b"next"), None]
    for pieces in feeds(b"S 40\n" + b"\n" * 41 + b"next\n", [6, 20, 46]):
        assert read(pieces) == [Line(b"S 40"), Line(b"next"), None]


def test_an_overlong_line_is_one_item_whenever_its_newline_comes():
    for blob in [b"x" * (MAX + 1) + b"\nnext\n", b"x" * 100 + b"\nnext\n"]:
        for pieces in feeds(blob, [MAX, MAX + 1, MAX + 2, 50]):
            assert read(pieces) == [Overlong(), Line(b"next"), None]
    assert read([b"x" * MAX + b"\n"]) == [Line(b"x" * MAX), None]


def test_close_says_what_the_end_of_input_cut_short():
    assert read([b"P 5\nabc"]) == [Line(b"P 5"), Truncated(5)]
    assert read([b"P 2\nab"]) == [Line(b"P 2"), Truncated(2)]  # the newline is part of the frame
    assert read([b"line\npart"]) == [Line(b"line"), Unterminated(b"part")]
    assert read([b"S 9\nabc"]) == [Line(b"S 9"), None]  # bytes being skipped are no line
    assert read([b"P 1\nab"]) == [Line(b"P 1"), Unframed(1), None]  # ... nor bytes being dropped
    assert read([b""]) == [None]


def test_close_twice_reads_a_header_cut_by_the_end_of_input():
    """The legacy reader's case: the last line, unterminated, is a header whose payload is missing."""
    reader: FrameReader[int] = FrameReader(MAX)
    reader.feed(b"P 4")
    assert reader.next_item() is None
    assert reader.close() == Unterminated(b"P 4")
    reader.expect_payload(4, 4)
    assert reader.close() == Truncated(4)
    assert reader.close() is None
