"""A receive buffer for line-and-payload protocols: the framing both codecs share.

Lines end with ``\\n``; a byte-counted payload is followed by one ``\\n``. Limits bound the memory
a peer can make us hold: a line longer than the limit is an error, not an allocation.
"""

from __future__ import annotations


class ReceiveBuffer:
    def __init__(self) -> None:
        self._data = bytearray()
        self._scanned = 0  # bytes already searched for a newline: keeps line search linear

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

    def peek(self, n: int) -> bytes:
        return bytes(self._data[:n])
