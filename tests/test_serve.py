"""End-to-end tests of ``coli serve``: a real server process, the real default model, the official
OpenAI SDK as the client (httpx and raw sockets where the bytes on the wire are the point).

One module-scoped server carries most tests; servers with other settings (an API key and a web
page, a non-loopback bind, sd_notify and SIGTERM, an engine to kill) are started where needed.
Generations are greedy and short, so the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_harness import (
    NotifySocket,
    ServerProcess,
    child_pids,
    parse_response,
    pid_alive,
    raw_get,
    raw_request,
    read_sse,
    read_to_close,
    running_server,
    serve_command,
    server_env,
    sse_events,
    wait_until,
)

from colibri.api.app import BODY_TIMEOUT_S, MAX_BODY
from colibri.api.server import KEEP_ALIVE_S

CHAT_Q = "Tell me a story about the sea."
CHAT_N = 8  # tokens of the greedy chat reference
LEGACY_N = 10
LONG_Q = "Write a very long story about a dragon, with many chapters."
LEGACY_PROMPT = "Once upon a time"
SECRET = "TOPSECRET-7d1f"
UI_ORIGIN = "https://ui.example"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def server():
    # --web-dist names no directory: the page is "not built", whatever the checkout holds.
    srv = ServerProcess.start("--cors-origin", UI_ORIGIN, "--web-dist", "/nonexistent/web/dist",
                              "--ctx", "1024")
    try:
        yield srv
    except BaseException:
        srv.kill()
        raise
    code = srv.stop()
    assert code == 0, f"coli serve exited {code}:\n{srv.log}"


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


@pytest.fixture(scope="module")
def chat_ref(client, server):
    """The greedy answer to CHAT_Q, with logprobs: the reference for several tests."""
    return client.chat.completions.create(
        model=server.model_id, messages=user(CHAT_Q), max_tokens=CHAT_N, temperature=0,
        logprobs=True, top_logprobs=3,
    )


@pytest.fixture(scope="module")
def legacy_ref(client, server):
    return client.completions.create(
        model=server.model_id, prompt=LEGACY_PROMPT, max_tokens=LEGACY_N, temperature=0, logprobs=2
    )


def check_usage(usage, max_tokens: int, finish: str) -> None:
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == max_tokens


def error_body(response) -> dict:
    """An OpenAI-shaped error body: {"error": {"message", "type", ...}}."""
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    assert isinstance(body["error"].get("message"), str) and body["error"].get("type"), body
    return body["error"]


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


# ------------------------------------------------------------------------------------------ chat


def test_chat_completion(chat_ref):
    choice = chat_ref.choices[0]
    assert chat_ref.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"  # a few tokens do not finish a story
    check_usage(chat_ref.usage, CHAT_N, choice.finish_reason)
    stats = chat_ref.to_dict()["colibri"]
    assert stats["stats"]["emitted"] == CHAT_N and stats["stats"]["length_limited"] is True
    assert 0 <= stats["slot"] < 4


def test_chat_stream_equals_json(client, server, chat_ref):
    stream = client.chat.completions.create(
        model=server.model_id, messages=user(CHAT_Q), max_tokens=CHAT_N, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=1,
    )
    chunks = list(stream)
    # Each chunk carries the logprobs of the tokens whose text it carries.
    entries = []
    for c in chunks:
        if not c.choices or not c.choices[0].delta.content:
            continue
        lp = c.choices[0].logprobs
        assert lp is not None and lp.content, c
        assert "".join(e.token for e in lp.content) == c.choices[0].delta.content
        entries += lp.content
    assert [e.token for e in entries] == [e.token for e in chat_ref.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_ref.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0].choices == []
    assert with_usage[0].usage.to_dict() == chat_ref.usage.to_dict()
    # After the usage chunk only the colibri stats frame (choices == [], no usage) may follow.
    after = chunks[chunks.index(with_usage[0]) + 1 :]
    assert all(c.choices == [] and c.usage is None for c in after)
    assert chunks[0].choices[0].delta.role == "assistant"


def test_raw_sse_ends_with_stats_frame_then_done(http):
    body = {"messages": user(CHAT_Q), "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert int(r.headers["x-colibri-queue-wait-ms"]) >= 0
        events = read_sse(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    frames = [json.loads(e) for e in events[:-1]]
    stats = frames[-1]
    assert stats["choices"] == [] and "colibri" in stats
    assert stats["colibri"]["stats"]["emitted"] == 4
    assert frames[-2]["choices"][0]["finish_reason"] == "length"
    assert all("error" not in f for f in frames)


def test_queue_wait_header(client, server):
    raw = client.chat.completions.with_raw_response.create(
        model=server.model_id, messages=user("Hi"), max_tokens=2, temperature=0
    )
    assert int(raw.headers["x-colibri-queue-wait-ms"]) >= 0
    parsed = raw.parse()
    assert parsed.choices[0].message.content is not None
    assert "colibri" in parsed.to_dict()


# ------------------------------------------------------------------------------------------ legacy


def test_completion(legacy_ref):
    choice = legacy_ref.choices[0]
    assert legacy_ref.object == "text_completion"
    assert choice.text and choice.finish_reason == "length"
    check_usage(legacy_ref.usage, LEGACY_N, "length")
    assert "colibri" in legacy_ref.to_dict()


def test_completion_stream(client, server, legacy_ref):
    chunks = list(client.completions.create(
        model=server.model_id, prompt=LEGACY_PROMPT, max_tokens=LEGACY_N, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == legacy_ref.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == LEGACY_N


def test_completion_logprobs(legacy_ref):
    lp = legacy_ref.choices[0].logprobs
    n = legacy_ref.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == legacy_ref.choices[0].text
    for i, (tok, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                strict=True)):
        assert logprob <= 0
        assert len(top) == 2 and all(v <= 0 for v in top.values())
        assert max(top, key=top.get) == tok  # greedy: the chosen token is the most likely
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


# ------------------------------------------------------------------------------------------ logprobs


def test_chat_logprobs(chat_ref):
    content = chat_ref.choices[0].logprobs.content
    assert len(content) == chat_ref.usage.completion_tokens
    assert "".join(e.token for e in content) == chat_ref.choices[0].message.content
    for e in content:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy
        assert e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes) == e.token.encode()


# ------------------------------------------------------------------------------------------ stop


def _stop_inside(tokens: list[str]) -> tuple[str, str]:
    """A 3-character stop string spanning the token boundary mid-output, and the text before it."""
    text = "".join(tokens)
    b = len("".join(tokens[: len(tokens) // 2]))
    assert 1 <= b < len(text) - 2, tokens
    stop = text[b - 1 : b + 2]
    return stop, text[: text.find(stop)]


def test_stop_string_chat(client, server, chat_ref):
    stop, expected = _stop_inside([e.token for e in chat_ref.choices[0].logprobs.content])
    r = client.chat.completions.create(
        model=server.model_id, messages=user(CHAT_Q), max_tokens=CHAT_N, temperature=0, stop=stop
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content


def test_stop_strings_legacy_stream(client, server, legacy_ref):
    stop, expected = _stop_inside(legacy_ref.choices[0].logprobs.tokens)
    stops = ["#never#", stop, "@@nope", "\u00a7\u00a7"]  # four: the most OpenAI allows
    chunks = list(client.completions.create(
        model=server.model_id, prompt=LEGACY_PROMPT, max_tokens=LEGACY_N, temperature=0, stop=stops,
        stream=True,
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]


def test_five_stops_refused(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model_id, messages=user("Hi"), max_tokens=4, stop=["a", "b", "c", "d", "e"]
        )
    assert e.value.body["param"] == "stop" and "stop" in e.value.body["message"]


def test_stop_then_same_slot_at_once(http):
    """A stop ends the request in the engine before its slot is free: the next request on that
    slot must not find it busy."""
    body = {"prompt": LEGACY_PROMPT, "max_tokens": LEGACY_N, "temperature": 0, "cache_slot": 2}
    first = http.post("/v1/completions", json={**body, "stop": [" the"]})
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    again = http.post("/v1/completions", json={**body, "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["colibri"]["slot"] == 2


# ------------------------------------------------------------------------------------------ seed


def test_seed_reproducible(client, server):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=server.model_id, messages=user("Write a poem about anything you like."),
            max_tokens=10, temperature=1.0, seed=seed,
        )
        return r.choices[0].message.content

    first, second = sample(42), sample(42)
    assert first == second
    others = [sample(7)]
    if others[0] == first:  # improbable over 10 tokens at temperature 1; one more seed settles it
        others.append(sample(1234))
    assert any(o != first for o in others)


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", dict(n=2)),
        ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        ("response_format", dict(response_format={"type": "json_object"})),
        ("presence_penalty", dict(presence_penalty=0.5)),
        ("logit_bias", dict(logit_bias={"42": 10})),
        ("frobnicate", dict(extra_body={"frobnicate": 1})),
        ("cache_slot", dict(extra_body={"cache_slot": 99})),
        ("temperature", dict(extra_body={"temperature": "hot"})),
        ("max_tokens", dict(max_tokens=-1)),
        ("stream", dict(extra_body={"stream": "yes"})),
        ("messages[0].content", dict(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}])),
    ],
)
def test_unsupported_or_invalid_field_is_400(client, server, field, kwargs):
    kwargs = {"messages": user("Hi"), "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == field, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert field in json.dumps(e.value.body)


def test_missing_messages_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body={"model": server.model_id}, cast_to=object)
    assert e.value.body["param"] == "messages"


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


def test_models(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids == [server.model_id]
    assert client.models.retrieve(server.model_id).id == server.model_id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


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


# ------------------------------------------------------------------------------------------ auth, page


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    (root / "secret.txt").write_text(SECRET)
    dist = root / "dist"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<!doctype html><title>colibri ui</title><div id=root></div>")
    (dist / "assets" / "app.js").write_text("console.log('colibri ui');")
    (dist / "leak.txt").symlink_to(root / "secret.txt")
    (dist / "assets" / "up").symlink_to(root, target_is_directory=True)
    return dist


@pytest.fixture(scope="module")
def keyed(site):
    """A server with an API key and a web page."""
    with running_server("--api-key", "secret", "--web-dist", str(site), "--kv-slots", "1",
                        "--ctx", "256") as srv:
        yield srv


def test_auth_missing_key(keyed):
    with keyed.http() as h:
        r = h.get("/v1/models")
        assert r.status_code == 401 and error_body(r)["type"] == "authentication_error"
        r = h.post("/v1/chat/completions", json={"messages": user("Hi"), "max_tokens": 2})
        assert r.status_code == 401


def test_auth_wrong_key(keyed):
    with keyed.client(api_key="wrong") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()
    with keyed.client(api_key="secretx") as c, pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model=keyed.model_id, messages=user("Hi"), max_tokens=2)


def test_auth_bearer(keyed):
    with keyed.client(api_key="secret") as c:
        assert [m.id for m in c.models.list()] == [keyed.model_id]
        r = c.chat.completions.create(model=keyed.model_id, messages=user("Hi"), max_tokens=2,
                                      temperature=0)
        assert r.usage.completion_tokens >= 1


def test_auth_x_api_key(keyed):
    with keyed.http() as h:
        assert h.get("/v1/models", headers={"x-api-key": "secret"}).status_code == 200
        assert h.get("/v1/models", headers={"x-api-key": "nope"}).status_code == 401


def test_health_needs_no_key(keyed):
    with keyed.http() as h:
        assert h.get("/health").json()["status"] == "ok"
        assert h.get("/metrics").status_code == 200


def test_page_served(keyed):
    for path in ("/", "/some/client/route", "/index.html"):
        r = raw_get(keyed.base_url, path)
        assert r.status == 200, path
        assert b"colibri ui" in r.body and r.headers["content-type"].startswith("text/html")
    r = raw_get(keyed.base_url, "/assets/app.js")
    assert r.status == 200 and r.body == b"console.log('colibri ui');"
    assert "javascript" in r.headers["content-type"]
    assert raw_get(keyed.base_url, "/assets/missing.js").status == 404


def test_api_paths_never_get_the_page(keyed):
    with keyed.http(headers={"authorization": "Bearer secret"}) as h:
        r = h.get("/v1/nonexistent")
        assert r.status_code == 404 and error_body(r)
        r = h.get("/v1/chat/completions")
        assert r.status_code == 405 and error_body(r)


@pytest.mark.parametrize("target", [
    "/../secret.txt",
    "/%2e%2e/secret.txt",
    "/%2E%2E/secret.txt",
    "/assets/%2e%2e/%2e%2e/secret.txt",
    "/assets/../../secret.txt",
    "//etc/passwd",
    "/..%2fsecret.txt",
    "/%2e%2e%2fsecret.txt",
    "/assets/..%5c..%5csecret.txt",
    "/assets/..\\..\\secret.txt",
    "/leak.txt",
    "/assets/up/secret.txt",
    "/assets/up/dist/../secret.txt",
    "/..;/secret.txt",
    "/%00/../secret.txt",
])
def test_page_path_escapes(keyed, target):
    try:
        r = raw_get(keyed.base_url, target)
    except ConnectionResetError:
        return  # refused outright
    assert SECRET.encode() not in r.body, (target, r.status)
    assert b"root:" not in r.body
    assert r.status < 500


# ------------------------------------------------------------------------------------------ binding


def test_non_loopback_bind_without_key_is_refused():
    env = server_env()
    p = subprocess.run(serve_command("--host", "0.0.0.0"), env=env, capture_output=True, timeout=120)
    assert p.returncode == 1
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "COLI_API_KEY" in lines[0] and "--insecure" in lines[0]


def test_non_loopback_bind_insecure_starts():
    with running_server("--host", "0.0.0.0", "--insecure", "--kv-slots", "1", "--ctx", "256") as srv:
        with srv.http() as h:
            assert h.get("/health").json()["status"] == "ok"
            assert h.get("/v1/models").status_code == 200  # no key asked
        # Bound beyond loopback the Host header is not checked: the name is not ours to know.
        assert raw_get(srv.base_url, "/health", host="colibri.lan:8000").status == 200


def test_non_loopback_bind_with_env_key():
    env = server_env(COLI_API_KEY="env-secret")
    with running_server("--host", "0.0.0.0", "--kv-slots", "1", "--ctx", "256", env=env) as srv:
        with srv.http() as h:
            assert h.get("/v1/models").status_code == 401
            ok = h.get("/v1/models", headers={"authorization": "Bearer env-secret"})
            assert ok.status_code == 200


# ------------------------------------------------------------------------------------------ signals


def _notify_path() -> Path:
    # AF_UNIX paths are limited to ~107 bytes: a short directory of our own, not tmp_path.
    return Path(tempfile.mkdtemp(prefix="coli-n-", dir="/tmp")) / "notify"


def test_sd_notify_and_sigterm_drain():
    path = _notify_path()
    notify = NotifySocket(path)
    server = ServerProcess.start("--kv-slots", "2", "--ctx", "512", env=server_env(NOTIFY_SOCKET=str(path)))
    try:
        notify.wait_for("READY=1", 10)
        outcome: dict = {}
        streaming = threading.Event()

        def consume() -> None:
            body = {"messages": user(LONG_Q), "max_tokens": 80, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                                  timeout=120) as r:
                    outcome["status"] = r.status_code
                    events = outcome["events"] = []
                    for data in sse_events(r.iter_lines()):
                        events.append(data)
                        if len(events) >= 3:
                            streaming.set()
            except Exception as e:  # noqa: BLE001 - reported by the assertions below
                outcome["error"] = e
            finally:
                streaming.set()

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        assert streaming.wait(90) and "error" not in outcome, outcome
        server.terminate()
        at_sigterm = len(outcome["events"])
        notify.wait_for("STOPPING=1", 10)
        # A new generation while the stream drains: 503 (or no connection, once the socket closed).
        try:
            r = httpx.post(server.base_url + "/v1/chat/completions",
                           json={"messages": user("Hi"), "max_tokens": 2}, timeout=30)
            assert r.status_code == 503 and error_body(r)
            h = httpx.get(server.base_url + "/health", timeout=10)
            assert h.status_code == 503 and h.json()["status"] == "draining"
        except httpx.ConnectError:
            pass
        t.join(300)  # generous: on a loaded machine a token may take a second
        assert not t.is_alive()
        assert "error" not in outcome, outcome
        events = outcome["events"]
        assert outcome["status"] == 200 and events[-1] == "[DONE]"
        assert len(events) > at_sigterm  # it was in flight: the drain let it finish
        frames = [json.loads(e) for e in events[:-1]]
        assert all("error" not in f for f in frames)
        finish = [f["choices"][0]["finish_reason"] for f in frames if f["choices"]]
        assert finish[-1] in ("length", "stop")
        assert server.wait(60) == 0, server.log
    finally:
        if server.proc.poll() is None:
            server.kill()
        notify.close()
        path.unlink(missing_ok=True)
        path.parent.rmdir()


# ------------------------------------------------------------------------------------------ crashes


def test_engine_crash_recovery():
    with running_server("--kv-slots", "2", "--ctx", "512") as server, server.http(timeout=60) as h:
        engine = server.engine_pid()
        body = {"messages": user(LONG_Q), "max_tokens": 200, "temperature": 0, "stream": True}
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
            seen = [next(events), next(events)]
            os.kill(engine, signal.SIGKILL)
            seen += list(events)  # must end, not hang (the client's read timeout bounds it)
        assert seen[-1] == "[DONE]"
        err = json.loads(seen[-2])
        assert "error" in err and err["error"]["type"] == "server_error", err

        down = h.get("/health")
        assert down.status_code == 503
        assert down.json()["status"] == "unavailable" and down.json()["reason"] not in ("", "ok")
        wait_until(lambda: h.get("/health").status_code == 200, 60, 0.25, "the engine to restart")
        health = h.get("/health").json()
        assert health["engine_restarts"] >= 1 and health["active"] == 0
        assert not pid_alive(engine)
        assert server.engine_pid() != engine

        with server.client() as c:
            r = c.chat.completions.create(model=server.model_id, messages=user("Hi"), max_tokens=2,
                                          temperature=0)
            assert r.choices[0].message.content is not None

            # A non-streaming request in flight when the engine dies: a 5xx OpenAI error.
            engine = server.engine_pid()
            outcome: dict = {}

            def ask() -> None:
                try:
                    outcome["ok"] = c.chat.completions.create(
                        model=server.model_id, messages=user(LONG_Q), max_tokens=400, temperature=0)
                except Exception as e:  # noqa: BLE001
                    outcome["error"] = e

            t = threading.Thread(target=ask, daemon=True)
            t.start()
            wait_until(lambda: h.get("/health").json()["active"] == 1, 30, 0.05, "the request to start")
            time.sleep(0.3)
            os.kill(engine, signal.SIGKILL)
            t.join(60)
            assert not t.is_alive()
            e = outcome.get("error")
            assert isinstance(e, openai.APIStatusError), outcome
            assert e.status_code >= 500 and e.body["type"] == "server_error" and e.body["message"]

        wait_until(lambda: h.get("/health").status_code == 200, 60, 0.25, "the engine to restart")
        assert h.get("/health").json()["engine_restarts"] >= 2
        assert all(pid_alive(p) for p in child_pids(server.pid))


# ------------------------------------------------------------------------------------------ late checks


def test_slowloris_is_closed(slowloris):
    sock, idle, opened = slowloris
    data = read_to_close(sock, opened + BODY_TIMEOUT_S + 30)
    if data:  # a 408 is polite; a plain close is enough
        assert parse_response(data).status == 408
    # The idle keep-alive connection: answered, then closed after the keep-alive timeout.
    data = read_to_close(idle, opened + KEEP_ALIVE_S + 30)
    assert parse_response(data).status == 200
