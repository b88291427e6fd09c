"""Unit tests of the Prometheus registry behind ``GET /metrics`` (``colibri.api.metrics``), read
back with a strict parser of the exposition format."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
