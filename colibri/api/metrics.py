"""A tiny Prometheus registry: counters, gauges and histograms in text exposition format 0.0.4.

Enough for ``GET /metrics`` without the prometheus_client dependency. Not thread-safe: the server
updates and renders from its one trio thread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# Prefill of a long prompt on the CPU-streaming path takes minutes; a cached one on GPU, a fraction
# of a second.
TTFT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Per generated token: ~200 tok/s on GPU down to ~1 tok/s (and slower) streaming experts from disk.
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# One generation at a time, so waits are whole generations; tops out at the default --queue-timeout.
QUEUE_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def format_value(v: float) -> str:
    """Go-style sample values: integral floats without ``.0``, and ``+Inf``/``-Inf``/``NaN``."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")  # HELP escapes no quotes, per the format


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Iterable[str] = ()) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid metric name {name!r}")
        self.labelnames = tuple(labelnames)
        for ln in self.labelnames:
            if not _LABEL.fullmatch(ln) or ln.startswith("__"):
                raise ValueError(f"invalid label name {ln!r}")
        if len(set(self.labelnames)) != len(self.labelnames):
            raise ValueError(f"duplicate label names in {self.labelnames}")
        self.name = name
        self.help = help

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[ln]) for ln in self.labelnames)

    def _samples(self) -> Iterator[tuple[str, tuple[tuple[str, str], ...], float]]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{name}{_labels(pairs)} {format_value(v)}" for name, pairs, v in self._samples()]
        return "\n".join(lines) + "\n"


class _Scalar(_Metric):
    def __init__(self, name: str, help: str, labelnames: Iterable[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        # An unlabelled series exists from the start, so scrapers see 0 rather than nothing.
        self._values: dict[tuple[str, ...], float] = {} if self.labelnames else {(): 0.0}

    def get(self, **labels: object) -> float:
        return self._values.get(self._key(labels), 0.0)

    def _add(self, amount: float, labels: dict[str, object]) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def _samples(self) -> Iterator[tuple[str, tuple[tuple[str, str], ...], float]]:
        for key in sorted(self._values):
            yield self.name, tuple(zip(self.labelnames, key, strict=True)), self._values[key]


class Counter(_Scalar):
    """A monotonically increasing count (name it ``..._total``)."""

    kind = "counter"

    def inc(self, amount: float = 1, **labels: object) -> None:
        if amount < 0:
            raise ValueError("a counter can only increase")
        self._add(amount, labels)


class Gauge(_Scalar):
    """A value that goes up and down: queue depth, requests in flight."""

    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        self._values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1, **labels: object) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1, **labels: object) -> None:
        self._add(-amount, labels)


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets, plus their sum and count."""

    kind = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Iterable[float], labelnames: Iterable[str] = ()
    ) -> None:
        super().__init__(name, help, labelnames)
        if "le" in self.labelnames:
            raise ValueError("'le' is reserved for histogram buckets")
        bounds = [float(b) for b in buckets]
        if not bounds or any(not math.isfinite(b) for b in bounds):
            raise ValueError("histogram buckets must be finite and non-empty (+Inf is implied)")
        if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError("histogram buckets must be strictly increasing")
        self.buckets = (*bounds, math.inf)
        # per series: non-cumulative bucket counts, sum; cumulated at render time
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        if not self.labelnames:
            self._series[()] = ([0] * len(self.buckets), [0.0])

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        counts, total = self._series.setdefault(key, ([0] * len(self.buckets), [0.0]))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
                break
        else:
            counts[-1] += 1  # NaN compares false with every bound; it still counts
        total[0] += value

    def _samples(self) -> Iterator[tuple[str, tuple[tuple[str, str], ...], float]]:
        for key in sorted(self._series):
            counts, total = self._series[key]
            pairs = tuple(zip(self.labelnames, key, strict=True))
            cumulative = 0
            for bound, n in zip(self.buckets, counts, strict=True):
                cumulative += n
                yield f"{self.name}_bucket", (*pairs, ("le", format_value(bound))), cumulative
            yield f"{self.name}_sum", pairs, total[0]
            yield f"{self.name}_count", pairs, cumulative


M = TypeVar("M", bound=_Metric)


class Registry:
    """The metrics one ``/metrics`` endpoint renders, in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: M) -> M:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name!r} already registered")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        return "".join(m.render() for m in self._metrics.values())


@dataclass(frozen=True)
class ServerMetrics:
    requests: Counter  # {endpoint, status}
    tokens: Counter  # {kind="prompt"|"completion"}
    queue_depth: Gauge
    active: Gauge
    time_to_first_token: Histogram
    token_latency: Histogram  # one observation per generated token
    queue_wait: Histogram
    persist_failures: Counter  # turns whose KV slot the engine could not save
    prefix_hits: Counter  # requests given the free slot holding their prefix (admission's choice)
    reused_tokens: Counter  # prompt tokens the engine took from a slot's KV instead of prefilling
    drafted_tokens: Counter  # speculative decoding: draft tokens fed to the steps ...
    accepted_tokens: Counter  # ... and of those, confirmed (each a token a step saved)


def server_metrics() -> tuple[Registry, ServerMetrics]:
    """The HTTP server's metric set, registered in a fresh registry."""
    r = Registry()
    m = ServerMetrics(
        requests=r.register(
            Counter("colibri_requests_total", "HTTP requests by endpoint and status.", ("endpoint", "status"))
        ),
        tokens=r.register(Counter("colibri_tokens_total", "Tokens processed, by kind.", ("kind",))),
        queue_depth=r.register(Gauge("colibri_queue_depth", "Generation requests waiting in the queue.")),
        active=r.register(Gauge("colibri_active_requests", "Generation requests running now.")),
        time_to_first_token=r.register(
            Histogram(
                "colibri_time_to_first_token_seconds",
                "Seconds from admission to the first generated token.",
                TTFT_BUCKETS,
            )
        ),
        token_latency=r.register(
            Histogram("colibri_token_latency_seconds", "Seconds per generated token.", TOKEN_LATENCY_BUCKETS)
        ),
        queue_wait=r.register(
            Histogram(
                "colibri_queue_wait_seconds", "Seconds a request waited for admission.", QUEUE_WAIT_BUCKETS
            )
        ),
        persist_failures=r.register(
            Counter(
                "colibri_persist_failures_total",
                "Turns whose KV slot the engine failed to save to the state directory.",
            )
        ),
        prefix_hits=r.register(
            Counter(
                "colibri_prefix_hits_total",
                "Requests without cache_slot given the free slot whose history shares their prefix.",
            )
        ),
        reused_tokens=r.register(
            Counter(
                "colibri_reused_tokens_total",
                "Prompt tokens taken from a slot's KV cache instead of prefilled.",
            )
        ),
        drafted_tokens=r.register(
            Counter("colibri_drafted_tokens_total", "Speculative decoding's draft tokens fed to the steps.")
        ),
        accepted_tokens=r.register(
            Counter("colibri_accepted_tokens_total",
                    "Draft tokens confirmed: tokens that took no forward step of their own.")
        ),
    )
    return r, m
