"""The shapes of chat completions (``/v1/chat/completions``) and text completions (``/v1/completions``).

``CompletionShaper`` builds a text completion's objects, ``ChatShaper`` a chat completion's: the
whole answer, or the stream's chunks, then the finish chunk and the usage chunk, which also carry
colibri's own stats (an extra ``colibri`` key, where no client trips on it), then ``[DONE]``.
Clients (the official SDKs among them) parse these by field, so a shape lives here once; errors
are ``openai_errors``'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from colibri.api.ids import new_id
from colibri.api.shaping import SSE_DONE, Answer, sse

if TYPE_CHECKING:
    from colibri.api.generation import Piece, TokenLogprob
    from colibri.api.openai_errors import ApiError
    from colibri.api.openai_requests import Generation


def usage(answer: Answer) -> dict[str, Any]:
    """OpenAI's usage; for a thinking model's reply also ``completion_tokens_details.reasoning_tokens``
    (LangChain reads it into ``usage_metadata``)."""
    out: dict[str, Any] = {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }
    if answer.thinks:
        out["completion_tokens_details"] = {"reasoning_tokens": answer.reasoning_tokens}
    return out


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


class CompletionShaper:
    """One text completion's objects: its id, model and creation time, and the request's options
    (logprobs, ``include_usage``). Tools are chat's; the answer is never held here."""

    endpoint = "/v1/completions"  # the metrics' label
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.model = gen, model
        self.id, self.created = new_id(self.id_prefix), int(time.time())
        self.offset = 0  # where the next piece's text begins in the answer (the legacy logprobs)

    @property
    def held(self) -> bool:
        """Tools are offered: the answer is a call or a reply, known once it is whole."""
        return self.gen.tools is not None

    def logprobs(self, tokens: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not self.gen.logprobs:
            return None
        return completion_logprobs(tokens, self.gen.top_logprobs, offset)

    def choice(self, text: str | None, logprobs: dict[str, Any] | None, finish: str | None,
               calls: list[dict[str, Any]] | None = None, role: bool = False) -> dict[str, Any]:
        """A chunk's choice: a piece of text, or (``finish``) the end."""
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def whole_choice(self, answer: Answer, finish: str) -> dict[str, Any]:
        return {"index": 0, "text": answer.text, "logprobs": self.logprobs(answer.tokens),
                "finish_reason": finish}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.gen.include_usage:
            out["usage"] = None  # OpenAI's rule: with include_usage, every chunk has the field
        return out

    # ------------------------------------------------------------------------- the shaper

    def opening(self) -> list[bytes]:
        return []

    def delta(self, piece: Piece) -> list[bytes]:
        if self.held or not (piece.text or piece.tokens):
            return []
        logprobs = self.logprobs(piece.tokens, self.offset)
        self.offset += len(piece.text)
        return [sse(self.chunk(self.choice(piece.text, logprobs, None)))]

    def closing(self, answer: Answer) -> list[bytes]:
        """The held answer (tools: content and calls in one delta, each call with its index, what
        SDKs reassemble by), the finish chunk with colibri's stats (clients index ``choices[0]``
        of every chunk but OpenAI's usage chunk: no chunk of our own may come without a choice),
        OpenAI's usage chunk (``include_usage``: no choices, the last one before [DONE], whose
        usage the SDK's stream helper keeps), then [DONE]."""
        frames = []
        if self.held:
            calls = [{"index": i, **call} for i, call in enumerate(answer.calls)]
            choice = self.choice(answer.text, self.logprobs(answer.tokens), None, calls)
            frames.append(sse(self.chunk(choice)))
        finish = self.chunk(self.choice(None, None, answer.finish_reason))
        frames.append(sse({**finish, "colibri": answer.stats}))
        if self.gen.include_usage:
            frames.append(sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                               "model": self.model, "choices": [], "usage": usage(answer),
                               "colibri": answer.stats}))
        return [*frames, SSE_DONE]

    def failed(self, err: ApiError) -> list[bytes]:
        """After the headers, an error travels as a final SSE event."""
        return [sse(err.body()), SSE_DONE]

    def whole(self, answer: Answer) -> dict[str, Any]:
        """The whole answer of a request that did not stream, colibri's stats beside it."""
        return {
            "id": self.id,
            "object": self.object,
            "created": int(time.time()),
            "model": self.model,
            "choices": [self.whole_choice(answer, answer.finish_reason)],
            "usage": usage(answer),
            "colibri": answer.stats,
        }


class ChatShaper(CompletionShaper):
    """One chat completion's objects: a message, or deltas that open with the assistant's role."""

    endpoint = "/v1/chat/completions"
    id_prefix = "chatcmpl-"
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def logprobs(self, tokens: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        return chat_logprobs(tokens, self.gen.top_logprobs) if self.gen.logprobs else None

    def choice(self, text: str | None, logprobs: dict[str, Any] | None, finish: str | None,
               calls: list[dict[str, Any]] | None = None, role: bool = False,
               reasoning: str = "") -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def delta(self, piece: Piece) -> list[bytes]:
        """A thinking model's reasoning goes out as it comes, in ``reasoning_content`` (with tools
        too: only the answer is held); a piece of reasoning alone has no ``content`` key."""
        if not piece.reasoning:
            return super().delta(piece)
        if self.held:
            return [sse(self.chunk(self.choice(None, None, None, reasoning=piece.reasoning)))]
        text = piece.text or None
        return [sse(self.chunk(self.choice(text, self.logprobs(piece.tokens), None,
                                           reasoning=piece.reasoning)))]

    def whole_choice(self, answer: Answer, finish: str) -> dict[str, Any]:
        """With tool calls, the content may be None (OpenAI's content of a message that only calls);
        ``reasoning_content`` only when the reply had reasoning (llama.cpp's server does the same)."""
        message: dict[str, Any] = {"role": "assistant", "content": answer.text, "refusal": None}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = answer.calls
        return {"index": 0, "message": message, "logprobs": self.logprobs(answer.tokens),
                "finish_reason": finish}

    def opening(self) -> list[bytes]:
        return [sse(self.chunk(self.choice("", None, None, role=True)))]
