"""Prompt lookup (``colibri/sched/lookup.py``): the continuation of the longest recurring suffix,
how long the stream has copied, an index kept as tokens come and as turns reuse it, and hard-wrapped
text quoted as flowing text (a soft line break joined into the next word's spaced token)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from colibri.model.tokenizer import GGUFTokenizer
from colibri.sched import lookup
from colibri.sched.drafts import line_joins
from colibri.sched.lookup import LineJoins, NgramDrafter
from colibri.store.gguf import GGUFFile


def test_prompt_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    d = NgramDrafter(seq)
    # "1 2 3" occurred at the start (followed by 4 5 9 ...); "2 3" also later (followed by 7): the
    # longer suffix wins, and three tokens agree before the continuation
    assert d.propose(4) == ([4, 5, 9, 2], 3)
    d.extend([7])  # "2 3 7" now: its latest earlier occurrence is followed by 8 1 2 3 7
    assert d.propose(3) == ([8, 1, 2], 3)
    assert d.propose(0) == ([], 0)
    assert NgramDrafter([1, 2, 3, 4]).propose(5) == ([], 0)  # nothing recurs
    assert NgramDrafter([5, 6, 5]).propose(5) == ([], 0)  # one token is not a match (NGRAM_MIN 2)


def test_agreement_counts_how_long_the_stream_has_copied():
    passage = list(range(100, 140))
    d = NgramDrafter([*passage, 7, *passage[:20]])
    assert d.propose(4) == (passage[20:24], 20)
    d = NgramDrafter([*passage, 7, *passage[:3]])
    assert d.propose(4) == (passage[3:7], 3)
    d = NgramDrafter([*passage, *passage])  # agreement is counted up to AGREEMENT_MAX
    assert d.propose(2)[1] == lookup.AGREEMENT_MAX


def test_prompt_lookup_built_at_once_or_token_by_token_is_the_same():
    rng = np.random.default_rng(1)
    seq = [int(t) for t in rng.integers(0, 6, 300)]
    whole, grown = NgramDrafter(seq), NgramDrafter(seq[:1])
    for t in seq[1:]:
        grown.extend([t])
    assert _state(whole) == _state(grown)


def test_a_next_turn_reuses_the_index_as_if_built_anew():
    rng = np.random.default_rng(2)
    d = NgramDrafter([1, 2, 3, 4, 5, 6, 1, 2])
    assert d.propose(3)[0] == [3, 4, 5]
    d.reuse([1, 2, 9, 9, 1, 2])  # the prefix "1 2" kept; "3 4 5 6 ..." dropped with its entries
    assert d.propose(3)[0] == [9, 9, 1]
    for _ in range(200):  # a conversation's turns: its prompt re-sent, shortened, edited, extended
        seq = d.tokens[: int(rng.integers(0, len(d.tokens) + 1))]
        seq += [int(t) for t in rng.integers(0, 5, int(rng.integers(0, 40)))]
        d.reuse(seq)
        fresh = NgramDrafter(seq)
        assert _state(d) == _state(fresh)
        assert d.propose(4) == fresh.propose(4)


# A vocabulary of words, their spaced forms, a newline and a blank line's token.
PIECES = [b"\n", b"\n\n", b".\n", b"x", b" x", b"y", b" y", b"z", b" z", b" w", b"q"]
NL, BLANK, DOT_NL, X, SX, Y, SY, Z, SZ, SW, Q = range(len(PIECES))
JOINS = LineJoins.of_vocabulary(PIECES)


def _state(d: NgramDrafter) -> tuple:
    joined = d._joined
    return d._raw.tokens, d._raw.ends, joined and joined.tokens, joined and joined.ends, d._starts


def test_the_soft_line_breaks_of_a_vocabulary():
    assert JOINS.newline == NL
    assert JOINS.spaced == {X: SX, Y: SY, Z: SZ}  # "q" has no spaced form; " w" is one
    assert JOINS.ends_line == {NL, BLANK, DOT_NL}
    assert LineJoins.of_vocabulary([b"a", b" a"]) is None  # no newline token: no soft line breaks


def test_a_stream_that_joins_wrapped_lines_is_drafted_joined_and_one_that_copies_them_as_they_are():
    source = [SW, SX, NL, Y, SZ, NL, Q, SW, DOT_NL, NL, Z, SY]
    joined = NgramDrafter([*source, SW, SX, SY], JOINS)  # the stream joined "x \n y": " x" " y"
    # the newline before a word with no spaced form, and the line after a blank line, are kept
    assert joined.propose(8) == ([SZ, NL, Q, SW, DOT_NL, NL, Z, SY], 3)
    assert NgramDrafter([*source, SW, SX, SY]).propose(8) == ([], 0)  # without joins: no match
    copied = NgramDrafter([*source, SW, SX, NL, Y], JOINS)  # the lines as they are
    assert copied.propose(4) == ([SZ, NL, Q, SW], 4)


def test_the_joined_view_built_at_once_token_by_token_and_reused_is_the_same():
    rng = np.random.default_rng(3)
    seq = [int(t) for t in rng.integers(0, len(PIECES), 400)]
    whole, grown = NgramDrafter(seq, JOINS), NgramDrafter(seq[:1], JOINS)
    for t in seq[1:]:
        grown.extend([t])
    assert _state(whole) == _state(grown)
    d = NgramDrafter(seq, JOINS)
    for _ in range(200):  # a conversation's turns, cut anywhere, a line break's halves included
        kept = d.tokens[: int(rng.integers(0, len(d.tokens) + 1))]
        kept += [int(t) for t in rng.integers(0, len(PIECES), int(rng.integers(0, 40)))]
        d.reuse(kept)
        fresh = NgramDrafter(kept, JOINS)
        assert _state(d) == _state(fresh)
        assert d.propose(6) == fresh.propose(6)


WARRANTY = """Warranty. Every product we sell is covered by a limited warranty of two years from the date of
delivery. The warranty covers defects in materials and workmanship under normal use. It does not
cover damage caused by accidents, misuse, unauthorized repairs, or normal wear and tear. To make a
claim, contact our support team with your order number and a short description of the problem."""


def test_a_quote_of_hard_wrapped_text_in_the_real_vocabulary(model_path: Path):
    """The bench's grounded answer: the model quotes the paragraph as one line of text."""
    tok = GGUFTokenizer(GGUFFile(model_path))
    prompt = tok.encode(WARRANTY)
    answer = tok.encode("The warranty covers defects in materials and workmanship under normal use. It "
                        "does not cover")
    d = NgramDrafter(prompt + answer, line_joins(tok))
    draft, agreed = d.propose(16)
    assert tok.decode(draft) == (" damage caused by accidents, misuse, unauthorized repairs, or normal wear "
                                 "and tear.")
    assert agreed > 10  # the stream has copied since "The warranty covers", across the line break
    assert tok.decode(NgramDrafter(prompt + answer).propose(16)[0]) != tok.decode(draft)
