"""Fuzz the mux codec: RequestReader (engine side) and ResponseReader (server side).

Every input is fed to both readers three ways: whole, byte by byte, and in chunks whose sizes the
input's first bytes choose (``data[0] & 7`` sizes, from ``data[1:]``, ``(b & 31) + 1`` bytes each,
cycled; the bytes stay part of the stream). ``check`` asserts:

- no exception escapes a reader;
- only documented events come out, with fields in range; ProtocolError codes are BAD_FRAME,
  BAD_REQUEST or EMPTY_PROMPT (only BAD_FRAME from ResponseReader);
- the events are the same whatever the chunking; EndOfInput comes once, last; a second EOF and data
  after EOF give nothing;
- a decoded request re-encodes to itself, exactly; a decoded response re-encodes and
  decodes to one event of its type that encodes the same;
- resynchronisation: input + ``\\n`` + ``CANCEL 7\\n`` ends with Cancel(7) unless the input holds a
  SUBMIT header (whose payload may swallow it); input + ``\\n`` + a REPIN line ends with that Repin
  unless the input holds a DATA header.

Run: ``python fuzz/fuzz_mux.py fuzz/out/mux fuzz/corpus/mux -dict=fuzz/mux.dict`` (needs atheris);
``check`` alone needs only colibri, for replaying a corpus (tests/test_fuzz_corpus.py).
"""

from __future__ import annotations

import math
import sys

from colibri.io.events import (
    Cancel,
    Data,
    Done,
    EndOfInput,
    Entropy,
    Error,
    ErrorCode,
    ExpertMap,
    Forget,
    Gpus,
    Hits,
    HwInfo,
    Perf,
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
    MAX_TOKENS_LIMIT,
    RequestReader,
    ResponseReader,
    encode_request,
    encode_response,
)

READER_CODES = {ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.EMPTY_PROMPT}
RESPONSES = (Ready, Stat, Data, TopK, Done, Error, HwInfo, Tiers, ExpertMap, Hits, Repin, Perf, Entropy, Gpus)
RESYNC_REQUEST = b"\nCANCEL 7\n"
RESYNC_RESPONSE = b"\nREPIN 1 2 3 4\n"


def feeds(data: bytes) -> list[list[bytes]]:
    """The chunkings every input is read in: whole, byte by byte, and as the input's head chooses."""
    whole = [data] if data else []
    bytewise = [data[i : i + 1] for i in range(len(data))]
    sizes = [(b & 31) + 1 for b in data[1 : 1 + (data[0] & 7)]] if data else []
    planned, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)] if sizes else len(data)
        planned.append(data[i : i + n])
        i, k = i + n, k + 1
    return [whole, bytewise, planned]


def read_requests(pieces: list[bytes]) -> list:
    reader = RequestReader()
    out: list = []
    for piece in pieces:
        out += reader.receive_data(piece)
    out += reader.receive_data(b"")
    assert reader.receive_data(b"") == [], "a second EOF gave events"
    assert reader.receive_data(b"CANCEL 1\n") == [], "data after EOF gave events"
    return out


def read_responses(pieces: list[bytes]) -> list:
    reader = ResponseReader()
    out: list = []
    for piece in pieces:
        out += reader.receive_data(piece)
    return out


def check_requests(events: list) -> None:
    assert events and isinstance(events[-1], EndOfInput), events
    for e in events[:-1]:
        if isinstance(e, Submit):
            assert 1 <= e.id <= MAX_ID and 0 <= e.slot <= 255 and 0 <= e.max_tokens <= MAX_TOKENS_LIMIT, e
            assert math.isfinite(e.temperature) and e.temperature >= 0 and 0 < e.top_p <= 1, e
            assert isinstance(e.prompt, str) and (e.seed is None or 0 <= e.seed <= MAX_ID), e
            assert read_requests([encode_request(e)]) == [e, EndOfInput()], e
        elif isinstance(e, Cancel | Stop):
            assert 1 <= e.id <= MAX_ID, e
            assert read_requests([encode_request(e)]) == [e, EndOfInput()], e
        elif isinstance(e, Forget):
            assert 0 <= e.slot <= 255, e
            assert read_requests([encode_request(e)]) == [e, EndOfInput()], e
        elif isinstance(e, ProtocolError):
            assert e.code in READER_CODES and 0 <= e.id <= MAX_ID, e
        else:
            raise AssertionError(f"not a request event: {e!r}")


def check_responses(events: list) -> None:
    for e in events:
        if isinstance(e, ProtocolError):
            assert e.code == ErrorCode.BAD_FRAME, e
        elif isinstance(e, UnknownLine):
            assert b"\n" not in e.line, e
        elif isinstance(e, RESPONSES):
            once = encode_response(e)
            again = read_responses([once])
            assert len(again) == 1 and type(again[0]) is type(e), (e, again)
            assert encode_response(again[0]) == once, (e, again)
        else:
            raise AssertionError(f"not a response event: {e!r}")


def check(data: bytes) -> None:
    whole, *others = feeds(data)

    events = read_requests(whole)
    check_requests(events)
    for pieces in others:
        assert read_requests(pieces) == events, "request events depend on the chunking"
    if b"SUBMIT" not in data:
        for pieces in feeds(data + RESYNC_REQUEST)[:2]:
            assert read_requests(pieces)[-2:] == [Cancel(7), EndOfInput()], "no resync after \\n"

    events = read_responses(whole)
    check_responses(events)
    for pieces in others:
        assert read_responses(pieces) == events, "response events depend on the chunking"
    if b"DATA" not in data:
        for pieces in feeds(data + RESYNC_RESPONSE)[:2]:
            assert read_responses(pieces)[-1:] == [Repin(1, 2, 3, 4)], "no resync after \\n"


if __name__ == "__main__":
    import atheris

    atheris.instrument_all()  # colibri.io is imported already: instrument what is loaded
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
