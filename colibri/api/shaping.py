"""What every endpoint's answer shares: SSE framing, the finished answer, and the shaper's contract.

A ``Shaper`` turns one generation into one endpoint's wire shapes (``completion_shapes``: chat and
text completions; ``responses_shapes``: the Responses API): opening frames, a frame per piece of
text, closing frames from the ``Answer``, frames for a failure after the headers, or the one JSON
object of an answer that does not stream. ``serving`` drives it; a shaper does no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from colibri.api.generation import Piece, TokenLogprob
    from colibri.api.openai_errors import ApiError

# Server-sent events: every JSON object a frame of its own; chat and text completions end with the
# sentinel OpenAI ends them with (the Responses API has none).
SSE_MIMETYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
# No cache may keep a stream, and a proxy (nginx: x-accel-buffering) must not buffer it.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse(obj: Any) -> bytes:
    """One SSE frame holding ``obj`` as JSON (UTF-8 as it is: a frame is bytes anyway)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@dataclass
class Answer:
    """One generation, finished: what every endpoint's closing shapes are made of."""

    text: str | None  # the content; None: the answer was tool calls only
    calls: list[dict[str, Any]]  # chat-shaped tool calls ({"id", "type", "function"})
    finish: str  # "stop" | "length", as the generation ended
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the KV slot already held (the engine's reused tokens)
    stats: dict[str, Any]  # the ``colibri`` block
    tokens: list[TokenLogprob] = field(default_factory=list)  # each generated token's logprobs
    # A thinking model's reasoning (None: the reply had no reasoning block), and its tokens.
    reasoning: str | None = None
    reasoning_tokens: int = 0
    thinks: bool = False  # the reply was parsed for reasoning: usage says how many tokens it took

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else self.finish


class Shaper(Protocol):
    """One request's answer in its endpoint's shapes; ``serving`` calls, in order, ``opening``,
    ``delta`` per piece of text, then ``closing`` (or ``failed``) for a stream, or ``whole``."""

    endpoint: str  # the path, the metrics' label

    def opening(self) -> list[bytes]: ...

    def delta(self, piece: Piece) -> list[bytes]:
        """The frames of a piece of text; none while the answer is held (tools: a call or a reply
        is known once the whole answer is in, and ``closing`` sends it)."""
        ...

    def closing(self, answer: Answer) -> list[bytes]: ...

    def failed(self, err: ApiError) -> list[bytes]:
        """A failure after the headers: the error as the endpoint's last events."""
        ...

    def whole(self, answer: Answer) -> dict[str, Any]: ...
