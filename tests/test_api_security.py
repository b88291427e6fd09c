"""Unit tests of the HTTP server's guards (``colibri.api.security``): the API key, the bind policy,
the Host header (DNS rebinding) and CORS."""

from __future__ import annotations

import hmac

import pytest

from colibri.api.security import (
    DEFAULT_CORS_ORIGINS,
    MAX_REQUESTED_HEADERS,
    CorsPolicy,
    HostGuard,
    check_api_key,
    is_loopback_host,
    require_key_for_bind,
    split_host,
)
from colibri.errors import ColibriError


def test_api_key_not_configured() -> None:
    assert check_api_key(None, None, None)
    assert check_api_key("", None, None)  # COLI_API_KEY= is no key, not the empty password
    assert check_api_key(None, "Bearer whatever", "x")


@pytest.mark.parametrize(
    ("authorization", "x_api_key", "ok"),
    [
        ("Bearer s3cret", None, True),
        ("bearer s3cret", None, True),  # auth schemes are case-insensitive
        ("BEARER   s3cret  ", None, True),
        (None, "s3cret", True),
        (None, " s3cret ", True),
        ("Bearer wrong", "s3cret", True),  # either header may carry it
        ("Bearer s3cret", "wrong", True),
        ("Basic s3cret", None, False),  # wrong scheme
        ("s3cret", None, False),  # no scheme
        ("Bearer", None, False),
        ("Bearer ", None, False),
        (None, "", False),
        (None, None, False),
        ("Bearer s3cre", None, False),
        ("Bearer s3cret2", None, False),
        ("Bearer S3CRET", None, False),
        ("Token s3cret", "wrong", False),
    ],
)
def test_api_key(authorization: str | None, x_api_key: str | None, ok: bool) -> None:
    assert check_api_key("s3cret", authorization, x_api_key) is ok


def test_api_key_uses_constant_time_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, object]] = []
    real = hmac.compare_digest

    def spy(a: object, b: object) -> bool:
        calls.append((a, b))
        return real(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert check_api_key("s3cret", "Bearer s3cret", None)
    assert not check_api_key("s3cret", None, "nope")
    assert calls and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    assert (b"s3cret", b"s3cret") in calls


def test_api_key_unicode() -> None:
    key = "ключ-clé-🔑"
    assert check_api_key(key, f"Bearer {key}", None)  # a str decoded as text
    as_asgi = key.encode("utf-8").decode("latin-1")  # what quart hands over: latin-1-decoded UTF-8
    assert check_api_key(key, f"Bearer {as_asgi}", None)
    assert check_api_key(key, None, as_asgi)
    assert not check_api_key(key, "Bearer ключ", None)
    assert not check_api_key("clé", "Bearer cle", None)
    assert check_api_key("clé", "Bearer clé", None)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("LocalHost", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.10", False),
        ("localhost.evil.com", False),
        ("127.0.0.1.evil.com", False),
        ("example.com", False),
    ],
)
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_require_key_for_bind() -> None:
    require_key_for_bind("127.0.0.1", None, False)
    require_key_for_bind("::1", None, False)
    require_key_for_bind("0.0.0.0", "k", False)
    require_key_for_bind("0.0.0.0", None, True)
    with pytest.raises(ColibriError, match="COLI_API_KEY"):
        require_key_for_bind("0.0.0.0", None, False)
    with pytest.raises(ColibriError, match="--insecure"):
        require_key_for_bind("192.168.1.10", "", False)  # an empty key is no key


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("localhost", ("localhost", None)),
        ("LOCALHOST:8000", ("localhost", 8000)),
        ("[::1]:8000", ("::1", 8000)),
        ("[::1]", ("::1", None)),
        ("127.0.0.1:65535", ("127.0.0.1", 65535)),
        ("::1", None),  # IPv6 needs brackets
        ("[::1", None),
        ("[::1]x", None),
        ("[evil.com]:80", None),
        ("localhost:", None),
        ("localhost:0", None),
        ("localhost:65536", None),
        ("localhost:80a", None),
        ("localhost:٣", None),  # a non-ASCII digit
        ("user@localhost", None),
        ("", None),
        (":8000", None),
    ],
)
def test_split_host(value: str, parsed: tuple[str, int | None] | None) -> None:
    assert split_host(value) == parsed


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("localhost", True),
        ("localhost:8000", True),
        ("LocalHost:8000", True),
        ("127.0.0.1", True),
        ("127.0.0.1:8000", True),
        ("127.0.0.1:5173", True),  # a dev proxy forwards its own Host
        ("[::1]", True),
        ("[::1]:8000", True),
        ("ui.internal:8000", True),  # the extra
        ("evil.com", False),
        ("evil.com:8000", False),
        ("127.0.0.1.evil.com", False),
        ("localhost.evil.com:8000", False),
        ("evil.localhost", False),
        ("127.0.0.2:8000", False),
        ("[::2]:8000", False),
        ("::1", False),
        ("localhost:8000@evil.com", False),
        ("", False),
        (None, False),  # missing Host on a loopback bind: refused
    ],
)
def test_host_guard_loopback(header: str | None, ok: bool) -> None:
    guard = HostGuard("127.0.0.1", 8000, ["ui.internal"])
    assert guard.allowed(header) is ok
    assert guard.expected == "localhost:8000"


