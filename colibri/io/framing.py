"""Line-and-payload framing, the part of the mux and legacy protocols that says where a frame ends.

Both protocols are lines, except that a header line may announce a byte count: that many bytes of
payload follow (newlines included), then one ``\\n``. ``FrameReader`` turns received bytes into
items, whatever the chunking:

- ``Line(data)``: a complete line without its ``\\n``;
- ``Payload(header, data)``: the bytes a header announced, their ``\\n`` checked;
- ``Unframed(header)``: the byte after the payload was not ``\\n``: the count lied, so where the next
  frame starts is unknown, and the reader drops everything through the next ``\\n`` (a later call
  if it has not arrived yet) before reading lines again;
- ``Overlong()``: a line longer than ``max_line``, dropped through its ``\\n`` (as it arrives: a peer
  cannot make the reader hold more than ``max_line`` bytes of one line).

A codec reads a ``Line``, and if it is a header, says what follows: ``expect_payload(n, header)``
(``header`` is any value the codec wants back with the payload) or ``skip_payload(n)`` (a count it
refuses, over its limit: the bytes are dropped as they arrive, never buffered). At end of input,
``close()`` says what the input cut short. The framing knows nothing of verbs or fields: each codec
only interprets lines and payloads, and this module alone decides where frames start, which is what
the fuzzers in ``fuzz/`` hammer on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from colibri.io.buffer import ReceiveBuffer

H = TypeVar("H")  # what a codec keeps of a header until its payload arrives


@dataclass(frozen=True, slots=True)
class Line:
    """A complete line without its ``\\n``, at most ``max_line`` bytes."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Payload(Generic[H]):
    """The ``n`` bytes announced by ``expect_payload(n, header)``, followed by their ``\\n``."""

    header: H
    data: bytes


@dataclass(frozen=True, slots=True)
class Unframed(Generic[H]):
    """The payload announced with ``header`` was not followed by ``\\n``: framing is lost."""

    header: H


@dataclass(frozen=True, slots=True)
class Overlong:
    """A line over ``max_line`` bytes: not buffered, dropped through its ``\\n``."""


@dataclass(frozen=True, slots=True)
class Truncated(Generic[H]):
    """End of input inside (or right before) the payload announced with ``header``."""

    header: H


@dataclass(frozen=True, slots=True)
class Unterminated:
    """End of input inside a line: the bytes after the last ``\\n``."""

    data: bytes


Item = Line | Payload[H] | Unframed[H] | Overlong


class FrameReader(Generic[H]):
    """Received bytes -> ``Item``s, one at a time; resynchronisation may span any number of calls."""

    def __init__(self, max_line: int) -> None:
        self._buf = ReceiveBuffer()
        self._max_line = max_line
        self._expected: tuple[int, H] | None = None  # (byte count, header) of the payload awaited
        # Resynchronisation: bytes of a refused payload (with its \n) still to drop as they arrive,
        # and whether to drop everything through the next \n.
        self._skip = 0
        self._dropping_line = False

    def feed(self, data: bytes) -> None:
        self._buf.feed(data)

    def expect_payload(self, n: int, header: H) -> None:
        """The line just read announced ``n`` bytes: the next item is their Payload or Unframed."""
        self._expected = (n, header)

    def skip_payload(self, n: int) -> None:
        """The line just read announced ``n`` bytes the codec refuses: drop them and their ``\\n``
        unread (a lying count is not checked: nothing can tell where a refused payload ends)."""
        self._skip = n + 1

    def next_item(self) -> Item[H] | None:
        """The next complete item, or None until more bytes arrive."""
        if not self._resynced():
            return None
        if self._expected is not None:
            n, header = self._expected
            if len(self._buf) < n + 1:
                return None
            self._expected = None
            data = self._buf.take(n) or b""
            if self._buf.take(1) != b"\n":
                self._dropping_line = True
                return Unframed(header)
            return Payload(header, data)
        line = self._buf.take_line()
        if line is None:
            if len(self._buf) > self._max_line:
                self._dropping_line = True
                return Overlong()
            return None
        if len(line) > self._max_line:  # it arrived whole, in one piece with its \n
            return Overlong()
        return Line(line)

    def close(self) -> Truncated[H] | Unterminated | None:
        """End of input: what it cut short, if anything, and the reader is left empty. Call it
        again after interpreting an ``Unterminated`` line: that line may have been a header."""
        if self._expected is not None:
            header = self._expected[1]
            self._expected = None
            self._buf.skip(len(self._buf))
            return Truncated(header)
        if self._skip or self._dropping_line or not len(self._buf):
            return None  # bytes being dropped are no line
        return Unterminated(self._buf.take(len(self._buf)) or b"")

    def _resynced(self) -> bool:
        """Carry out pending drops; True once the buffer stands at the start of a frame."""
        if self._skip:
            self._skip -= self._buf.skip(self._skip)
            if self._skip:
                return False
        if self._dropping_line:
            if not self._buf.skip_line():
                return False
            self._dropping_line = False
        return True
