"""Every error the server answers, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

One constructor per situation, so a status, a type and a code that clients match on (the SDK maps
the status to an exception class; ``code`` tells a full queue from a timeout) are written once.
"""

from __future__ import annotations

import json
from typing import Any

# How much of a client's value an error message quotes: enough to recognise it, while a body's
# worth of text (a 4 MiB "role") is not echoed back.
MAX_SHOWN_CHARS = 80


class ApiError(Exception):
    """An HTTP error status with its OpenAI body; raised anywhere below a route, answered there."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        """The body as sent (no web framework in the way, e.g. ASGI middleware and static files)."""
        return json.dumps(self.body()).encode()


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut to MAX_SHOWN_CHARS (the repr of a long or deep value
    is built no further than that)."""
    if isinstance(value, str):
        return repr(value[:MAX_SHOWN_CHARS]) + ("..." if len(value) > MAX_SHOWN_CHARS else "")
    if isinstance(value, dict | list):
        return type(value).__name__  # no repr: its size and depth are the client's
    text = repr(value)
    return text[:MAX_SHOWN_CHARS] + ("..." if len(text) > MAX_SHOWN_CHARS else "")


# ----------------------------------------------------------------------------- the request


def bad(param: str, message: str) -> ApiError:
    """A request field the server refuses, named in ``param`` ("" for the body as a whole)."""
    return ApiError(400, message, param)


def too_many(param: str, count: int, limit: int) -> ApiError:
    """A list over its cap (messages, input items, tools, tool calls), in OpenAI's own words and
    code for an array over its maximum length."""
    return ApiError(400, f"Invalid '{param}': array too long. Expected an array with maximum length "
                         f"{limit}, but got an array with length {count} instead.", param,
                    code="array_above_max_length")


def grammar_too_large(param: str, size: int, limit: int) -> ApiError:
    """A schema or tool set whose grammar is over what the engine's SUBMIT takes (``io/mux.py``)."""
    return ApiError(400, f"'{param}' makes a grammar of {size} bytes, over the engine's limit of "
                         f"{limit} bytes: send a smaller schema, or fewer or smaller tools", param,
                    code="grammar_too_large")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"model {model!r} not found", "model", code="model_not_found")


def context_length_exceeded(used: int, limit: int, param: str, at_least: bool = False) -> ApiError:
    """OpenAI's own wording, word for word: clients recognise the overflow by it (litellm's
    ContextWindowExceededError, LangChain's), not only by the code. ``param``: "messages" (chat) or
    "prompt" (legacy completions), the thing the client is told to shorten. ``at_least``: ``used``
    is a bound from the text's length (a prompt refused untokenized)."""
    count = f"at least {used}" if at_least else str(used)
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your {param} resulted in "
        f"{count} tokens. Please reduce the length of the {param}.",
        param,
        code="context_length_exceeded",
    )


def ambiguous_framing() -> ApiError:
    """RFC 9112 6.3: Content-Length and Transfer-Encoding together may be a smuggling attempt."""
    return ApiError(
        400,
        "the request has both Content-Length and Transfer-Encoding: its length is ambiguous",
        code="ambiguous_framing",
    )


# ----------------------------------------------------------------------------- HTTP and the guards


def invalid_session_id(limit: int) -> ApiError:
    """The value is not quoted: a conversation key that breaks the rule may be anything."""
    return ApiError(400, f"X-Session-Id must be 1-{limit} characters of A-Z a-z 0-9 . _ : @ -",
                    "X-Session-Id", code="invalid_session_id")


def replica_unreachable() -> ApiError:
    """nginx's answer (``coli deploy nginx``) when no replica could be reached for a request."""
    return ApiError(502, "no colibri replica is reachable", type_="server_error", code="replica_unreachable")


def http_error(status: int, message: str) -> ApiError:
    """An error the web framework raised (404, 405, 408, 413, ...)."""
    return ApiError(status, message, type_="not_found_error" if status == 404 else "invalid_request_error")


def not_found() -> ApiError:
    return ApiError(404, "not found", type_="not_found_error")


def host_not_allowed() -> ApiError:
    return ApiError(421, "Host header not allowed", type_="invalid_request_error", code="host_not_allowed")


def origin_not_allowed(origin: str) -> ApiError:
    """A browser page of another origin (not the server's own, not a --cors-origin)."""
    return ApiError(
        403,
        f"Origin {shown(origin)} not allowed: not this server's own origin nor a --cors-origin",
        type_="permission_error",
        code="origin_not_allowed",
    )


def unsupported_media_type(content_type: str | None) -> ApiError:
    """A POST body not labelled JSON: what a cross-origin page can send without a CORS preflight."""
    got = f"got {shown(content_type)}" if content_type else "got none"
    return ApiError(
        415, f"Content-Type must be application/json ({got})", code="unsupported_media_type"
    )


def invalid_api_key() -> ApiError:
    return ApiError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")


def internal_error() -> ApiError:
    return ApiError(500, "internal error", type_="server_error")


# ----------------------------------------------------------------------------- capacity and the engine


def overloaded() -> ApiError:
    return ApiError(503, "too many requests in progress", type_="server_error", code="overloaded")


def server_busy(queue_full: bool) -> ApiError:
    """429: a full admission queue, or a wait for a slot past the queue timeout."""
    why = "the queue is full" if queue_full else "timed out waiting for a slot"
    return ApiError(
        429,
        f"server busy: {why}",
        type_="rate_limit_error",
        code="queue_full" if queue_full else "queue_timeout",
    )


def draining() -> ApiError:
    return ApiError(503, "the server is shutting down", type_="server_error")


def engine_not_ready(reason: str) -> ApiError:
    return ApiError(503, f"the engine is not ready: {reason}", type_="server_error")


def engine_refused(code: str) -> ApiError:
    return ApiError(500, f"the engine refused the request: {code}", type_="server_error")


def engine_stopped(reason: str) -> ApiError:
    return ApiError(503, f"the engine stopped: {reason}", type_="server_error")
