"""Unit tests of the HTTP server's pure pieces: stop sequences, metrics, sd_notify, security guards."""

from __future__ import annotations

import hmac
import math
import os
import re
import socket
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.api import sdnotify
from colibri.api.metrics import (
    QUEUE_WAIT_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    Registry,
    format_value,
    server_metrics,
)
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
from colibri.api.stop import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, validate_stops
from colibri.errors import ColibriError

# ---------------------------------------------------------------------------------------- stop


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _run(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        emitted, hit = m.feed(c)
        out.append(emitted)
        if hit:
            assert m.feed("more") == ("", True)  # everything after a stop is discarded
            assert m.flush() == ""
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), m.stopped


def _chunk(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


_ALPHABET = st.sampled_from("abcé\n")  # small, so stops occur and overlap often


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(_ALPHABET, max_size=40),
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=MAX_STOPS),
    cuts=st.lists(st.integers(0, 1000), max_size=12),
)
def test_stop_matches_reference_under_any_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    chunks = _chunk(text, cuts)
    assert "".join(chunks) == text
    assert _run(stops, chunks) == _reference(text, stops)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(_ALPHABET, max_size=30),
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=MAX_STOPS),
    cuts=st.lists(st.integers(0, 1000), max_size=8),
)
def test_stop_never_emits_past_the_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    """Every prefix emitted along the way is a prefix of the final answer (nothing is retracted)."""
    want, _ = _reference(text, stops)
    m, emitted = StopMatcher(stops), ""
    for c in _chunk(text, cuts):
        out, hit = m.feed(c)
        emitted += out
        assert want.startswith(emitted)
        if hit:
            break


def test_stop_across_token_boundary() -> None:
    m = StopMatcher(["Hello"])
    assert m.feed("Say Hel") == ("Say ", False)
    assert m.feed("lo world") == ("", True)


def test_stop_false_start_is_released() -> None:
    m = StopMatcher(["Hello"])
    assert m.feed("Hel") == ("", False)
    assert m.feed("p") == ("Help", False)
    assert m.flush() == ""


def test_stop_flush_returns_held_text() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("done </e") == ("done ", False)
    assert m.flush() == "</e"
    assert not m.stopped


def test_stop_earliest_wins_even_if_completed_later() -> None:
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("c") == ("", False)  # "bc" is complete, but "abcd" would start earlier
    assert m.feed("d") == ("", True)
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xabc") == ("x", False)
    assert m.feed("e") == ("a", True)  # "abcd" failed, so "bc" wins: "xa" in total


def test_stop_pending_resolved_by_flush() -> None:
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xabc") == ("x", False)
    assert m.flush() == "a"
    assert m.stopped


def test_stop_at_start_and_empty_feeds() -> None:
    m = StopMatcher(["\n\n"])
    assert m.feed("") == ("", False)
    assert m.feed("\n") == ("", False)
    assert m.feed("\nrest") == ("", True)


def test_stop_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


def test_stop_rejects_empty_string() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])


def test_validate_stops_accepts() -> None:
    assert validate_stops(None) == []
    assert validate_stops("###") == ["###"]
    assert validate_stops(["a", "b"]) == ["a", "b"]
    assert validate_stops([]) == []
    assert validate_stops(["x" * MAX_STOP_CHARS]) == ["x" * MAX_STOP_CHARS]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (["a"] * (MAX_STOPS + 1), "at most 4"),
        ([""], "empty"),
        ("", "empty"),
        ([1], "strings"),
        ([None], "strings"),
        (7, "string or a list"),
        ({"a": 1}, "string or a list"),
        (["x" * (MAX_STOP_CHARS + 1)], "characters"),
    ],
)
def test_validate_stops_rejects(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as e:
        validate_stops(value)
    assert "'stop'" in str(e.value)  # names the parameter, as an OpenAI 400 does


# ------------------------------------------------------------------------------------- metrics

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], v)


