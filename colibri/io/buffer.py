"""The bytes a reader has received and not yet consumed: lines and exact byte counts taken off the
front, nothing else.

What the bytes mean (a header, a payload, resynchronisation after a broken frame) is the framing's
business (``framing.py``); this is the one place that copies and deletes bytes, so the cost of
reading stays linear in what arrives however it is chunked.
"""

from __future__ import annotations


class ReceiveBuffer:
    def __init__(self) -> None:
        self._data = bytearray()
        # Bytes already searched for a newline: a line arriving a byte at a time is scanned once,
        # not once per byte.
        self._scanned = 0

    def __len__(self) -> int:
        return len(self._data)

    def feed(self, data: bytes) -> None:
        self._data += data

    def take_line(self) -> bytes | None:
        """The next line without its ``\\n``, or None if no complete line is buffered."""
        i = self._data.find(b"\n", self._scanned)
        if i < 0:
            self._scanned = len(self._data)
            return None
        line = bytes(self._data[:i])
        del self._data[: i + 1]
        self._scanned = 0
        return line

    def take(self, n: int) -> bytes | None:
        """Exactly ``n`` bytes, or None if fewer are buffered."""
        if len(self._data) < n:
            return None
        out = bytes(self._data[:n])
        del self._data[:n]
        self._scanned = 0
        return out

    def skip(self, n: int) -> int:
        """Drop up to ``n`` bytes; returns how many were dropped."""
        n = min(n, len(self._data))
        del self._data[:n]
        self._scanned = 0
        return n

    def skip_line(self) -> bool:
        """Drop through the next ``\\n``; False (having dropped everything) if there is none yet."""
        i = self._data.find(b"\n")
        if i < 0:
            self._data.clear()
            self._scanned = 0
            return False
        del self._data[: i + 1]
        self._scanned = 0
        return True

    def find(self, byte: bytes) -> int:
        """Where ``byte`` first occurs in the buffered bytes, or -1 (no copy of the buffer made)."""
        return self._data.find(byte)
