"""Fuzz the legacy codec: LegacyReader (engine side) and OutputReader (``coli chat`` side).

Every input is fed to both readers whole, byte by byte, and in chunks whose sizes the input's first
bytes choose (as in fuzz_mux.py). ``check`` asserts:

- no exception escapes a reader;
- only documented events come out, with fields in range; ProtocolError codes are BAD_FRAME,
  BAD_REQUEST or EMPTY_PROMPT; answer text never holds ``\\x01``;
- the events are the same whatever the chunking (answer text compared joined); EndOfInput comes
  once, last; a second EOF and data after EOF give nothing;
- a decoded input re-encodes to itself (floats through ``:g``);
- resynchronisation: input + ``\\n\\x02RESET\\n`` ends with Reset unless the input holds a PROMPT
  header; input + ``\\n`` + END + STAT ends with that End unless the input holds ``END``.

Run: ``python fuzz/fuzz_legacy.py fuzz/out/legacy fuzz/corpus/legacy -dict=fuzz/legacy.dict`` (needs
atheris); ``check`` alone needs only colibri, for replaying a corpus (tests/test_fuzz_corpus.py).
"""

from __future__ import annotations

import math
import sys

from colibri.io import legacy
from colibri.io.events import EndOfInput, ErrorCode, ProtocolError
from colibri.io.legacy import (
    END_LINE,
    MAX_TOKENS_LIMIT,
    Answer,
    End,
    Failed,
    LegacyReader,
    OutputReader,
    RawPrompt,
    Reset,
    UserLine,
    encode_input,
)

READER_CODES = {ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.EMPTY_PROMPT}
RESYNC_INPUT = b"\n\x02RESET\n"
RESYNC_OUTPUT = b"\n" + END_LINE + b"\nSTAT 1 2.00 3.0 4.00 5 1\n"


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


def read_inputs(pieces: list[bytes]) -> list:
    reader = LegacyReader()
    out: list = []
    for piece in pieces:
        out += reader.receive_data(piece)
    out += reader.receive_data(b"")
    assert reader.receive_data(b"") == [], "a second EOF gave events"
    assert reader.receive_data(b"\x02RESET\n") == [], "data after EOF gave events"
    return out


def read_outputs(pieces: list[bytes]) -> list:
    reader = OutputReader()
    out: list = []
    for piece in pieces:
        for e in reader.receive_data(piece):
            if isinstance(e, Answer) and out and isinstance(out[-1], Answer):
                out[-1] = Answer(out[-1].text + e.text)  # chunk boundaries split text anywhere
            else:
                out.append(e)
    return out


def g(x: float) -> float:
    return float(f"{x:g}")


def check_inputs(events: list) -> None:
    assert events and isinstance(events[-1], EndOfInput), events
    for e in events[:-1]:
        assert isinstance(e, legacy.LegacyInput) and not isinstance(e, EndOfInput), e
        if isinstance(e, ProtocolError):
            assert e.code in READER_CODES, e
            continue
        if isinstance(e, RawPrompt):
            assert e.prompt and 0 <= e.max_tokens <= MAX_TOKENS_LIMIT and e.slot >= 0, e
            assert math.isfinite(e.temperature) and e.temperature >= 0 and 0 < e.top_p <= 1, e
            e = RawPrompt(e.prompt, e.max_tokens, g(e.temperature), g(e.top_p), e.slot)
        elif isinstance(e, UserLine):
            assert e.text.strip() and "\n" not in e.text and not e.text.startswith("\x02"), e
            if e.text.endswith("\r"):
                continue  # "a\r\r\n": the reader strips one CR, so "a\r" cannot be re-sent as is
        assert read_inputs([encode_input(e)]) == [e, EndOfInput()], e


def check_outputs(events: list) -> None:
    for e in events:
        if isinstance(e, Answer):
            assert e.text and b"\x01" not in e.text, e
        elif isinstance(e, Failed):
            assert isinstance(e.code, ErrorCode), e
        elif not isinstance(e, End):
            raise AssertionError(f"not an output event: {e!r}")


def check(data: bytes) -> None:
    whole, *others = feeds(data)

    events = read_inputs(whole)
    check_inputs(events)
    for pieces in others:
        assert read_inputs(pieces) == events, "input events depend on the chunking"
    if b"PROMPT" not in data:
        for pieces in feeds(data + RESYNC_INPUT)[:2]:
            assert read_inputs(pieces)[-2:] == [Reset(), EndOfInput()], "no resync after \\n"

    events = read_outputs(whole)
    check_outputs(events)
    for pieces in others:
        assert read_outputs(pieces) == events, "output events depend on the chunking"
    if b"END" not in data:
        for pieces in feeds(data + RESYNC_OUTPUT)[:2]:
            assert read_outputs(pieces)[-1:] == [End(1, 2.0, 3.0, 4.0, 5, True)], "no resync after \\n"


if __name__ == "__main__":
    import atheris

    atheris.instrument_all()  # colibri.io is imported already: instrument what is loaded
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