def _parse(text: str) -> tuple[dict[str, tuple[str, str]], list[tuple[str, dict[str, str], float]]]:
    """A strict reader of exposition format 0.0.4: (name -> (type, help), samples)."""
    assert text.endswith("\n")
    meta: dict[str, list[str]] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    current = None
    for line in text.split("\n")[:-1]:
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert name not in meta, f"duplicate family {name}"
            meta[name] = ["", _unescape(help_)]
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and kind in ("counter", "gauge", "histogram")
            meta[name][0] = kind
        else:
            m = _SAMPLE.fullmatch(line)
            assert m, f"bad sample line {line!r}"
            name, body, value = m.groups()
            labels: dict[str, str] = {}
            pos = 0
            while body and pos < len(body):
                lm = _LABEL_PAIR.match(body, pos)
                assert lm, f"bad labels {body!r}"
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
            assert current is not None and meta[current][0], "sample before its TYPE"
            family = current
            if meta[current][0] == "histogram":
                assert name in (f"{family}_bucket", f"{family}_sum", f"{family}_count")
            else:
                assert name == family
            samples.append((name, labels, float(value)))
    return {k: (v[0], v[1]) for k, v in meta.items()}, samples


def test_metrics_counter_and_gauge_render() -> None:
    r = Registry()
    c = r.register(Counter("req_total", "Requests.", ("endpoint", "status")))
    g = r.register(Gauge("depth", "Depth."))
    c.inc(endpoint="/v1/chat/completions", status=200)
    c.inc(2, endpoint="/v1/chat/completions", status=200)
    c.inc(endpoint="/v1/models", status="404")
    g.set(5)
    g.dec()
    g.inc(0.5)
    meta, samples = _parse(r.render())
    assert meta == {"req_total": ("counter", "Requests."), "depth": ("gauge", "Depth.")}
    assert ("req_total", {"endpoint": "/v1/chat/completions", "status": "200"}, 3.0) in samples
    assert ("req_total", {"endpoint": "/v1/models", "status": "404"}, 1.0) in samples
    assert ("depth", {}, 4.5) in samples
    assert c.get(endpoint="/v1/models", status=404) == 1


def test_metrics_unlabelled_series_start_at_zero() -> None:
    r = Registry()
    r.register(Counter("a_total", "A."))
    r.register(Counter("b_total", "B.", ("x",)))
    text = r.render()
    assert "a_total 0\n" in text
    assert _parse(text)[1] == [("a_total", {}, 0.0)]  # a labelled family has no series until used


def test_metrics_label_and_help_escaping() -> None:
    r = Registry()
    c = r.register(Counter("e_total", 'Help with \\ and\nnewline and "quotes".', ("v",)))
    nasty = 'back\\slash "quote"\nnewline'
    c.inc(v=nasty)
    text = r.render()
    assert "\\\\" in text and '\\"' in text and "\\n" in text
    assert text.count("\n") == 3  # the newlines are escaped, not literal
    assert '# HELP e_total Help with \\\\ and\\nnewline and "quotes".\n' in text  # HELP keeps quotes
    meta, samples = _parse(text)
    assert meta["e_total"][1] == 'Help with \\ and\nnewline and "quotes".'
    assert samples == [("e_total", {"v": nasty}, 1.0)]


def test_metrics_histogram_cumulative_buckets() -> None:
    r = Registry()
    h = r.register(Histogram("lat_seconds", "Latency.", (0.1, 1, 10)))
    values = [0.05, 0.1, 0.5, 1.0, 3, 20, 100]
    for v in values:
        h.observe(v)
    _, samples = _parse(r.render())
    buckets = [(s[1]["le"], s[2]) for s in samples if s[0] == "lat_seconds_bucket"]
    assert buckets == [("0.1", 2), ("1", 4), ("10", 5), ("+Inf", 7)]
    assert ("lat_seconds_count", {}, 7.0) in samples
    total = next(s[2] for s in samples if s[0] == "lat_seconds_sum")
    assert total == pytest.approx(sum(values))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1000, allow_nan=False), max_size=50))
def test_metrics_histogram_matches_counts(values: list[float]) -> None:
    r, m = server_metrics()
    for v in values:
        m.queue_wait.observe(v)
    _, samples = _parse(r.render())
    own = [s for s in samples if s[0].startswith("colibri_queue_wait_seconds")]
    buckets = [s for s in own if s[0].endswith("_bucket")]
    les = [float(s[1]["le"]) for s in buckets]
    assert les == [*QUEUE_WAIT_BUCKETS, math.inf]
    for le, (_, _, n) in zip(les, buckets, strict=True):
        assert n == sum(1 for v in values if v <= le)
    counts = [n for _, _, n in buckets]
    assert counts == sorted(counts)
    assert next(n for name, _, n in own if name.endswith("_count")) == len(values) == counts[-1]


