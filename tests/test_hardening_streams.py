"""Streams whose client stops reading or leaves early give their KV slot back (issue 38, item 4).

A client that leaves between the route's return and the stream's first frame never starts the body,
so the serving path's clean-up never runs: the server's outermost middleware releases the lease
(scripted engine, the whole ASGI stack). A client that stops reading a stream is disconnected after
``--write-timeout`` and its slot freed (the real server and engine, a raw socket that never reads).
A body whose framing breaks after the app has refused the request from its headers alone no longer
ends the server.
"""

from __future__ import annotations

import json
import socket

import httpx
import trio
from serve_harness import LONG_Q, running_server, wait_until
from test_api_generation import ScriptedEngine, done, state_for, token

from colibri.api.app import create_app
from colibri.api.http_server import ConcurrencyLimit

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}


def _scope(body: bytes) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }


async def test_a_client_gone_before_the_first_frame_frees_its_slot():
    state = state_for(ScriptedEngine([*token("Hi"), done(1)]))
    app = ConcurrencyLimit(create_app(state, 1 << 20, 30.0), 8, state)
    body = json.dumps(CHAT).encode()
    headers_sent = trio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            sent.append({"type": "http.request"})
            return {"type": "http.request", "body": body, "more_body": False}
        await headers_sent.wait()
        return {"type": "http.disconnect"}  # the client is gone as the headers go out

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            headers_sent.set()
            await trio.sleep(5)  # the headers take a while: the disconnect arrives meanwhile

    with trio.fail_after(10):
        await app(_scope(body), receive, send)
    assert not any(m["type"] == "http.response.body" for m in sent)  # the body never started
    assert state.admission.active == 0  # the slot is free
    assert state.counters["cancelled"] == 1  # and the request counted, once


def test_a_client_that_stops_reading_is_cut_off_and_its_slot_freed():
    """One slot: a stream whose client never reads would hold it for good; with --write-timeout 2
    the server drops that connection once its window stays closed, and the next client is served
    instead of getting a 429 after the queue timeout."""
    with running_server("--kv-slots", "1", "--ctx", "4096", "--write-timeout", "2",
                        "--max-queue", "1", "--queue-timeout", "240") as srv:
        body = json.dumps({**CHAT, "max_tokens": 3000, "temperature": 1.0, "seed": 1,
                           "messages": [{"role": "user", "content": LONG_Q}]}).encode()
        staller = socket.socket()
        staller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a window that fills at once
        staller.connect(("127.0.0.1", srv.port))
        staller.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            wait_until(lambda: httpx.get(srv.base_url + "/health").json()["active"] == 1, 60,
                       what="the stalled stream admitted")
            answer = srv.client().chat.completions.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].finish_reason in ("stop", "length")
            health = httpx.get(srv.base_url + "/health").json()
            assert health["cancelled"] == 1 and health["active"] == 0, health
        finally:
            staller.close()


def test_a_broken_chunk_after_an_early_refusal_leaves_the_server_up():
    """No Content-Type: the app refuses (415) before the body is read, while hypercorn's reader
    meets an illegal chunk header and answers 400 on the same socket: that clash (a
    BusyResourceError out of hypercorn) ended the server. Now the refusal waits for the body's end."""
    with running_server("--ctx", "512") as srv:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
                answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 4"), answer
            assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        assert srv.proc.poll() is None
        assert "Traceback" not in srv.log


def test_a_client_gone_mid_body_leaves_no_traceback():
    """A body over --max-body-mb is answered 413 from its Content-Length while the client is still
    sending; the client then closes. hypercorn's close clashed with the answer's send (10 in 60
    logged "Error in ASGI Framework" with a BusyResourceError): a client gone is no app error."""
    with running_server("--ctx", "512") as srv:
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\n"
                             + f"Content-Length: {(4 << 20) + 1}\r\n\r\n".encode() + b" " * 1024)
                assert sock.recv(65536).startswith(b"HTTP/1.1 413")
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        log = "\n".join(srv.lines)
        assert "Error in ASGI Framework" not in log and "Traceback" not in log, log[-3000:]
