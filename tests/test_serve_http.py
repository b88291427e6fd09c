"""End-to-end tests of ``coli serve`` as an HTTP server: JSON errors for bad requests, body limits,
the Host header guard and CORS, health, metrics and experts, clients that leave, and connections
that must be closed (slow loris, idle keep-alive, ``Connection: close``).

One server for the module, its own: the shared flags with short body and keep-alive timeouts, so the
slow-loris connections, opened first and checked last (their waits overlap the other tests), are
closed within seconds rather than after the defaults' 30 and 15.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from serve_harness import (
    LONG_Q,
    SHARED_SERVER_ARGS,
    UI_ORIGIN,
    error_body,
    parse_response,
    raw_get,
    raw_request,
    read_to_close,
    sse_events,
    user,
    wait_until,
)

from colibri.api.app import MAX_BODY

BODY_TIMEOUT_S = 4.0  # seconds: --body-timeout (default 30)
KEEP_ALIVE_S = 4.0  # seconds: --keep-alive (default 15)
SERVER_ARGS = (*SHARED_SERVER_ARGS, "--body-timeout", str(BODY_TIMEOUT_S), "--keep-alive", str(KEEP_ALIVE_S))

# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def slowloris(server):
    """A client that sends headers promising a body, then nothing; and one that stays idle after a
    keep-alive request. The server must close both (checked late in the file, to overlap the waits)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:{server.port}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode())
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    idle.sendall(f"GET /health HTTP/1.1\r\nHost: localhost:{server.port}\r\n\r\n".encode())
    yield sock, idle, time.monotonic()
    sock.close()
    idle.close()


def test_slowloris_does_not_block_others(slowloris, http, client, server):
    assert http.get("/health").json()["status"] == "ok"
    r = client.chat.completions.create(model=server.model_id, messages=user("Hi"), max_tokens=2,
                                       temperature=0)
    assert r.choices[0].message.content is not None


# (checked again at the end of the file, test_slowloris_is_closed: the waits overlap the tests)


# ------------------------------------------------------------------------------------------ bad HTTP


@pytest.mark.parametrize(
    "method, path, content, status",
    [
        ("POST", "/v1/chat/completions", b'{"messages": [', 400),  # malformed JSON
        ("POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', 400),  # not UTF-8
        ("POST", "/v1/chat/completions", b'[{"role": "user", "content": "hi"}]', 400),  # an array
        ("POST", "/v1/completions", b"", 400),
        ("GET", "/v1/chat/completions", None, 405),
        ("GET", "/v1/completions", None, 405),
        ("DELETE", "/v1/models", None, 405),
        ("GET", "/v1/nonexistent", None, 404),
        ("POST", "/v1/nonexistent", b"{}", 404),
    ],
)
def test_bad_requests_get_json_errors(http, method, path, content, status):
    r = http.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error_body(r)


def test_body_over_limit_is_413(server):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {MAX_BODY + 1}\r\n"
            "Connection: close\r\n\r\n").encode()
    # Content-Length alone condemns it: the answer comes without the server reading the body.
    r = raw_request(server.base_url, head + b" " * 1024, timeout=20)
    assert r.status == 413
    assert r.headers.get("connection") == "close"
    assert r.json()["error"]["message"]


def test_chunked_body_over_limit_is_413(server):
    """No Content-Length: the limit bites while reading. The server answers before the body ends,
    and the connection must not be left half-read: the client's next request on it works."""

    def body():
        for _ in range(MAX_BODY // 65536 + 40):
            yield b" " * 65536

    with server.http(timeout=15) as h:
        try:
            r = h.post("/v1/chat/completions", content=body(), headers={"content-type": "application/json"})
        except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError):
            pass  # the server closed the connection on the unread rest, and the reset beat its 413
        else:
            assert r.status_code == 413
            assert r.headers.get("connection") == "close"  # so the client does not reuse it
            error_body(r)
        assert h.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------ guards