def test_metrics_labelled_histogram() -> None:
    r = Registry()
    h = r.register(Histogram("h_seconds", "H.", (1,), ("kind",)))
    h.observe(0.5, kind="a")
    h.observe(2, kind="b")
    _, samples = _parse(r.render())
    assert ("h_seconds_bucket", {"kind": "a", "le": "1"}, 1.0) in samples
    assert ("h_seconds_bucket", {"kind": "b", "le": "1"}, 0.0) in samples
    assert ("h_seconds_count", {"kind": "b"}, 1.0) in samples


def test_metrics_server_set() -> None:
    r, m = server_metrics()
    m.requests.inc(endpoint="/v1/completions", status=200)
    m.tokens.inc(12, kind="prompt")
    m.tokens.inc(3, kind="completion")
    m.queue_depth.set(2)
    m.active.inc()
    m.time_to_first_token.observe(1.5)
    m.token_latency.observe(0.02)
    meta, samples = _parse(r.render())
    assert meta["colibri_requests_total"][0] == "counter"
    assert meta["colibri_tokens_total"][0] == "counter"
    assert meta["colibri_queue_depth"][0] == "gauge"
    assert meta["colibri_active_requests"][0] == "gauge"
    for name in ("time_to_first_token", "token_latency", "queue_wait"):
        assert meta[f"colibri_{name}_seconds"][0] == "histogram"
    assert ("colibri_tokens_total", {"kind": "prompt"}, 12.0) in samples
    assert ("colibri_active_requests", {}, 1.0) in samples
    for buckets in (TTFT_BUCKETS, TOKEN_LATENCY_BUCKETS, QUEUE_WAIT_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


def test_metrics_rejects_misuse() -> None:
    c = Counter("x_total", "X.", ("a",))
    with pytest.raises(ValueError):
        c.inc(-1, a="1")
    with pytest.raises(ValueError):
        c.inc(b="1")
    with pytest.raises(ValueError):
        c.inc()
    with pytest.raises(ValueError):
        Counter("bad-name", "X.")
    with pytest.raises(ValueError):
        Counter("x", "X.", ("__reserved",))
    with pytest.raises(ValueError):
        Histogram("h", "H.", (1, 1))
    with pytest.raises(ValueError):
        Histogram("h", "H.", (1, math.inf))
    with pytest.raises(ValueError):
        Histogram("h", "H.", (1,), ("le",))
    r = Registry()
    r.register(Gauge("g", "G."))
    with pytest.raises(ValueError):
        r.register(Gauge("g", "G."))


def test_metrics_format_value() -> None:
    assert format_value(3.0) == "3"
    assert format_value(0.25) == "0.25"
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"
    assert format_value(1e300) == "1e+300"


# ------------------------------------------------------------------------------------ sdnotify


@pytest.fixture
def fake_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "n.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_sdnotify_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False


def test_sdnotify_path_socket(fake_systemd: socket.socket) -> None:
    assert sdnotify.ready()
    assert fake_systemd.recv(4096) == b"READY=1"
    assert sdnotify.status("loading\nexperts ✓")
    assert fake_systemd.recv(4096) == "STATUS=loading experts ✓".encode()
    assert sdnotify.watchdog()
    assert fake_systemd.recv(4096) == b"WATCHDOG=1"
    assert sdnotify.stopping()
    assert fake_systemd.recv(4096) == b"STOPPING=1"
    assert sdnotify.notify("READY=1\nSTATUS=up")
    assert fake_systemd.recv(4096) == b"READY=1\nSTATUS=up"


def test_sdnotify_empty_state_not_sent(fake_systemd: socket.socket) -> None:
    assert sdnotify.notify("") is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
def test_sdnotify_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"colibri-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert sock.recv(4096) == b"READY=1"
    assert sdnotify.ready() is False  # the listener is gone: False, no exception


@pytest.mark.parametrize(
    "value",
    ["", "@", "relative.sock", "vsock:2:1234", "/nonexistent/dir/notify.sock", "/tmp/\0bad"],
)
def test_sdnotify_unreachable_never_raises(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    if "\0" in value:
        monkeypatch.setattr(os, "environ", {**os.environ, "NOTIFY_SOCKET": value})
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False


def test_sdnotify_not_a_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "plain"
    f.write_text("")
    monkeypatch.setenv("NOTIFY_SOCKET", str(f))
    assert sdnotify.watchdog() is False


def test_sdnotify_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "junk")
    assert sdnotify.watchdog_interval() is None


# ------------------------------------------------------------------------------------ security


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
