"""``bench_http.py --nginx``: two ``coli serve`` replicas behind nginx against one.

Kept apart from bench_http.py's engine-versus-HTTP comparison, which it reuses (``Server``): 8
concurrent streams into one replica with 8 slots, and the same 8 through nginx into two replicas of
4 slots each, 4 per replica; then nginx's cost per request, measured from the client and from
nginx's access log. Needs /usr/sbin/nginx (``make test`` installs Debian's).
"""

from __future__ import annotations

import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

NGINX = "/usr/sbin/nginx"
REPLICA_HEADER = "x-colibri-replica"
STREAMS = 8
OVERHEAD_REQUESTS = 40  # one-token generations each way: the median settles well within this
NGINX_START_S = 30.0
QUESTIONS = [
    "Tell me about the ocean.", "Describe a forest in spring.", "Explain how a bicycle works.",
    "Write about a city at night.", "Describe a mountain hike.", "Tell me about the moon.",
    "Explain what a library is for.", "Describe a thunderstorm.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """nginx in the foreground on a free port, with the configuration ``coli deploy nginx`` prints."""

    def __init__(self, replicas: list[str]) -> None:
        self.prefix = Path(tempfile.mkdtemp(prefix="coli-bench-nginx-"))
        (self.prefix / "logs").mkdir()
        port = free_port()
        args = ["deploy", "nginx", "--listen", f"127.0.0.1:{port}"]
        for r in replicas:
            args += ["--replica", r]
        conf = subprocess.run([sys.executable, "-m", "colibri", *args], capture_output=True, text=True,
                              check=True).stdout
        (self.prefix / "nginx.conf").write_text(conf)
        self.proc = subprocess.Popen([NGINX, "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf"),
                                      "-g", "daemon off; user root;"])
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + NGINX_START_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("nginx did not start")

    def logged_overhead_ms(self, since: int) -> list[float]:
        """request_time - upstream_response_time of each access-log line after the first ``since``."""
        out = []
        lines = (self.prefix / "logs" / "access.log").read_text().splitlines()[since:]
        for line in lines:
            m = re.search(r"request_time=([\d.]+) upstream_time=([\d.]+)$", line)
            if m:
                out.append(1000 * (float(m[1]) - float(m[2])))
        return out

    def log_lines(self) -> int:
        return len((self.prefix / "logs" / "access.log").read_text().splitlines())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def sessions_per_replica(url: str, per_replica: int) -> list[str]:
    """Conversation keys, ``per_replica`` of them hashed to each replica (asked with /health)."""
    found: dict[str, list[str]] = {}
    for i in range(1000):
        key = f"bench-{i}"
        replica = httpx.get(url + "/health", headers={"X-Session-Id": key}).headers[REPLICA_HEADER]
        if len(found.setdefault(replica, [])) < per_replica:
            found[replica].append(key)
        if len(found) == 2 and all(len(v) == per_replica for v in found.values()):
            return [k for pair in zip(*found.values(), strict=True) for k in pair]
    raise RuntimeError(f"the hash did not split the keys: {found}")


def one_token_ms(client: httpx.Client, url: str, session: str) -> float:
    body = {"model": "bench", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1,
            "temperature": 0}
    start = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session})
    r.raise_for_status()
    return 1000 * (time.perf_counter() - start)


def overhead(direct: str, nginx: Nginx, session: str) -> tuple[float, float, float]:
    """(direct ms, through nginx ms, nginx's logged ms): medians of one-token generations in turn."""
    since = nginx.log_lines()
    times: dict[str, list[float]] = {"direct": [], "nginx": []}
    with httpx.Client(timeout=60) as client:
        for i in range(OVERHEAD_REQUESTS):
            for way in ("direct", "nginx") if i % 2 == 0 else ("nginx", "direct"):
                times[way].append(one_token_ms(client, direct if way == "direct" else nginx.url, session))
    return (statistics.median(times["direct"]), statistics.median(times["nginx"]),
            statistics.median(nginx.logged_overhead_ms(since)))


def replicas_main(model: Path, server_cls, runs: int, tokens: int) -> None:
    """Print the aggregate tok/s table and nginx's per-request overhead."""
    one = server_cls(model, slots=STREAMS, name="single")
    pair = [server_cls(model, slots=STREAMS // 2, name=f"r{i + 1}") for i in range(2)]
    nginx = Nginx([p.url.removeprefix("http://") for p in pair])
    front = pair[0]  # its run() sends the streams to nginx, with keys split over both replicas
    front.target, front.sessions = nginx.url, sessions_per_replica(nginx.url, STREAMS // 2)
    one.sessions = front.sessions  # no cache_slot there either: the same requests
    try:
        one.run(QUESTIONS, tokens)
        front.run(QUESTIONS, tokens)  # warm-up: kernel compiles out of the figures
        rates: dict[str, list[float]] = {"one": [], "two": []}
        for r in range(runs):
            for way in ("one", "two") if r % 2 == 0 else ("two", "one"):
                rates[way].append((one if way == "one" else front).run(QUESTIONS, tokens).rate)
            print(f"  run {r + 1}: one replica {rates['one'][-1]:.1f} tok/s, two behind nginx "
                  f"{rates['two'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
        session = front.sessions[0]
        home = httpx.get(nginx.url + "/health", headers={"X-Session-Id": session}).headers[REPLICA_HEADER]
        direct, through, logged = overhead(pair[int(home[1:]) - 1].url, nginx, session)
    finally:
        nginx.close()
        for s in (one, *pair):
            s.close()
    o, t = statistics.median(rates["one"]), statistics.median(rates["two"])
    print(f"{STREAMS} concurrent streams, {tokens} tokens each, greedy, {runs} runs: decode tok/s of all "
          "streams together (median, best)")
    print(f"  one replica, {STREAMS} slots:             {o:7.1f}  {max(rates['one']):7.1f}")
    print(f"  two replicas, {STREAMS // 2} slots each, nginx: {t:7.1f}  {max(rates['two']):7.1f}  "
          f"(x{t / o:.2f})")
    print(f"nginx per request ({OVERHEAD_REQUESTS} one-token generations each way, medians): direct "
          f"{direct:.1f} ms, through nginx {through:.1f} ms, difference {through - direct:.2f} ms; "
          f"nginx's own (request_time - upstream_time) {logged:.2f} ms")
