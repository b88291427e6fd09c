"""The Channel session's turns: their state, the configuration they run under, and their markup as
token ids, by the trust rule: the template's markup is parsed
for control tokens, the host's text never is.

A Channel conversation lives in the slot and only grows, so a new turn is the template's markup
*after* what the context already holds (``ModelText.continuation_segments``). The first turn is
the template's whole rendering (with its default system prompt where it has one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri.io import channel_frames as cf
from colibri.model.sampling import SamplingParams
from colibri.model.text import ModelText, Segment
from colibri.model.tokenizer import TooManyTokens
from colibri.sched.channel_slot import soft_rows


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

    def plain(self, text: str, limit: int | None = None) -> list[int]:
        """The host's or the model's text, as data. ``limit``: ``TooManyTokens`` for a text that
        cannot fit in that many tokens by its length, untokenized (megabytes would stall the loop)."""
        return self.tok.encode_segments([(text, False)], limit=limit)

    def markup(self, text: str, limit: int | None = None) -> list[int]:
        """Our own markers (the reasoning block's, a host's DIRECT rendering): control tokens parsed."""
        return self.tok.encode_segments([(text, True)], limit=limit)

    def fitting(self, text: str, room: int) -> list[int] | int:
        """``text`` as data if it may fit ``room`` tokens; else the fewest tokens it can be, untokenized."""
        try:
            return self.plain(text, room)
        except TooManyTokens as e:
            return e.at_least

    def content(self, inp: cf.StreamInput, direct: bool, n_vocab: int, n_embd: int,
                room: int | None = None) -> tuple[list[int], str, np.ndarray | None] | cf.Error:
        """STREAM_INPUT's content: (its ids, the user's side as the memory records it, soft rows or
        None), or the ERROR that refuses it; text that cannot fit ``room`` tokens is refused
        untokenized."""
        malformed = cf.ErrorCode.MALFORMED_PAYLOAD
        embeds = None
        if inp.data_type == cf.DataType.TEXT:
            text = inp.text()
            try:
                body, user = self.markup(text, room) if direct else self.plain(text, room), text
            except TooManyTokens as e:
                return cf.Error(malformed, f"the input does not fit the context: at least {e.at_least} "
                                           f"tokens, {room} left")
        elif inp.data_type == cf.DataType.TOKENS:
            body = list(inp.token_ids())
            if any(t >= n_vocab for t in body):
                return cf.Error(malformed, "a token id outside the vocabulary")
            user = self.tok.decode(body)
        elif inp.data_type == cf.DataType.EMBEDDINGS:
            embeds = soft_rows(inp.data, n_embd)
            if isinstance(embeds, str):
                return cf.Error(malformed, embeds)
            body, user = [], f"[{len(embeds)} soft rows]"
        else:
            return cf.Error(cf.ErrorCode.UNSUPPORTED_DATA_TYPE,
                            f"data type {inp.data_type} needs an encoder this model lacks")
        if not body and embeds is None:
            return cf.Error(malformed, "an empty input")
        return body, user, embeds


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

    def check(self) -> None:
        """ValueError naming the first field out of range: the sampling's by the one check every
        protocol's values pass (``SamplingParams.validate``), then the Channel's own. The inactive
        quiescence_threshold is held to a finite number >= 0 all the same: a config the engine
        keeps is one it could act on."""
        try:
            self.sampling().validate()
        except ValueError as e:  # named as on the wire
            raise ValueError(str(e).replace("repetition_penalty", "repeat_penalty")) from None
        if self.frame.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        q = self.frame.quiescence_threshold
        if not (math.isfinite(q) and q >= 0.0):
            raise ValueError(f"quiescence_threshold must be a finite number >= 0, got {q!r}")

    def sampling(self) -> SamplingParams:
        f = self.frame
        return SamplingParams(temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, min_p=f.min_p,
                              repetition_penalty=f.repeat_penalty, repeat_window=f.repeat_window)

    @property
    def thinking_gate(self) -> bool:
        return bool(self.frame.flags & cf.CONFIG_THINKING_GATE)