@pytest.mark.parametrize("host", ["evil.com", "evil.com:{port}", "localhost.evil.com:{port}"])
def test_host_header_refused(server, host):
    for target in ("/health", "/v1/models"):
        r = raw_get(server.base_url, target, host=host.format(port=server.port))
        assert r.status == 421
        assert r.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "localhost"])
def test_host_header_accepted(server, host):
    r = raw_get(server.base_url, "/v1/models", host=host.format(port=server.port))
    assert r.status == 200


def preflight(http, origin: str) -> httpx.Response:
    return http.options("/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os",
    })


@pytest.mark.parametrize("origin", ["http://localhost:5173", "tauri://localhost", UI_ORIGIN])
def test_cors_preflight_allowed(http, origin):
    r = preflight(http, origin)
    assert r.status_code in (200, 204)
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed
    simple = http.get("/v1/models", headers={"origin": origin})
    assert simple.headers["access-control-allow-origin"] == origin
    assert "x-colibri-queue-wait-ms" in simple.headers["access-control-expose-headers"]


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:5174", "null"])
def test_cors_disallowed_origin(http, origin):
    r = preflight(http, origin)
    assert "access-control-allow-origin" not in r.headers
    simple = http.get("/v1/models", headers={"origin": origin})
    assert "access-control-allow-origin" not in simple.headers


# ------------------------------------------------------------------------------------------ endpoints


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok"
    for key in ("active", "queued", "completed", "rejected", "cancelled"):
        assert isinstance(h[key], int) and h[key] >= 0, key
    assert h["completed"] >= 1  # the tests before this one generated


def test_metrics(http):
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE colibri_requests_total counter" in r.text
    assert 'colibri_requests_total{endpoint="/v1/chat/completions",status="200"}' in r.text


def test_experts(http):
    e = http.get("/experts").json()
    assert {"rows", "cols", "map", "hits", "seq"} <= set(e)
    assert isinstance(e["rows"], int) and isinstance(e["cols"], int) and isinstance(e["seq"], int)
    assert isinstance(e["map"], str) and isinstance(e["hits"], str)


def test_page_not_built(http):
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "not built" in r.text


def test_no_response_time_limit():
    """A stream lasts as long as its generation: Quart's default RESPONSE_TIMEOUT (60 s) cut long
    streams off mid-body (an incomplete chunked read, no [DONE]). Checked on the app, not with a
    minute-long stream."""
    from types import SimpleNamespace

    from colibri.api.app import create_app

    assert create_app(SimpleNamespace(web_dist=None)).config["RESPONSE_TIMEOUT"] is None


# ------------------------------------------------------------------------------------------ disconnect


def test_client_disconnect_frees_the_slot(server, client):
    with server.http() as h:
        before = h.get("/health").json()["cancelled"]
        body = {"messages": user(LONG_Q), "max_tokens": 400, "temperature": 0, "stream": True,
                "cache_slot": 3}
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            events = sse_events(r.iter_lines())
            next(events), next(events)  # the role chunk and a token: the generation runs
    # The connection is gone (the stream was left unread, so httpx closed it).
    with server.http() as h:
        wait_until(lambda: (j := h.get("/health").json())["active"] == 0 and j["cancelled"] > before,
                   10, what="the cancelled stream to free its slot")
    r = client.chat.completions.create(model=server.model_id, messages=user("Hi"), max_tokens=2,
                                       temperature=0, extra_body={"cache_slot": 3})
    assert r.to_dict()["colibri"]["slot"] == 3


def test_connection_close_is_honoured(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: localhost:{server.port}\r\nConnection: close\r\n\r\n"
                     .encode())
        assert parse_response(read_to_close(sock, time.monotonic() + 10)).status == 200


# ------------------------------------------------------------------------------------------ late checks


def test_slowloris_is_closed(slowloris):
    sock, idle, opened = slowloris
    data = read_to_close(sock, opened + BODY_TIMEOUT_S + 30)
    if data:  # a 408 is polite; a plain close is enough
        assert parse_response(data).status == 408
    # The idle keep-alive connection: answered, then closed after the keep-alive timeout.
    data = read_to_close(idle, opened + KEEP_ALIVE_S + 30)
    assert parse_response(data).status == 200
