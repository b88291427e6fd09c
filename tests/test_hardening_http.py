"""End-to-end tests of the HTTP hardening on a real ``coli serve``: a foreign web page cannot
start generations (JSON content type required, foreign Origins refused before any work), odd but
valid JSON is a 400 naming the problem before any header (streamed or not), and a request framed
by both Content-Length and Transfer-Encoding is refused and its connection closed.

One server shared by the module (the end-to-end files' usual arguments: UI_ORIGIN is allowed).
"""

from __future__ import annotations

import socket
import time

import pytest
from serve_harness import (
    UI_ORIGIN,
    error_body,
    parse_response,
    raw_request,
    read_to_close,
)

CHAT = "/v1/chat/completions"
OK_BODY = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}'
# Far below the body timeout (30 s): an answer this fast was given without waiting for the body.
PROMPT_ANSWER_S = 10


def post(server, path: str, body: bytes, headers: dict[str, str] | None = None):
    """A POST as a browser or curl would send it; ``headers`` replace the JSON content type."""
    fields = {"content-type": "application/json", **(headers or {})}
    with server.http() as h:
        return h.post(path, content=body, headers={k: v for k, v in fields.items() if v is not None})


def completed(http) -> int:
    return http.get("/health").json()["completed"]


# ------------------------------------------------------------------------------------------ item 2


@pytest.mark.parametrize("content_type", [
    "text/plain",  # what a cross-origin form or fetch sends without a CORS preflight
    "text/plain; charset=utf-8",
    "application/x-www-form-urlencoded",  # curl -d without -H
    "multipart/form-data; boundary=x",
    "application/jsonp",
    None,  # no Content-Type at all
])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_post_without_json_content_type_is_415(server, http, path, content_type):
    body = OK_BODY if path == CHAT else b'{"prompt": "Hi", "max_tokens": 2}'
    before = completed(http)
    r = post(server, path, body, {"content-type": content_type})
    assert r.status_code == 415, r.text
    err = error_body(r)
    assert "application/json" in err["message"] and err["code"] == "unsupported_media_type"
    assert completed(http) == before  # no generation ran


def test_json_content_types_are_the_ones_served(server):
    """Media type parameters and case do not matter; the media type does."""
    for content_type in ("application/json", "application/json; charset=utf-8",
                         "Application/JSON;charset=UTF-8"):
        r = post(server, CHAT, OK_BODY, {"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text)
    assert post(server, CHAT, OK_BODY, {"content-type": "text/json"}).status_code == 415


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:5174",
                                    "http://localhost.evil.example:{port}", "http://127.0.0.1:1"])
def test_foreign_origin_is_403(server, http, origin):
    before = completed(http)
    r = post(server, CHAT, OK_BODY, {"origin": origin.format(port=server.port)})
    assert r.status_code == 403, r.text
    assert error_body(r)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert completed(http) == before


def test_foreign_origin_is_refused_before_the_body_is_read(server):
    """Headers promising a body that never comes: the answer must not wait for it."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost:{server.port}\r\nOrigin: http://evil.example\r\n"
            "Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n{").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        data = read_to_close(sock, time.monotonic() + PROMPT_ANSWER_S)
    r = parse_response(data)
    assert r.status == 403 and r.json()["error"]["code"] == "origin_not_allowed"


def test_wrong_content_type_is_refused_before_the_body_is_read(server):
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost:{server.port}\r\n"
            "Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n{").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        data = read_to_close(sock, time.monotonic() + PROMPT_ANSWER_S)
    assert parse_response(data).status == 415


def test_own_and_cors_origins_may_post_others_not(server):
    """The web console at / posts with its own origin, which names the Host it was served from; the
    CORS origins may post too. An Origin naming this port under another loopback name than the Host
    is not the page's own origin."""
    host = f"localhost:{server.port}"
    for origin in (f"http://{host}", f"http://LOCALHOST:{server.port}", UI_ORIGIN,
                   "http://localhost:5173", "tauri://localhost"):
        r = raw_post(server, origin, host)
        assert r.status == 200, (origin, r.body)
        assert r.headers.get("access-control-allow-origin") in (None, origin)
    assert raw_post(server, f"http://127.0.0.1:{server.port}", host).status == 403
    assert raw_post(server, f"https://{host}", f"{host}").status == 200  # behind a TLS proxy
    assert raw_post(server, f"ftp://{host}", host).status == 403


