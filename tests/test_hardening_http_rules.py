"""Unit tests of the HTTP hardening rules, without a server: which Origins and Content-Types
a request may carry (``colibri.api.security``), ambiguous HTTP/1.1 framing, and request bodies that
are valid JSON yet no request (lone surrogates, deep nesting, huge integers), which must be a 400
naming the problem (``colibri.api.openai_requests``)."""

from __future__ import annotations

import pytest

from colibri.api.openai_errors import MAX_SHOWN_CHARS, ApiError, shown
from colibri.api.openai_requests import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    parse_chat,
    parse_completion,
    parse_json,
)
from colibri.api.security import (
    CorsPolicy,
    ambiguous_framing_headers,
    is_json_content_type,
    origin_allowed,
    same_origin,
)

N_CTX, N_SLOTS = 1024, 4


def render(messages: list[dict[str, str]], thinking: bool) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


# ------------------------------------------------------------------------------------------ Origin


@pytest.mark.parametrize(("origin", "host", "same"), [
    ("http://localhost:8000", "localhost:8000", True),
    ("http://LOCALHOST:8000/", "localhost:8000", True),
    ("https://localhost:8000", "localhost:8000", True),  # a TLS proxy's page
    ("http://[::1]:8000", "[::1]:8000", True),
    ("http://localhost", "localhost", True),
    ("http://localhost:80", "localhost", True),  # the scheme's default port
    ("https://localhost", "localhost:80", False),
    ("http://127.0.0.1:8000", "localhost:8000", False),  # another name: another origin
    ("http://localhost:8001", "localhost:8000", False),
    ("http://localhost:8000", None, False),
    ("http://localhost:8000/path", "localhost:8000", False),
    ("http://user@localhost:8000", "localhost:8000", False),
    ("tauri://localhost", "localhost", False),  # only http(s) pages can be the server's own
    ("null", "localhost:8000", False),
    ("", "localhost:8000", False),
])
def test_same_origin(origin: str, host: str | None, same: bool) -> None:
    assert same_origin(origin, host) is same


def test_origin_allowed() -> None:
    cors = CorsPolicy(["https://ui.example"])
    assert origin_allowed(None, "localhost:8000", cors)  # not a browser's cross-origin request
    assert origin_allowed("https://ui.example", "localhost:8000", cors)
    assert origin_allowed("http://localhost:5173", "localhost:8000", cors)  # a default
    assert origin_allowed("http://localhost:8000", "localhost:8000", cors)  # its own page
    for foreign in ("http://evil.example", "null", "", "http://localhost:8001"):
        assert not origin_allowed(foreign, "localhost:8000", cors), foreign
    assert origin_allowed("http://evil.example", "localhost:8000", CorsPolicy(["*"]))


# ------------------------------------------------------------------------------------------ Content-Type


@pytest.mark.parametrize(("value", "ok"), [
    ("application/json", True),
    ("application/json; charset=utf-8", True),
    ("APPLICATION/JSON ;charset=UTF-8", True),
    (" application/json", True),
    (None, False),
    ("", False),
    ("text/plain", False),
    ("text/plain; a=application/json", False),
    ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False),
    ("application/jsonp", False),
    ("application/json-seq", False),
])
def test_json_content_type(value: str | None, ok: bool) -> None:
    assert is_json_content_type(value) is ok


# ------------------------------------------------------------------------------------------ framing


def test_ambiguous_framing_headers() -> None:
    cl, te = (b"content-length", b"5"), (b"transfer-encoding", b"chunked")
    assert ambiguous_framing_headers([cl, te])
    assert ambiguous_framing_headers([(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"5")])
    assert not ambiguous_framing_headers([cl])
    assert not ambiguous_framing_headers([te])
    assert not ambiguous_framing_headers([])


# ------------------------------------------------------------------------------------------ bodies


def test_deep_nesting_is_a_400() -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 5000 + b"1" + b"}" * 5000):
        err = refused(parse_json, raw)
        assert err.param == "" and "deep" in err.message
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(ok) is not None
    refused(parse_json, b"[" + ok + b"]")
    # Brackets inside strings are text, not nesting.
    assert parse_json(b'{"prompt": "' + b"[" * 1000 + b'"}') == {"prompt": "[" * 1000}


def test_huge_integers_are_a_400() -> None:
    for digits in (100_000, 5000, MAX_INT_DIGITS + 1):
        err = refused(parse_json, b'{"max_tokens": 1' + b"0" * (digits - 1) + b"}")
        assert "digits" in err.message and str(digits) in err.message
    assert parse_json(b'{"seed": -' + b"9" * MAX_INT_DIGITS + b"}")["seed"] == -int("9" * MAX_INT_DIGITS)
    assert parse_json(b'{"prompt": "' + b"7" * 1000 + b'"}')  # digits in a string are text


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_constants_are_a_400(constant: bytes) -> None:
    refused(parse_json, b'{"temperature": ' + constant + b"}")


def test_a_huge_number_in_a_field_is_a_400() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 10**400}
    assert refused(parse_chat, body, render, N_CTX, N_SLOTS).param == "temperature"
    body = {"prompt": "hi", "top_p": -(10**400)}
    assert refused(parse_completion, body, N_CTX, N_SLOTS).param == "top_p"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": "\udc00"}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": "\ud83d"}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "x\ud83d"]}, "stop"),
])
def test_lone_surrogates_in_chat_are_a_400(body: dict, param: str) -> None:
    err = refused(parse_chat, body, render, N_CTX, N_SLOTS)
    assert err.param == param and "surrogate" in err.message


def test_lone_surrogates_in_completions_are_a_400() -> None:
    assert refused(parse_completion, {"prompt": "x\udc00"}, N_CTX, N_SLOTS).param == "prompt"
    assert refused(parse_completion, {"prompt": ["\ud800"]}, N_CTX, N_SLOTS).param == "prompt"
    body = {"prompt": "x", "stop": "\ud800"}
    assert refused(parse_completion, body, N_CTX, N_SLOTS).param == "stop"
    # JSON's escaped pair for one character outside the BMP is text, not a lone surrogate.
    body = parse_json(b'{"prompt": "\\ud83d\\ude00", "stop": "\\ud83d\\ude00"}')
    gen = parse_completion(body, N_CTX, N_SLOTS)
    assert gen.prompt == "\U0001f600" and gen.stops == ["\U0001f600"]


def test_a_template_refusal_is_a_400() -> None:
    """A chat template's raise_exception (say, roles that must alternate) is about the messages."""
    from colibri.errors import ColibriError

    def strict(messages: list[dict[str, str]], thinking: bool) -> str:
        raise ColibriError("chat template: roles must alternate")

    err = refused(parse_chat, {"messages": [{"role": "user", "content": "hi"}]}, strict, N_CTX, N_SLOTS)
    assert err.param == "messages" and "alternate" in err.message


def test_error_messages_quote_client_values_briefly() -> None:
    role = "r" * 100_000
    err = refused(parse_chat, {"messages": [{"role": role, "content": "x"}]}, render, N_CTX, N_SLOTS)
    assert len(err.message) < 2 * MAX_SHOWN_CHARS
    err = refused(parse_chat, {"messages": [{"role": "user", "content": [{"type": [[1] * 10]}]}]},
                  render, N_CTX, N_SLOTS)
    assert len(err.message) < 2 * MAX_SHOWN_CHARS
    err = refused(parse_completion, {"prompt": "x", "k" * 100_000: 1}, N_CTX, N_SLOTS)
    assert len(err.message) < 2 * MAX_SHOWN_CHARS
    assert shown("abc") == "'abc'" and shown(None) == "None" and shown([1]) == "list"
