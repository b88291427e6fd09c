"""``colibri.model.harmony``: gpt-oss's replies split into reasoning, answer and tool calls, on chosen
text, whole and streamed a character at a time (the markers then arrive cut anywhere). The real
model end to end: tests/test_serve_harmony.py."""

from __future__ import annotations

import pytest

from colibri.model.harmony import HarmonySplit, speaks_harmony, split_harmony
from colibri.model.tool_format import ToolSet

TOOLS = ToolSet(({"name": "get_weather", "parameters": {"type": "object"}},))

CASES = [
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
     "Think.", "Hi!"),
    ("<|channel|>final<|message|>Only an answer.", None, "Only an answer."),
    ("Plain text, no header.", None, "Plain text, no header."),
    ("<|channel|>analysis<|message|>cut in the middle of thin", "cut in the middle of thin", ""),
    ("<|channel|>commentary<|message|>A preamble.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     None, "A preamble.Done."),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", "ab", "c"),
    ("<|channel|>analysis<|message|>x < y, <|not a marker|> stays<|end|>", "x < y, <|not a marker|> stays",
     ""),
]


def streamed(text: str) -> tuple[str, str, HarmonySplit]:
    split = HarmonySplit()
    reasoning, answer = "", ""
    for ch in text:
        r, a = split.feed(ch, 1)
        reasoning, answer = reasoning + r, answer + a
    r, a = split.flush()
    return reasoning + r, answer + a, split


@pytest.mark.parametrize(("text", "reasoning", "answer"), CASES)
def test_split_whole_and_streamed(text: str, reasoning: str | None, answer: str) -> None:
    assert split_harmony(text) == (reasoning, answer)
    r, a, split = streamed(text)
    assert (r if split.opened else None, a) == (reasoning, answer)


def test_a_call_becomes_markers_the_tool_parser_reads() -> None:
    text = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
    for reasoning, answer in (split_harmony(text), streamed(text)[:2]):
        assert reasoning == "Need weather."
        content, calls = TOOLS.read_markers(answer)
        assert content is None
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


def test_a_recipient_in_the_role_header() -> None:
    text = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
    _, answer = split_harmony(text)
    assert [c.name for c in TOOLS.read_markers(answer)[1]] == ["get_weather"]


def test_a_call_ended_by_its_stop_token_is_whole() -> None:
    """``<|call|>`` ends the generation: it is no text, and the call at the reply's end is whole."""
    _, answer = split_harmony('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}')
    assert [c.name for c in TOOLS.read_markers(answer)[1]] == ["get_weather"] and "</tool_call>" in answer


def test_a_cut_call_is_left_open() -> None:
    """``max_tokens`` inside a call: an unclosed marker, which ``tools.cut_call`` drops."""
    _, answer = split_harmony('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Os')
    assert answer.startswith("<tool_call>") and "</tool_call>" not in answer
    content, calls = TOOLS.read_markers(answer)
    assert calls == []


def test_arguments_that_are_no_json_are_no_call() -> None:
    _, answer = split_harmony("<|channel|>commentary to=functions.get_weather<|message|>not json<|call|>")
    assert TOOLS.read_markers(answer)[1] == []


def test_reasoning_tokens_count_the_analysis_bodies() -> None:
    split = HarmonySplit()
    for piece in ("<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>", "assistant",
                  "<|channel|>", "final", "<|message|>", "c"):
        split.feed(piece, 1)
    assert split.reasoning_tokens == 3  # "a", "b", and the <|end|> that closed the body


def test_speaks_harmony() -> None:
    assert speaks_harmony("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not speaks_harmony("<|im_start|>assistant\n<think>")
