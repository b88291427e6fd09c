"""A receive buffer for line-and-payload protocols: the framing both codecs share.

Lines end with ``\\n``; a byte-counted payload is followed by one ``\\n``. Limits bound the memory
a peer can make us hold: a line longer than the limit is an error, not an allocation.
"""

from __future__ import annotations


class ReceiveBuffer:
    def __init__(self) -> None:
        self._data = bytearray()
        self._scanned = 0  # bytes already searched for a newline: keeps line search linear
        # Resynchronisation, which may span chunks: bytes of a rejected payload still to discard,
        # and whether to drop everything through the next newline.
        self.pending_skip = 0
        self.dropping_line = False

    def discard(self, n: int) -> None:
        """Drop the next ``n`` bytes as they arrive (a payload we refused, with its newline)."""
        self.pending_skip = n

    def drop_through_newline(self) -> None:
        """Framing is lost: drop everything through the next newline, then read lines again."""
        self.dropping_line = True

    def resynced(self) -> bool:
        """Carry out pending discards; True once the buffer stands at the start of a line."""
        if self.pending_skip:
            self.pending_skip -= self.skip(self.pending_skip)
            if self.pending_skip:
                return False
        if self.dropping_line:
            if not self.skip_line():
                return False
            self.dropping_line = False
        return True

    def take_payload(self, n: int) -> tuple[bytes, bool] | None:
        """A byte-counted payload and whether its newline followed (if not, framing is lost and the
        buffer drops through the next newline); None until ``n + 1`` bytes are buffered."""
        if len(self._data) < n + 1:
            return None
        payload = self.take(n) or b""
        framed = self.take(1) == b"\n"
        if not framed:
            self.drop_through_newline()
        return payload, framed

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
