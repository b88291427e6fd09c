"""Unit tests of OpenAI ``stop`` sequences over streamed text (``colibri.api.stop``): the output
is the text before the earliest stop, however the stream is cut."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.api.stop import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, validate_stops


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _run(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        emitted, hit = m.feed(c)
        out.append(emitted)
        if hit:
            assert m.feed("more") == ("", True)  # everything after a stop is discarded
            assert m.flush() == ""
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), m.stopped


def _chunk(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


_ALPHABET = st.sampled_from("abcé\n")  # small, so stops occur and overlap often


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(_ALPHABET, max_size=40),
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=MAX_STOPS),
    cuts=st.lists(st.integers(0, 1000), max_size=12),
)
def test_stop_matches_reference_under_any_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    chunks = _chunk(text, cuts)
    assert "".join(chunks) == text
    assert _run(stops, chunks) == _reference(text, stops)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(_ALPHABET, max_size=30),
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=MAX_STOPS),
    cuts=st.lists(st.integers(0, 1000), max_size=8),
)
def test_stop_never_emits_past_the_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    """Every prefix emitted along the way is a prefix of the final answer (nothing is retracted)."""
    want, _ = _reference(text, stops)
    m, emitted = StopMatcher(stops), ""
    for c in _chunk(text, cuts):
        out, hit = m.feed(c)
        emitted += out
        assert want.startswith(emitted)
        if hit:
            break


def test_stop_across_token_boundary() -> None:
    m = StopMatcher(["Hello"])
    assert m.feed("Say Hel") == ("Say ", False)
    assert m.feed("lo world") == ("", True)


def test_stop_false_start_is_released() -> None:
    m = StopMatcher(["Hello"])
    assert m.feed("Hel") == ("", False)
    assert m.feed("p") == ("Help", False)
    assert m.flush() == ""


def test_stop_flush_returns_held_text() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("done </e") == ("done ", False)
    assert m.flush() == "</e"
    assert not m.stopped


def test_stop_earliest_wins_even_if_completed_later() -> None:
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("c") == ("", False)  # "bc" is complete, but "abcd" would start earlier
    assert m.feed("d") == ("", True)
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xabc") == ("x", False)
    assert m.feed("e") == ("a", True)  # "abcd" failed, so "bc" wins: "xa" in total


def test_stop_pending_resolved_by_flush() -> None:
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xabc") == ("x", False)
    assert m.flush() == "a"
    assert m.stopped


def test_stop_at_start_and_empty_feeds() -> None:
    m = StopMatcher(["\n\n"])
    assert m.feed("") == ("", False)
    assert m.feed("\n") == ("", False)
    assert m.feed("\nrest") == ("", True)


def test_stop_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


def test_stop_rejects_empty_string() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])


def test_validate_stops_accepts() -> None:
    assert validate_stops(None) == []
    assert validate_stops("###") == ["###"]
    assert validate_stops(["a", "b"]) == ["a", "b"]
    assert validate_stops([]) == []
    assert validate_stops(["x" * MAX_STOP_CHARS]) == ["x" * MAX_STOP_CHARS]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (["a"] * (MAX_STOPS + 1), "at most 4"),
        ([""], "empty"),
        ("", "empty"),
        ([1], "strings"),
        ([None], "strings"),
        (7, "string or a list"),
        ({"a": 1}, "string or a list"),
        (["x" * (MAX_STOP_CHARS + 1)], "characters"),
    ],
)
def test_validate_stops_rejects(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as e:
        validate_stops(value)
    assert "'stop'" in str(e.value)  # names the parameter, as an OpenAI 400 does
