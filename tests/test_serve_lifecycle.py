"""End-to-end tests of ``coli serve``'s life cycle: systemd's notify protocol, the drain on
SIGTERM, and the engine child killed mid-request and restarted.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from serve_harness import (
    LONG_Q,
    NotifySocket,
    ServerProcess,
    child_pids,
    error_body,
    pid_alive,
    running_server,
    server_env,
    sse_events,
    user,
    wait_until,
)

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
