"""``coli chat``'s display of a reply (``terminal_chat.Reply``), on chosen text: a harmony reply
split however its text arrives, any other reply passed through whole; end to end on a harmony
model: tests/test_serve_harmony.py."""

from __future__ import annotations

import pytest

from colibri.terminal_chat import DIM, RESET, Reply

HARMONY = ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
           "<|message|>Hello there!")


def shown(capsys, pieces: list[str], dim: bool = False, cut_at: int | None = None) -> str:
    """What the reply shows for its text in ``pieces``; ``cut_at``: an End (length-limited) after
    that many pieces, then a MORE's continuation on the same Reply."""
    reply = Reply(dim)
    for i, piece in enumerate(pieces):
        reply.feed(piece)
        if i + 1 == cut_at:
            reply.feed("", final=False)
    reply.feed("", final=True)
    return capsys.readouterr().out


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_harmony_reply_shows_its_answer_alone(capsys, size: int) -> None:
    pieces = [HARMONY[i : i + size] for i in range(0, len(HARMONY), size)]
    assert shown(capsys, pieces) == "Hello there!"


def test_on_a_terminal_the_analysis_is_dim_and_the_answer_on_its_own_line(capsys) -> None:
    assert shown(capsys, [HARMONY], dim=True) == f"{DIM}The user greets me.{RESET}\nHello there!"


def test_a_cut_reply_goes_on_through_more(capsys) -> None:
    at = HARMONY.index("<|start|>") - 3  # cut inside the analysis
    assert shown(capsys, [HARMONY[:at], HARMONY[at:]], cut_at=1) == "Hello there!"


@pytest.mark.parametrize("text", ["to=morrow is another day", "<|im_start|> is a token", "  Plain.",
                                  "<|chan", ""])
def test_any_other_reply_is_shown_whole(capsys, text: str) -> None:
    assert shown(capsys, [text[:2], text[2:]]) == text