def test_host_guard_bind_name_and_ipv6() -> None:
    assert HostGuard("127.0.0.2", 8000).allowed("127.0.0.2:8000")
    v6 = HostGuard("::1", 8000)
    assert v6.allowed("[::1]:8000") and v6.allowed("localhost") and not v6.allowed("evil.com")
    assert HostGuard("[::1]", 8000).allowed("[::1]:8000")
    assert HostGuard("localhost", 8000).allowed("127.0.0.1:8000")


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "192.168.1.10"])
def test_host_guard_non_loopback_accepts_any(bind: str) -> None:
    guard = HostGuard(bind, 8000)
    for header in ("evil.com", "192.168.1.10:8000", "localhost", None, ""):
        assert guard.allowed(header)


def test_host_guard_rejects_bad_extra() -> None:
    with pytest.raises(ColibriError):
        HostGuard("127.0.0.1", 8000, ["bad host"])


@pytest.mark.parametrize("origin", DEFAULT_CORS_ORIGINS)
def test_cors_defaults(origin: str) -> None:
    h = CorsPolicy([]).headers_for(origin, False, None)
    assert h == {
        "Access-Control-Allow-Origin": origin,
        "Vary": "Origin",
        "Access-Control-Expose-Headers": "x-colibri-queue-wait-ms",
    }


def test_cors_preflight() -> None:
    h = CorsPolicy([]).headers_for("http://localhost:5173", True, "Content-Type, Authorization")
    assert h["Access-Control-Allow-Origin"] == "http://localhost:5173"
    assert h["Vary"] == "Origin"
    assert h["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
    assert h["Access-Control-Allow-Headers"] == "authorization, content-type, x-api-key"
    assert int(h["Access-Control-Max-Age"]) > 0


def test_cors_preflight_requested_headers() -> None:
    requested = "x-stainless-os, X-Stainless-Lang,bad header, x\u00e9, ,authorization"
    h = CorsPolicy([]).headers_for("tauri://localhost", True, requested)
    allow = h["Access-Control-Allow-Headers"].split(", ")
    assert allow == ["authorization", "content-type", "x-api-key", "x-stainless-os", "x-stainless-lang"]
    many = ",".join(f"x-h{i}" for i in range(MAX_REQUESTED_HEADERS * 2))
    h = CorsPolicy([]).headers_for("tauri://localhost", True, many)
    assert len(h["Access-Control-Allow-Headers"].split(", ")) <= 3 + MAX_REQUESTED_HEADERS


@pytest.mark.parametrize(
    "origin",
    [
        "https://evil.com",
        "http://localhost:5174",
        "http://localhost",
        "http://localhost:5173.evil.com",
        "https://localhost:5173",
        "null",
        "",
        None,
    ],
)
def test_cors_disallowed(origin: str | None) -> None:
    policy = CorsPolicy(["https://ui.example"])
    assert policy.headers_for(origin, False, None) == {}
    assert policy.headers_for(origin, True, "authorization") == {}


def test_cors_extra_origin() -> None:
    policy = CorsPolicy(["https://UI.example/", "http://10.0.0.5:3000"])
    assert policy.headers_for("https://ui.example", False, None)["Access-Control-Allow-Origin"] == (
        "https://ui.example"
    )
    assert policy.allows("http://10.0.0.5:3000")
    assert policy.allows("http://localhost:5173")  # defaults stay
    assert not policy.allows("http://10.0.0.5:3001")


def test_cors_wildcard_echoes_origin() -> None:
    policy = CorsPolicy(["*"])
    for origin in ("https://anything.example", "null", "http://localhost:5173"):
        assert policy.headers_for(origin, False, None)["Access-Control-Allow-Origin"] == origin
    assert policy.headers_for(None, False, None) == {}


@pytest.mark.parametrize("bad", ["localhost:5173", "https://ui.example/app", "ui.example", "https://"])
def test_cors_rejects_malformed_origin(bad: str) -> None:
    with pytest.raises(ColibriError, match="--cors-origin"):
        CorsPolicy([bad])
