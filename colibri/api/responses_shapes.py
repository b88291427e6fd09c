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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from colibri.api.ids import new_id
from colibri.api.shaping import Answer

if TYPE_CHECKING:
    from colibri.api.generation import Piece
    from colibri.api.openai_errors import ApiError
    from colibri.api.responses_api import ResponsesRequest

LENGTH_REASON = "max_output_tokens"  # incomplete_details.reason of an answer cut by its budget


def response_usage(answer: Answer) -> dict[str, Any]:
    """``cached_tokens``: prompt tokens the KV slot already held. ``cache_write_tokens`` (newer SDKs
    require it) is 0: OpenAI bills cache writes, colibri does not."""
    return {
        "input_tokens": answer.prompt_tokens,
        "input_tokens_details": {"cached_tokens": answer.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": answer.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def status_of(answer: Answer) -> str:
    """Incomplete when the budget (``max_output_tokens``) cut the answer."""
    return "incomplete" if answer.finish == "length" else "completed"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A thinking model's reasoning, whole, as reasoning text (no summary: colibri writes none);
    ``text`` None: still to come (a stream's first event)."""
    content = [] if text is None else [reasoning_text(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; ``text`` None: its content is still to come (a stream's first event)."""
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(call: dict[str, Any], item_id: str, status: str = "completed",
                       arguments: str | None = None, namespace: str | None = None) -> dict[str, Any]:
    """A chat-shaped tool call (``{"id", "type", "function": {"name", "arguments"}}``) as a
    Responses ``function_call`` item: the chat call's id is the ``call_id`` the client answers with;
    a function offered in a ``namespace`` names it (as OpenAI's items do), so the client finds it."""
    fn = call["function"]
    extra = {} if namespace is None else {"namespace": namespace}
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
        **extra,
    }


def failure(err: ApiError) -> dict[str, Any]:
    """A response's ``error``: ResponseError's codes tell a refused prompt from a server fault."""
    return {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}


@dataclass(frozen=True)
class ResponseEnvelope:
    """One response's id, model, creation time, and the request fields every copy repeats."""

    model: str
    echo: dict[str, Any]  # instructions, tools, tool_choice, temperature, text... as requested
    id: str = field(default_factory=lambda: new_id("resp_"))
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

    def final(self, answer: Answer, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response: completed, or incomplete when the budget cut it."""
        cut = answer.finish == "length"
        return self.response(
            status_of(answer),
            output,
            completed_at=int(time.time()),
            incomplete_details={"reason": LENGTH_REASON} if cut else None,
            usage=response_usage(answer),
            colibri=answer.stats,
        )


# An event before it is numbered: its type and its fields.
Event = tuple[str, dict[str, Any]]


class EventStream:
    """A response's SSE events. Each method returns events, unnumbered; ``send`` numbers them as
    they go out, in the order they are sent, so the numbers count up whatever order the events
    were built in (a message's opening built after its first delta, say)."""

    def __init__(self, env: ResponseEnvelope) -> None:
        self.env, self.seq = env, 0

    @staticmethod
    def frame(kind: str, **fields: Any) -> Event:
        return kind, fields

    def send(self, events: list[Event]) -> list[bytes]:
        """The events' SSE frames, numbered from the stream's next ``sequence_number``."""
        frames = []
        for kind, fields in events:
            payload = {"type": kind, "sequence_number": self.seq, **fields}
            self.seq += 1
            frames.append(f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())
        return frames

    def opening(self) -> list[Event]:
        started = self.env.response("in_progress", [])
        return [self.frame("response.created", response=started),
                self.frame("response.in_progress", response=started)]

    def _opened(self, index: int, item_id: str, item: dict[str, Any], part: dict[str, Any]) -> list[Event]:
        """An output item with one content part, opened (a message's or a reasoning's)."""
        return [
            self.frame("response.output_item.added", output_index=index, item=item),
            self.frame("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                       part=part),
        ]

    def _closed(self, index: int, item_id: str, done: str, text: str, part: dict[str, Any],
                item: dict[str, Any], **extra: Any) -> list[Event]:
        """Its text done (event ``done``), its part done, the item done."""
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self.frame(done, **where, text=text, **extra),
            self.frame("response.content_part.done", **where, part=part),
            self.frame("response.output_item.done", output_index=index, item=item),
        ]

    def message_start(self, index: int, item_id: str) -> list[Event]:
        return self._opened(index, item_id, message_item(item_id, None, "in_progress"), output_text(""))

    def text_delta(self, index: int, item_id: str, delta: str) -> Event:
        return self.frame("response.output_text.delta", item_id=item_id, output_index=index,
                          content_index=0, delta=delta, logprobs=[])

    def message_end(self, index: int, item_id: str, text: str, status: str) -> list[Event]:
        return self._closed(index, item_id, "response.output_text.done", text, output_text(text),
                            message_item(item_id, text, status), logprobs=[])

    def reasoning_start(self, index: int, item_id: str) -> list[Event]:
        return self._opened(index, item_id, reasoning_item(item_id, None, "in_progress"), reasoning_text(""))

    def reasoning_delta(self, index: int, item_id: str, delta: str) -> Event:
        return self.frame("response.reasoning_text.delta", item_id=item_id, output_index=index,
                          content_index=0, delta=delta)

    def reasoning_end(self, index: int, item_id: str, text: str, status: str) -> list[Event]:
        return self._closed(index, item_id, "response.reasoning_text.done", text, reasoning_text(text),
                            reasoning_item(item_id, text, status))

    def function_call(self, index: int, call: dict[str, Any], item_id: str,
                      namespace: str | None = None) -> list[Event]:
        """One tool call, whole: its arguments in one delta (the answer was parsed at its end)."""
        args = call["function"]["arguments"]
        where = {"item_id": item_id, "output_index": index}
        return [
            self.frame("response.output_item.added", output_index=index,
                       item=function_call_item(call, item_id, "in_progress", "", namespace)),
            self.frame("response.function_call_arguments.delta", **where, delta=args),
            self.frame("response.function_call_arguments.done", **where, arguments=args,
                       name=call["function"]["name"]),
            self.frame("response.output_item.done", output_index=index,
                       item=function_call_item(call, item_id, namespace=namespace)),
        ]

    def failed(self, err: ApiError) -> list[Event]:
        """After the headers a failure is an ``error`` event, then ``response.failed``."""
        return [
            self.frame("error", code=err.code or err.type, message=err.message, param=err.param),
            self.frame("response.failed", response=self.env.response("failed", [], error=failure(err))),
        ]


class ResponsesShaper:
    """One response: a thinking model's reasoning item first, its text as it comes; then the
    message item, its text deltas as they come; with tools offered (held), the message and the
    ``function_call`` items once the answer is whole."""

    endpoint = "/v1/responses"

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.env = ResponseEnvelope(model, request.echo)
        self.events = EventStream(self.env)
        self.held = request.parse_tools
        self.thinks = request.gen.reasoning  # a reasoning item may come first: the message waits
        self.message_id, self.reasoning_id = new_id("msg_"), new_id("rs_")
        self.call_ids: list[str] = []
        self.namespaces = request.namespaces  # a function's namespace, named on its calls
        self.reasoning: str | None = None  # the reasoning streamed so far; None: no item begun
        self.reasoning_done = False
        self.message_open = False

    @property
    def first(self) -> int:
        """The message's output index: after the reasoning item, if there is one."""
        return int(self.reasoning is not None)

    def output(self, answer: Answer) -> list[dict[str, Any]]:
        """The output items: the reasoning, the message (unless the answer only calls, or only
        reasoned), then the calls."""
        self.call_ids = self.call_ids or [new_id("fc_") for _ in answer.calls]
        calls = [function_call_item(c, i, namespace=self.namespace(c))
                 for c, i in zip(answer.calls, self.call_ids, strict=True)]
        items = []
        if answer.reasoning:
            items.append(reasoning_item(self.reasoning_id, answer.reasoning, self._reasoning_status(answer)))
        if self._has_message(answer):
            items.append(message_item(self.message_id, answer.text, status_of(answer)))
        return [*items, *calls]

    def namespace(self, call: dict[str, Any]) -> str | None:
        return self.namespaces.get(call["function"]["name"])

    @staticmethod
    def _has_message(answer: Answer) -> bool:
        return answer.text is not None and not (answer.reasoning and not answer.text)

    @staticmethod
    def _reasoning_status(answer: Answer) -> str:
        """Incomplete when the budget cut the reply before its answer began."""
        cut = answer.finish == "length" and not answer.text and not answer.calls
        return "incomplete" if cut else "completed"

    def opening(self) -> list[bytes]:
        if self.held or self.thinks:
            return self.events.send(self.events.opening())
        self.message_open = True
        return self.events.send(self.events.opening() + self.events.message_start(0, self.message_id))

    def delta(self, piece: Piece) -> list[bytes]:
        return self.events.send(self._delta(piece))

    def _delta(self, piece: Piece) -> list[Event]:
        frames: list[Event] = []
        if piece.reasoning:
            if self.reasoning is None:
                self.reasoning = ""
                frames += self.events.reasoning_start(0, self.reasoning_id)
            self.reasoning += piece.reasoning
            frames.append(self.events.reasoning_delta(0, self.reasoning_id, piece.reasoning))
        if self.held or not piece.text:
            return frames
        frames += self._end_reasoning("completed")
        if not self.message_open:
            self.message_open = True
            frames += self.events.message_start(self.first, self.message_id)
        return [*frames, self.events.text_delta(self.first, self.message_id, piece.text)]

    def _end_reasoning(self, status: str) -> list[Event]:
        if self.reasoning is None or self.reasoning_done:
            return []
        self.reasoning_done = True
        return self.events.reasoning_end(0, self.reasoning_id, self.reasoning, status)

    def closing(self, answer: Answer) -> list[bytes]:
        return self.events.send(self._closing(answer))

    def _closing(self, answer: Answer) -> list[Event]:
        output, status = self.output(answer), status_of(answer)
        frames = self._end_reasoning(self._reasoning_status(answer))
        text, item_id, first = answer.text, self.message_id, self.first
        if self._has_message(answer):
            if not self.message_open:  # held, or no text came: the message's events at once
                frames += self.events.message_start(first, item_id)
                frames += [self.events.text_delta(first, item_id, text)] if text else []
            frames += self.events.message_end(first, item_id, text, status)
            first += 1
        for n, (call, call_id) in enumerate(zip(answer.calls, self.call_ids, strict=True)):
            frames += self.events.function_call(first + n, call, call_id, self.namespace(call))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*frames, self.events.frame(kind, response=self.env.final(answer, output))]

    def failed(self, err: ApiError) -> list[bytes]:
        return self.events.send(self.events.failed(err))

    def whole(self, answer: Answer) -> dict[str, Any]:
        return self.env.final(answer, self.output(answer))
