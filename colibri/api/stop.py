"""OpenAI ``stop`` sequences over streamed text.

The engine streams text in token-sized pieces, so a stop string can straddle pieces ("Hel" + "lo").
``StopMatcher`` holds back any tail that could still begin a stop string and emits it only once
disambiguated. The output is exactly ``text[:i]`` where ``i`` is the earliest occurrence of any stop
string in the whole text (or all of it if none occurs), whatever the chunking — so a longer stop
that began earlier beats a shorter one completed first, and the client sees the same text however
the tokenizer happened to cut it.
"""

from __future__ import annotations

from typing import Any

MAX_STOPS = 4  # OpenAI's documented limit; clients written against it never send more
MAX_STOP_CHARS = 256  # bounds held-back text and the per-piece suffix scan (quadratic in this length)


def validate_stops(value: Any) -> list[str]:
    """The request's ``stop`` field as a list; ValueError with a client-facing message if malformed.

    Accepts None (no stops), one string, or a list of strings, as the OpenAI API does.
    """
    if value is None:
        return []
    if isinstance(value, str):
        stops = [value]
    elif isinstance(value, list):
        stops = value
    else:
        raise ValueError(f"'stop' must be a string or a list of at most {MAX_STOPS} strings")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"'stop' may contain at most {MAX_STOPS} strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"'stop' entries must be strings, got {type(s).__name__}")
        if not s:
            raise ValueError("'stop' entries must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"'stop' entries may be at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return list(stops)


class StopMatcher:
    """Feed streamed text, emit what is safe; see the module docstring for the exact semantics."""

    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")  # "" would match before every text
        self._stops = list(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False  # a stop string was hit (by feed, or by flush at the end of the stream)

    def feed(self, text: str) -> tuple[str, bool]:
        """The text safe to emit now, and whether a stop string was hit (then ignore further text)."""
        if self.stopped:
            return "", True
        buf = self._held + text
        hit = self._earliest(buf)
        # A stop that may still complete from ``pending`` on would occur before ``hit``: wait for it.
        pending = len(buf) - self._partial_tail(buf)
        if hit is not None and pending >= hit:
            self._held = ""
            self.stopped = True
            return buf[:hit], True
        self._held = buf[pending:]
        return buf[:pending], False

    def flush(self) -> str:
        """Held-back text at the end of the stream; it may still end at a stop (then ``stopped``)."""
        if self.stopped:
            return ""
        buf, self._held = self._held, ""
        hit = self._earliest(buf)
        if hit is None:
            return buf
        self.stopped = True
        return buf[:hit]

    def _earliest(self, buf: str) -> int | None:
        found = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
