"""The Channel session's turns: their state, the configuration they run under, and their markup as
token ids, by the trust rule: the template's markup is parsed
for control tokens, the host's text never is.

A Channel conversation lives in the slot and only grows, so a new turn is the template's markup
*after* what the context already holds (``ModelText.continuation_segments``). The first turn is
the template's whole rendering (with its default system prompt where it has one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from colibri.io import channel_frames as cf
from colibri.model.sampling import SamplingParams
from colibri.model.text import ModelText, Segment


@dataclass(frozen=True)
class Framed:
    """A turn's markup around its content: ``before`` + content + ``after``."""

    before: list[int]
    after: list[int]


class TurnRenderer:
    """A Channel turn's markup as ids, through the model's one chat-to-tokens path
    (``ModelText.continuation_segments``, ``ModelText.encode_segments``)."""

    def __init__(self, text: ModelText) -> None:
        self.text = text
        self.tok = text.tokenizer

    def _ids(self, segments: list[Segment]) -> list[int]:
        return self.text.encode_segments(segments)

    def _segments(self, prev_role: str | None, messages: list[dict[str, Any]],
                  tools: list[dict] | None = None) -> list[Segment]:
        return self.text.continuation_segments(prev_role, messages, tools)

    def user_turn(self, prev_role: str | None, system: str | None,
                  tools: list[dict] | None = None, role: str = "user") -> Framed:
        """The markup before and after a new ``role`` message's content, through the assistant's
        header; ``system`` goes first when the context is empty."""
        sentinel = "\x00content\x00"
        messages = [{"role": role, "content": sentinel}]
        if prev_role is None and system:
            messages.insert(0, {"role": "system", "content": system})
        segs = self._segments(prev_role, messages, tools=tools)
        at = next(i for i, s in enumerate(segs) if not s.markup and s.text == sentinel)
        return Framed(self._ids(segs[:at]), self._ids(segs[at + 1 :]))

    def note(self, prev_role: str | None, role: str, content: str) -> list[int]:
        """A message that starts no turn (the memory's recall), after the context, left open as a
        reply is (the next turn's markup closes it): the context then ends with ``role``."""
        segs = self._segments(prev_role, [{"role": role, "content": content}])
        at = next(i for i, s in enumerate(segs) if not s.markup)
        return self._ids(segs[: at + 1])

    def plain(self, text: str) -> list[int]:
        """The host's or the model's text, as data."""
        return self.tok.encode(text, special=False)

    def markup(self, text: str) -> list[int]:
        """Our own markers (the reasoning block's, a host's DIRECT rendering): control tokens parsed."""
        return self.tok.encode(text, special=True)


@dataclass
class Turn:
    """The turn in progress (or yielded) and what it has produced."""

    msg_id: int
    user: str  # what the memory records as the user's side
    in_thought: bool
    tool_mode: str  # "none" | "auto" | "required"
    t0: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    thought_tokens: int = 0
    since_yield: int = 0
    thought: bytearray = field(default_factory=bytearray)
    content: bytearray = field(default_factory=bytearray)
    held: list[cf.StreamContent] = field(default_factory=list)  # content that may be a tool call
    calling: bool = False
    plain: bool = False  # the answer is text: a call is read only at its start
    ending: str | None = None  # "close" (the budget), "yield", "abort", "call"
    request: int = 0  # the engine request generating now


@dataclass
class Config:
    """SET_CONFIG as this engine applies it (the notes' defaults until the host sets it)."""

    frame: cf.SetConfig = field(default_factory=cf.SetConfig)

    def sampling(self) -> SamplingParams:
        f = self.frame
        return SamplingParams(temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, min_p=f.min_p,
                              repetition_penalty=f.repeat_penalty, repeat_window=f.repeat_window)

    @property
    def thinking_gate(self) -> bool:
        return bool(self.frame.flags & cf.CONFIG_THINKING_GATE)