def raw_post(server, origin: str, host: str):
    """A chat POST with this Origin and Host, byte for byte."""
    body = OK_BODY.decode()
    req = (f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
           f"Connection: close\r\n\r\n{body}").encode()
    return raw_request(server.base_url, req)


def test_foreign_origin_get_is_403(http):
    r = http.get("/v1/models", headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and error_body(r)["code"] == "origin_not_allowed"


# ------------------------------------------------------------------------------------------ item 4

CHAT_SURROGATE = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2'
NASTY = {
    "surrogate_content": (CHAT, CHAT_SURROGATE + b"}", "messages[0].content"),
    "surrogate_text_part": (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", '
                                  b'"text": "\\udfff"}]}], "max_tokens": 2}', "messages[0].content"),
    "surrogate_stop": (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
                             b'"stop": ["\\ud83d"]}', "stop"),
    "surrogate_prompt": ("/v1/completions", b'{"prompt": "x\\udc00", "max_tokens": 2}', "prompt"),
    "deep": (CHAT, b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}", ""),
    "deep_top": (CHAT, b"[" * 10000 + b"]" * 10000, ""),
    "deep_role": (CHAT, b'{"messages": [{"role": ' + b"[" * 900 + b"]" * 900 + b', "content": "x"}]}', ""),
    "huge_int": (CHAT, b'{"messages": [], "max_tokens": 1' + b"0" * 100000 + b"}", ""),
    "huge_temperature": (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], '
                               b'"temperature": 1' + b"0" * 400 + b"}", ""),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(NASTY))
def test_odd_json_is_400_before_any_header(server, case, stream):
    path, body, param = NASTY[case]
    if stream:
        body = body[:-1] + b', "stream": true}' if body.endswith(b"}") else body
    r = post(server, path, body)
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = error_body(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert len(err["message"]) < 300, err


def test_surrogate_message_names_the_problem(server):
    err = error_body(post(server, CHAT, CHAT_SURROGATE + b"}"))
    assert "surrogate" in err["message"] or "UTF-8" in err["message"], err


def test_depth_and_digits_are_named(server):
    assert "deep" in error_body(post(server, CHAT, NASTY["deep"][1]))["message"]
    assert "digits" in error_body(post(server, CHAT, NASTY["huge_int"][1]))["message"]


# ------------------------------------------------------------------------------------------ item 6


def ambiguous_request(port: int, body: bytes = OK_BODY) -> bytes:
    """A POST framed by both Content-Length and Transfer-Encoding: chunked (the chunks are the body)."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 7}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    return head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


def test_content_length_with_transfer_encoding_is_400_and_closed(server):
    """RFC 9112 6.3: a request framed both ways must be refused (or answered) and its connection
    closed after the answer, since a proxy in front may have framed it the other way."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(ambiguous_request(server.port))
        data = read_to_close(sock, time.monotonic() + PROMPT_ANSWER_S)
    r = parse_response(data)
    assert r.status == 400, data[:300]
    assert r.headers.get("connection") == "close"
    assert r.json()["error"]["code"] == "ambiguous_framing"
    # Chunked alone is one framing: served.
    body = OK_BODY
    req = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost:{server.port}\r\nContent-Type: application/json\r\n"
           "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    req += f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    assert raw_request(server.base_url, req).status == 200


def test_a_smuggled_request_is_never_answered(server):
    """A request pipelined after the ambiguous one (what a proxy framing it by Content-Length would
    take for part of the body) is never read: the connection closes after the 400. Repeated: the
    400's send can race hypercorn's close, and a lost 400 would show only some of the time."""
    smuggled = f"GET /v1/models HTTP/1.1\r\nHost: localhost:{server.port}\r\n\r\n".encode()
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(ambiguous_request(server.port) + smuggled)
            data = read_to_close(sock, time.monotonic() + PROMPT_ANSWER_S)
        assert data.count(b"HTTP/1.1 ") == 1 and b'"object": "list"' not in data, data
        assert parse_response(data).status == 400
