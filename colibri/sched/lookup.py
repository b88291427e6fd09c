"""Prompt lookup: a stream's draft is the continuation of the latest earlier occurrence of its last
tokens, in its own prompt and output (``speculation.py`` decides how much of it to verify).

Hard-wrapped text (mail, Markdown and plain-text documents broken into lines at a width) is often
quoted by a model as flowing text: the prompt holds ``not`` ``\\n`` ``cover`` where the answer
writes ``not`` `` cover``. The tokens differ at every line break, so the lookup would find no match
there, or a wrong one, once a line. So the index also holds a *joined* view of the tokens, each
soft line break (a newline token between a token that does not end a line and a word token with a
spaced form in the vocabulary) joined into that spaced token. A draft comes from the joined view
where the stream's last tokens agree with it over more of the text than with the tokens as they
are: the stream has joined a wrapped line, and will join the next. A stream that copies the lines
as they are agrees with both alike, and takes the tokens as they are.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The longest suffix looked up first (a longer match predicts better); one token matches anywhere
# in a chat and its continuations are mostly wrong, so two is the shortest.
NGRAM_MAX = 4
NGRAM_MIN = 2
# How many tokens before a draft agree with the stream's last is counted up to AGREEMENT_MAX:
# past ``speculation.COPYING`` it only tells how long a copy has run, and it bounds the walk.
AGREEMENT_MAX = 32


@dataclass(frozen=True)
class LineJoins:
    """What a soft line break is in one vocabulary."""

    newline: int  # the token of a lone "\n"
    ends_line: frozenset[int]  # tokens whose text ends with a newline: a newline after one is a blank line
    spaced: Mapping[int, int]  # a word token -> the token of the same text after a space

    @classmethod
    def of_vocabulary(cls, pieces: Sequence[bytes]) -> LineJoins | None:
        """From each token's bytes (``pieces[id]``); None where the vocabulary has no newline token."""
        ids: dict[bytes, int] = {}
        for i, b in enumerate(pieces):
            ids.setdefault(b, i)
        newline = ids.get(b"\n")
        if newline is None:
            return None
        spaced = {i: ids[b" " + b] for i, b in enumerate(pieces)
                  if b and not b[:1].isspace() and b" " + b in ids}
        return cls(newline, frozenset(i for i, b in enumerate(pieces) if b.endswith(b"\n")), spaced)


class NgramIndex:
    """Each n-gram's ends in a token sequence, kept as tokens come (a lookup is a dict access,
    whatever the length) and in order, so that dropping the sequence's tail drops its last entries
    and the earlier ones stand."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # n -> {n-gram: the indices of its last token where a token followed it, ascending}
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for t in tokens:
            end = len(seq) - 1  # the n-grams ending here now have a continuation: t
            for n, table in self.ends.items():
                if end + 1 >= n:
                    table.setdefault(tuple(seq[end - n + 1 : end + 1]), []).append(end)
            seq.append(t)

    def truncate(self, length: int) -> None:
        """Drop the tokens from ``length`` on, and the entries they continued, latest first."""
        seq = self.tokens
        for end in range(len(seq) - 2, length - 2, -1):
            for n, table in self.ends.items():
                if end + 1 >= n:
                    key = tuple(seq[end - n + 1 : end + 1])
                    table[key].pop()
                    if not table[key]:
                        del table[key]
        del seq[length:]

    def find(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest suffix
        that recurs, and how many tokens agree before them (at most AGREEMENT_MAX)."""
        seq = self.tokens
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            ends = self.ends[n].get(tuple(seq[-n:])) if len(seq) > n else None
            if not ends:
                continue
            end = ends[-1]
            agreed, i, j = n, end - n, len(seq) - 1 - n
            while agreed < AGREEMENT_MAX and i >= 0 and seq[i] == seq[j]:
                agreed, i, j = agreed + 1, i - 1, j - 1
            return seq[end + 1 : end + 1 + limit], agreed
        return [], 0


class NgramDrafter:
    """Prompt lookup over one stream's tokens, as they are and with their soft line breaks joined
    (``joins``: None, as they are only)."""

    def __init__(self, tokens: Sequence[int], joins: LineJoins | None = None) -> None:
        self._raw = NgramIndex()
        self._joins = joins
        self._joined = NgramIndex() if joins is not None else None
        self._starts: list[int] = []  # the index in ``tokens`` of each joined token's first
        self.extend(tokens)

    @property
    def tokens(self) -> list[int]:
        return self._raw.tokens

    def extend(self, tokens: Sequence[int]) -> None:
        start = len(self._raw.tokens)
        self._raw.extend(tokens)
        self._join_from(start)

    def _join_from(self, start: int) -> None:
        """The joined view of the tokens from index ``start`` on (the view holds those before)."""
        view, joins, raw = self._joined, self._joins, self._raw.tokens
        if view is None or joins is None:
            return
        for r in range(start, len(raw)):
            t = raw[r]
            spaced = joins.spaced.get(t)
            if (spaced is not None and r >= 2 and self._starts[-1] == r - 1 and raw[r - 1] == joins.newline
                    and raw[r - 2] not in joins.ends_line):
                view.truncate(len(view.tokens) - 1)  # the newline and this word: one spaced word
                view.extend((spaced,))
            else:
                view.extend((t,))
                self._starts.append(r)

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens to follow the stream's last (none where no suffix recurs), and how
        many tokens before them agree with the stream's last (at most AGREEMENT_MAX): a stream
        copying a passage agrees with it for as long as it has copied."""
        if limit <= 0:
            return [], 0
        draft, agreed = self._raw.find(limit)
        view = self._joined
        # (a view with no line joined is the tokens as they are: it can agree over no more of them)
        if view is not None and agreed < AGREEMENT_MAX and len(view.tokens) < len(self.tokens):
            joined, joined_agreed = view.find(limit)
            starts = self._starts
            if joined_agreed and len(self.tokens) - starts[len(starts) - joined_agreed] > agreed:
                return joined, joined_agreed
        return draft, agreed

    def reuse(self, tokens: Sequence[int]) -> None:
        """Hold ``tokens`` instead: the common prefix is kept with its tables (a conversation's next
        turn costs only what it adds), the rest dropped, its entries with it."""
        common = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            common += 1
        self._raw.truncate(common)
        self._raw.extend(tokens[common:])
        if self._joined is not None:
            # the joined tokens that start before common - 1 end before common (one joins two
            # tokens at most); the view is rebuilt from the first token of the next
            keep = bisect_left(self._starts, common - 1)
            start = self._starts[keep] if keep < len(self._starts) else common
            self._joined.truncate(keep)
            del self._starts[keep:]
            self._join_from(start)
