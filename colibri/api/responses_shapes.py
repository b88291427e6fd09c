"""The shapes of OpenAI's Responses API (``/v1/responses``): the response object, its output items
and its stream events, without I/O.

The openai SDKs parse these by field (``openai.types.responses``), so each shape lives here once.
A stream is ``event: <type>`` / ``data: <json>`` frames, every payload with its ``type`` and a
``sequence_number`` that counts up from 0; it ends with ``response.completed``,
``response.incomplete`` or ``response.failed``: OpenAI sends no ``[DONE]`` on this endpoint.
colibri's stats ride on the final response object as an extra ``colibri`` key, as they do on chat
completions' finish chunk: the SDK's models keep unknown keys.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from colibri.api.openai_errors import ApiError
from colibri.api.openai_responses import ID_HEX_CHARS

LENGTH_REASON = "max_output_tokens"  # incomplete_details.reason of an answer cut by its budget


def new_id(prefix: str) -> str:
    """OpenAI's id style: ``resp_…`` for a response, ``msg_…`` a message, ``fc_…`` a function call."""
    return f"{prefix}_{uuid.uuid4().hex[:ID_HEX_CHARS]}"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """``cached_tokens``: prompt tokens the KV slot already held (the engine's reused tokens).
    ``cache_write_tokens`` (newer SDKs require it) is 0: OpenAI bills cache writes, colibri does not."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; ``text`` None: its content is still to come (a stream's first event)."""
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(call: dict[str, Any], item_id: str, status: str = "completed",
                       arguments: str | None = None) -> dict[str, Any]:
    """A chat-shaped tool call (``{"id", "type", "function": {"name", "arguments"}}``) as a
    Responses ``function_call`` item: the chat call's id is the ``call_id`` the client answers with."""
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
    }


def failure(err: ApiError) -> dict[str, Any]:
    """A response's ``error``: ResponseError's codes tell a refused prompt from a server fault."""
    return {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}


@dataclass
class Answer:
    """What one generation produced, shaped: the output items, the status and the usage."""

    text: str | None  # None: no message (the answer was tool calls only)
    calls: list[dict[str, Any]]  # chat-shaped tool calls
    cut: bool  # stopped by max_output_tokens
    usage: dict[str, Any]
    stats: dict[str, Any]  # the ``colibri`` block
    message_id: str = field(default_factory=lambda: new_id("msg"))
    call_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.call_ids = self.call_ids or [new_id("fc") for _ in self.calls]

    @property
    def status(self) -> str:
        return "incomplete" if self.cut else "completed"

    def output(self) -> list[dict[str, Any]]:
        items = [] if self.text is None else [message_item(self.message_id, self.text, self.status)]
        return items + [function_call_item(c, i) for c, i in zip(self.calls, self.call_ids, strict=True)]


@dataclass(frozen=True)
class ResponseEnvelope:
    """One response's id, model, creation time, and the request fields every copy repeats."""

    model: str
    echo: dict[str, Any]  # instructions, tools, tool_choice, temperature, text... as requested
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The response object; ``store`` is false: colibri keeps no response after answering."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            "usage": None,
            **self.echo,
            **extra,
        }

    def final(self, answer: Answer) -> dict[str, Any]:
        """The finished response: completed, or incomplete when the budget cut it."""
        return self.response(
            answer.status,
            answer.output(),
            completed_at=int(time.time()),
            incomplete_details={"reason": LENGTH_REASON} if answer.cut else None,
            usage=answer.usage,
            colibri=answer.stats,
        )


class EventStream:
    """A response's SSE events, numbered in order; each method returns the frames to send."""

    def __init__(self, env: ResponseEnvelope) -> None:
        self.env, self.seq = env, 0

    def frame(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self) -> list[bytes]:
        started = self.env.response("in_progress", [])
        return [self.frame("response.created", response=started),
                self.frame("response.in_progress", response=started)]

    def message_start(self, index: int, item_id: str) -> list[bytes]:
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self.frame("response.output_item.added", output_index=index,
                       item=message_item(item_id, None, "in_progress")),
            self.frame("response.content_part.added", **where, part=output_text("")),
        ]

    def text_delta(self, index: int, item_id: str, delta: str) -> bytes:
        return self.frame("response.output_text.delta", item_id=item_id, output_index=index,
                          content_index=0, delta=delta, logprobs=[])

    def message_end(self, index: int, item_id: str, text: str, status: str) -> list[bytes]:
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self.frame("response.output_text.done", **where, text=text, logprobs=[]),
            self.frame("response.content_part.done", **where, part=output_text(text)),
            self.frame("response.output_item.done", output_index=index,
                       item=message_item(item_id, text, status)),
        ]

    def function_call(self, index: int, call: dict[str, Any], item_id: str) -> list[bytes]:
        """One tool call, whole: its arguments in one delta (the answer was parsed at its end)."""
        args = call["function"]["arguments"]
        where = {"item_id": item_id, "output_index": index}
        return [
            self.frame("response.output_item.added", output_index=index,
                       item=function_call_item(call, item_id, "in_progress", arguments="")),
            self.frame("response.function_call_arguments.delta", **where, delta=args),
            self.frame("response.function_call_arguments.done", **where, arguments=args,
                       name=call["function"]["name"]),
            self.frame("response.output_item.done", output_index=index,
                       item=function_call_item(call, item_id)),
        ]

    def calls(self, answer: Answer, first_index: int) -> list[bytes]:
        out: list[bytes] = []
        for n, (call, item_id) in enumerate(zip(answer.calls, answer.call_ids, strict=True)):
            out += self.function_call(first_index + n, call, item_id)
        return out

    def closing(self, answer: Answer) -> bytes:
        kind = "response.incomplete" if answer.cut else "response.completed"
        return self.frame(kind, response=self.env.final(answer))

    def failed(self, err: ApiError) -> list[bytes]:
        """After the headers a failure is an ``error`` event, then ``response.failed``."""
        return [
            self.frame("error", code=err.code or err.type, message=err.message, param=err.param),
            self.frame("response.failed", response=self.env.response("failed", [], error=failure(err))),
        ]
