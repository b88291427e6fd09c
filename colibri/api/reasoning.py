"""A thinking model's reply split into its reasoning and its answer, as the text streams.

Thinking models (Qwen3, the DeepSeek-R1 distills, QwQ: any whose chat template writes ``<think>``)
open their reply with a reasoning block, ``<think>\\n…\\n</think>\\n\\n``, then answer. Clients of
llama.cpp's server and vLLM read the block in ``reasoning_content`` and the answer in ``content``;
``ReasoningSplit`` makes that split, token by token, the same way however the tokenizer cut the
tags (``</`` + ``think`` + ``>``):

- The reply starts inside the block when the prompt's own markup ends with an open ``<think>``
  (``opens_reasoning``: an R1-style generation prompt, ``<｜Assistant｜><think>\\n``); else only a
  ``<think>`` at the reply's very start (after whitespace) opens it. A ``<think>`` later in the
  answer is text, and so is everything after the first ``</think>``.
- A reply cut (``max_tokens``) before ``</think>`` is all reasoning, and its answer empty.
- Whitespace around the block is not the answer's: the reasoning is stripped at both ends, the
  answer's leading whitespace after ``</think>`` dropped (as llama.cpp's server does).

Only the model's output is parsed: a client's ``<think>`` in a message is data (``model/text.py``),
and the tool-call parser sees the answer alone (``serving.answer_of``).
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The prompt's markup ends inside a reasoning block: an open tag and nothing but whitespace after it.
_OPEN_AT_END = re.compile(r"<think>\s*\Z")

# The splitter's states: the reply's start (an opening tag may still come), inside the block,
# the answer after the block, the answer of a reply that had no block.
START, REASONING, AFTER, CONTENT = "start", "reasoning", "after", "content"


def template_thinks(source: str) -> bool:
    """A chat template that writes a reasoning block: its replies are split."""
    return THINK_OPEN in source


def opens_reasoning(markup_tail: str) -> bool:
    """The prompt's last markup leaves a reasoning block open: the reply starts inside it."""
    return _OPEN_AT_END.search(markup_tail) is not None


def _partial_close(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``</think>``."""
    for k in range(min(len(THINK_CLOSE) - 1, len(text)), 0, -1):
        if text.endswith(THINK_CLOSE[:k]):
            return k
    return 0


class ReasoningSplit:
    """Streamed reply text in, (reasoning, answer) pieces out; ``flush`` at the end.

    ``feed`` also takes how many tokens made the text, to count ``reasoning_tokens``: the tokens of
    the block, tags included, up to the one that closed it."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside  # the prompt left the block open
        self.state = START
        self.opened = False  # the reply has a reasoning block (it may be empty)
        self.reasoning_tokens = 0
        self._held = ""  # text that cannot be placed yet: a partial tag, whitespace before a tag
        self._pending = 0  # tokens fed while at START, counted once the start is resolved
        self._began = False  # the reasoning's first non-whitespace character has been sent

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        """The reasoning and the answer ``text`` adds, as far as they are known now."""
        if self.state == START:
            return self._start(self._held + text, tokens)
        if self.state == REASONING:
            self.reasoning_tokens += tokens
            return self._reasoning(self._held + text)
        if self.state == AFTER:
            return "", self._after(text)
        return "", text

    def flush(self) -> tuple[str, str]:
        """What was held at the end of the reply: the reply's last pieces."""
        held, self._held = self._held, ""
        if self.state == START:
            if not self.inside:
                self.state = CONTENT
                return "", held
            self._enter()
            return self._began_text(held.rstrip()), ""
        if self.state == REASONING:
            return self._began_text(held.rstrip()), ""
        return "", ""

    # ------------------------------------------------------------------------- the states

    def _enter(self) -> None:
        self.state, self.opened = REASONING, True
        self.reasoning_tokens += self._pending

    def _start(self, buf: str, tokens: int) -> tuple[str, str]:
        self._pending += tokens
        stripped = buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._held = ""
            self._enter()
            return self._reasoning(stripped[len(THINK_OPEN):])
        if THINK_OPEN.startswith(stripped):  # nothing yet, or a tag still arriving
            self._held = buf
            return "", ""
        self._held = ""
        if self.inside:
            self._enter()
            return self._reasoning(buf)
        self.state = CONTENT
        return "", buf

    def _reasoning(self, buf: str) -> tuple[str, str]:
        at = buf.find(THINK_CLOSE)
        if at >= 0:
            self._held, self.state = "", AFTER
            return self._began_text(buf[:at].rstrip()), self._after(buf[at + len(THINK_CLOSE):])
        # Hold a tag that may be arriving, and the whitespace before it (not the reasoning's).
        keep = len(buf) - _partial_close(buf)
        keep = len(buf[:keep].rstrip())
        self._held = buf[keep:]
        return self._began_text(buf[:keep]), ""

    def _began_text(self, text: str) -> str:
        """Reasoning text to send, without the block's leading whitespace."""
        if not self._began:
            text = text.lstrip()
            self._began = bool(text)
        return text

    def _after(self, text: str) -> str:
        """The answer after the block, without its leading whitespace."""
        if self.state == AFTER:
            text = text.lstrip()
            if text:
                self.state = CONTENT
        return text


def split_reply(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole reply's (reasoning, answer); reasoning None when it has no block."""
    split = ReasoningSplit(inside)
    r1, c1 = split.feed(text)
    r2, c2 = split.flush()
    return (r1 + r2 if split.opened else None), c1 + c2
