"""The HTTP server's limits are settings (flag, COLI_* variable, default in colibri/settings.py):
set, they change what the real server accepts; unset, the defaults the other tests rely on hold."""

from __future__ import annotations

import pytest
from serve_harness import raw_request, running_server, server_env

from colibri import settings
from colibri.api.app import BODY_TIMEOUT_S, MAX_BODY
from colibri.api.http_server import DRAIN_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONCURRENT_REQUESTS
from colibri.cli import main


def test_the_defaults_are_the_settings_defaults():
    assert MAX_BODY == 4 << 20 == int(settings.MAX_BODY_MB.default * (1 << 20))
    assert (BODY_TIMEOUT_S, MAX_CONCURRENT_REQUESTS, KEEP_ALIVE_S, DRAIN_TIMEOUT_S) == (30, 256, 15, 600)


def captured_config(monkeypatch: pytest.MonkeyPatch, *args: str, **env: str):
    import colibri.api.http_server as http_server

    seen = []
    monkeypatch.setattr(http_server, "run_server", lambda cfg: seen.append(cfg) or 0)
    for name in (s.env for s in settings.HTTP_LIMITS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--no-persist", *args]) == 0
    return seen[0]


def test_flags_and_variables_reach_the_server_config(monkeypatch: pytest.MonkeyPatch):
    cfg = captured_config(monkeypatch, "--max-body-mb", "0.5", "--keep-alive", "3",
                          COLI_MAX_REQUESTS="9", COLI_DRAIN_TIMEOUT="7", COLI_BODY_TIMEOUT="2")
    assert (cfg.max_body, cfg.keep_alive_s, cfg.max_requests, cfg.drain_timeout_s, cfg.body_timeout_s) == (
        1 << 19, 3.0, 9, 7.0, 2.0)
    default = captured_config(monkeypatch)
    assert (default.max_body, default.max_requests, default.keep_alive_s) == (MAX_BODY, 256, 15.0)


def test_a_limit_must_be_positive(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    import colibri.api.http_server as http_server

    monkeypatch.setattr(http_server, "run_server", lambda cfg: 0)
    assert main(["serve", "--max-requests", "0"]) == 1
    assert "must be positive" in capsys.readouterr().err


def test_a_smaller_body_limit_is_enforced_by_the_real_server():
    with running_server("--kv-slots", "1", "--ctx", "256", "--max-body-mb", "0.01",
                        env=server_env()) as server:
        limit = int(0.01 * (1 << 20))
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:{server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n"
                "Connection: close\r\n\r\n").encode()
        r = raw_request(server.base_url, head + b" " * 1024, timeout=20)
        assert r.status == 413
        assert r.json()["error"]["message"] == f"request body over {limit} bytes"
