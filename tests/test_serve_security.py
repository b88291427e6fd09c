"""End-to-end tests of ``coli serve``'s access rules: the API key, the web page (and no path out of
it), and the refusal to bind beyond loopback without a key. Each test starts the server it needs
(the Host header guard and CORS are checked on the shared server, in test_serve_http.py).
"""

from __future__ import annotations

import subprocess

import openai
import pytest
from serve_harness import (
    error_body,
    raw_get,
    running_server,
    serve_command,
    server_env,
    user,
)

SECRET = "TOPSECRET-7d1f"


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
