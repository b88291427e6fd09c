"""The shapes of OpenAI's successful answers, and SSE framing, without I/O.

``Envelope`` carries what every object of one answer repeats (id, model, creation time) and builds
them: the chat or text completion, its stream chunks, and the finish and usage chunks that also
carry colibri's own stats (an extra ``colibri`` key, where no client trips on it). Clients (the
official SDKs among them) parse these by field, so a shape lives here once and nowhere else; errors
are ``openai_errors``'s.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from colibri.api.generation import TokenLogprob
from colibri.api.openai_requests import Generation

ID_HEX_CHARS = 24  # as long as OpenAI's ids: unique enough, and what clients that store them expect
OWNER = "colibri"  # the model card's ``owned_by``

# Server-sent events: every JSON object a frame of its own, then the sentinel OpenAI ends with.
SSE_MIMETYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
# No cache may keep a stream, and a proxy (nginx: x-accel-buffering) must not buffer it.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse(obj: Any) -> bytes:
    """One SSE frame holding ``obj`` as JSON (UTF-8 as it is: a frame is bytes anyway)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:ID_HEX_CHARS]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNER}


def model_list(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created)]}


# ----------------------------------------------------------------------------- logprobs


def chat_logprobs(items: list[TokenLogprob], top_n: int) -> dict[str, Any]:
    def entry(text: bytes, lp: float) -> dict[str, Any]:
        return {"token": text.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(text)}

    return {
        "content": [
            {**entry(t.text, t.logprob), "top_logprobs": [entry(x, lp) for x, lp in t.top[:top_n]]}
            for t in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: list[TokenLogprob], top_n: int, offset: int = 0) -> dict[str, Any]:
    """The legacy shape; ``offset``: where the first token's text begins in the whole answer."""
    tokens, offsets = [], []
    for t in items:
        offsets.append(offset)
        text = t.text.decode("utf-8", errors="replace")
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in items],
        "text_offset": offsets,
        "top_logprobs": [{x.decode("utf-8", errors="replace"): lp for x, lp in t.top[:top_n]} for t in items],
    }


def logprobs(gen: Generation, items: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
    """The request's kind of logprobs for ``items``, or None when it asked for none."""
    if not gen.logprobs:
        return None
    if gen.kind == "chat":
        return chat_logprobs(items, gen.top_logprobs)
    return completion_logprobs(items, gen.top_logprobs, offset)


# ----------------------------------------------------------------------------- one answer


@dataclass(frozen=True)
class Envelope:
    """One answer's id, model and creation time, and the request whose shapes it builds."""

    gen: Generation
    model: str
    id: str
    created: int

    @classmethod
    def open(cls, gen: Generation, model: str) -> Envelope:
        return cls(gen, model, new_id(gen.kind), int(time.time()))

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.gen.kind == "chat" else "text_completion"

    def chunk(
        self,
        *,
        text: str | None = None,
        role: bool = False,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk: the role (chat, first), a piece of text, tool calls, or the finish."""
        if self.gen.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:  # whole calls in one delta, each with its index (what SDKs reassemble by)
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.gen.include_usage:
            out["usage"] = None  # OpenAI's rule: with include_usage, every chunk has the field
        return out

    def role_chunk(self) -> dict[str, Any]:
        return self.chunk(role=True, text="")

    def finish_chunk(self, finish: str, stats: dict[str, Any]) -> dict[str, Any]:
        """The last chunk with a choice: the finish reason, and colibri's stats as an extra key
        (clients index ``choices[0]`` of every chunk but OpenAI's usage chunk: no chunk of our own
        may come without a choice)."""
        out = self.chunk(finish=finish, text=None if self.gen.kind == "chat" else "")
        out["colibri"] = stats
        return out

    def usage_chunk(self, use: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's usage chunk (``include_usage``): no choices, and the last one before [DONE]
        (the SDK's stream helper keeps the usage of the last chunk); the stats again beside it."""
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": use, "colibri": stats}

    def final(
        self,
        text: str | None,
        finish: str,
        use: dict[str, int],
        logprobs: dict[str, Any] | None,
        extra: dict[str, Any],
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The whole answer of a request that did not stream; ``extra``: colibri's own fields.
        With ``tool_calls``, ``text`` may be None (OpenAI's content of a message that only calls)."""
        if self.gen.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": use,
            **extra,
        }
