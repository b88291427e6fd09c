"""Decode throughput through ``coli serve`` (HTTP, SSE) versus the engine protocol directly.

    python bench/bench_http.py [--model PATH] [--runs 7] [--tokens 64] [--streams 1,4]
    python bench/bench_http.py --nginx [--runs 5] [--tokens 64]    (replicas behind nginx)

Two processes side by side, each with 4 KV slots and no persistence: ``coli engine`` driven over
its stdin/stdout (mux protocol), and ``coli serve`` on a loopback port driven with streaming chat
completions (SSE over blocking sockets, read with h11). The engine gets the environment ``coli
serve`` gives its own engine (``SERVE_TOPK=1 SERVE_BATCH=1``) and the very prompts the server
renders with the model's chat template, and both sides pin request i to slot i, so the two paths
run the same work.

A run submits N greedy requests at once. Its figure is the tokens per second of all streams
together from the moment every stream has its first token (prefill excluded) to the last token:
the tokens that arrive in that window over its length. Runs alternate between the two paths (both
processes stay up, the idle one costs nothing), and each figure is the median of --runs runs.
The goal: the HTTP layer costs at most 5% (HTTP/engine >= 0.95). The best run of each is printed
too: on a shared machine it is the figure least disturbed by other load.

The clients share the machine with the servers: on a small machine their parsing is part of what
is measured, on both sides alike (a Python reader of each protocol, blocking reads into a sans-IO
parser: the engine's ``ResponseReader``, h11 and the SSE frames' JSON). A second table gives the CPU
time per generated token of the client, the HTTP server and the engine (from /proc): the server's
share of the engine's is the HTTP layer's cost in CPU, a figure that the speed of a shared or
busy machine moves far less than the rates.

``--nginx``: 8 concurrent streams (no ``cache_slot``) into one ``coli serve`` with 8 slots, against
the same 8 through nginx (``coli deploy nginx``) into two replicas of 4 slots each, 4 streams per
replica (conversation keys chosen by where the hash sends them); runs alternate. Then nginx's cost
per request: a one-token generation sent to a replica directly and through nginx, in turn, the
median difference of their latencies, and nginx's own figure from its access log (request_time
less upstream_response_time).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import h11

from colibri.io.events import Done, Error, Ready, Submit, TopK
from colibri.io.mux import ResponseReader, encode_request

QUESTIONS = [
    "Tell me about the ocean.", "Describe a forest in spring.", "Explain how a bicycle works.",
    "Write about a city at night.", "Describe a mountain hike.", "Tell me about the moon.",
    "Explain what a library is for.", "Describe a thunderstorm.",
]
SLOTS = 4
STARTUP_TIMEOUT_S = 300  # a cold numba cache compiles the kernels first


def render_prompts(model: Path) -> list[str]:
    """Each question as ``coli serve`` renders it (the model's template, thinking off)."""
    from colibri.model.text import ModelText

    text = ModelText.open(model)  # what coli serve renders with
    return [text.render([{"role": "user", "content": q}], enable_thinking=False) for q in QUESTIONS]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without COLI_* settings (flags say it all), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("COLI_")}, **extra}


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; NaN where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def child_pid(pid: int) -> int | None:
    """A child of a process (coli serve's engine), found through /proc; None where it cannot say."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


@dataclass
class Sample:
    rate: float  # tok/s in the decode window
    tokens: int  # all the tokens the run generated
    cpu: dict[str, float]  # CPU seconds during the run: client, server (HTTP only), engine


class CpuMeter:
    """CPU seconds the bench itself and the given processes use across a block."""

    def __init__(self, **pids: int | None) -> None:
        self.pids = {name: pid for name, pid in pids.items() if pid is not None}

    def __enter__(self) -> CpuMeter:
        self.start = {"client": time.process_time(), **{n: proc_cpu_s(p) for n, p in self.pids.items()}}
        return self

    def __exit__(self, *exc) -> None:
        end = {"client": time.process_time(), **{n: proc_cpu_s(p) for n, p in self.pids.items()}}
        self.used = {n: end[n] - self.start[n] for n in end}


def window_rate(arrivals: list[list[float]]) -> tuple[float, int]:
    """(tokens/s, tokens) from per-stream token arrival times: the window opens when the last stream
    has its first token and closes at the last token of all."""
    start = max(times[0] for times in arrivals)
    end = max(times[-1] for times in arrivals)
    tokens = sum(1 for times in arrivals for t in times if t > start)
    return (tokens / (end - start) if end > start else float("nan")), tokens


class Engine:
    """``coli engine`` over pipes, read synchronously (as bench_engine.py)."""

    def __init__(self, model: Path) -> None:
        cmd = [sys.executable, "-m", "colibri", "engine", "--model", str(model), "--kv-slots", str(SLOTS),
               "--no-persist"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=clean_env(SERVE_TOPK="1", SERVE_BATCH="1"))
        self.reader = ResponseReader()
        self.next_id = 1
        for event in self._events():
            if isinstance(event, Ready):
                break

    def _events(self):
        while True:
            data = self.proc.stdout.read1(1 << 16)
            if not data:
                raise RuntimeError("the engine exited")
            yield from self.reader.receive_data(data)

    def run(self, prompts: list[str], tokens: int) -> Sample:
        with CpuMeter(engine=self.proc.pid) as cpu:
            rate, emitted = self._run(prompts, tokens)
        return Sample(rate, emitted, cpu.used)

    def _run(self, prompts: list[str], tokens: int) -> tuple[float, int]:
        ids = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        self.proc.stdin.write(b"".join(encode_request(Submit(rid, slot, tokens, 0.0, 1.0, prompt))
                                       for slot, (rid, prompt) in enumerate(zip(ids, prompts, strict=True))))
        self.proc.stdin.flush()
        arrivals: dict[int, list[float]] = {rid: [] for rid in ids}
        emitted, pending = 0, set(ids)
        for event in self._events():
            if isinstance(event, TopK) and event.id in pending:
                arrivals[event.id].append(time.perf_counter())  # one TOPK per generated token
            elif isinstance(event, Done) and event.id in pending:
                emitted += event.emitted
                pending.discard(event.id)
            elif isinstance(event, Error) and event.id in pending:
                raise RuntimeError(f"the engine refused a request: {event}")
            if not pending:
                break
        got = sum(len(a) for a in arrivals.values())
        if got != emitted:
            raise RuntimeError(f"counted {got} tokens, the engine says {emitted}")
        return window_rate(list(arrivals.values()))[0], emitted

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class SseStream:
    """One streamed chat completion over a blocking socket, read with h11 (sans-IO, as the engine
    path's reader): the HTTP path's client as light as the engine path's, so that the figure is the
    server's cost and not an HTTP client library's (httpx on trio took 0.75 ms of CPU a token here
    against 0.13 for the engine path's reader)."""

    def __init__(self, host: str, port: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h11.Connection(h11.CLIENT)
        self.request = b"".join((
            self.conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=[
                ("Host", f"{host}:{port}"), ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))), *headers])),
            self.conn.send(h11.Data(data=body)), self.conn.send(h11.EndOfMessage())))
        self.pending = b""
        self.arrivals: list[float] = []
        self.usage = 0

    def send(self) -> None:
        self.sock.sendall(self.request)

    def receive(self) -> bool:
        """Read what the socket has; True once the response has ended."""
        self.conn.receive_data(self.sock.recv(1 << 16))
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                return False
            if isinstance(event, h11.Response) and event.status_code != 200:
                raise RuntimeError(f"HTTP {event.status_code}")
            if isinstance(event, h11.Data):
                self._frames(bytes(event.data))
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return True

    def _frames(self, data: bytes) -> None:
        *frames, self.pending = (self.pending + data).split(b"\n\n")
        for frame in frames:
            if not frame.startswith(b"data: {"):
                continue
            obj = json.loads(frame[6:])
            if "error" in obj:
                raise RuntimeError(f"error in the stream: {obj}")
            if obj.get("usage"):
                self.usage = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices") or ():
                delta = choice["delta"]
                # one frame per generated token: content present, not the role frame, not the end
                if "content" in delta and "role" not in delta and choice["finish_reason"] is None:
                    self.arrivals.append(time.perf_counter())


class Server:
    """``coli serve`` on a free loopback port; stderr to a file, read for the address. ``url``: where
    the streams are sent (nginx in front, for --nginx); ``sessions``: their X-Session-Id headers,
    and then no cache_slot (the replica chooses)."""

    url: str
    target: str | None = None
    sessions: list[str] | None = None

    def __init__(self, model: Path, slots: int = SLOTS, name: str = "") -> None:
        self.log = Path(tempfile.mkdtemp(prefix="coli-bench-http-")) / "stderr.log"
        cmd = [sys.executable, "-m", "colibri", "serve", "--model", str(model), "--port", "0",
               "--no-persist", "--kv-slots", str(slots), "--max-queue", "8"]
        cmd += ["--replica-id", name] if name else []
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err, env=clean_env())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("colibri: serving ") and " on " in line:
                    url = line.rsplit(" on ", 1)[1].strip()
                    self.url = url if url.startswith("http") else f"http://{url}"
                    return
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"the server did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    def run(self, questions: list[str], tokens: int) -> Sample:
        with CpuMeter(server=self.proc.pid, engine=child_pid(self.proc.pid)) as cpu:
            rate, emitted = self._run(questions, tokens)
        return Sample(rate, emitted, cpu.used)

    def _run(self, questions: list[str], tokens: int) -> tuple[float, int]:
        target = urlsplit(self.target or self.url)
        streams = []
        for i, question in enumerate(questions):
            body = {"model": "bench", "messages": [{"role": "user", "content": question}],
                    "max_tokens": tokens, "temperature": 0, "stream": True, "cache_slot": i,
                    "stream_options": {"include_usage": True}}
            headers = []
            if self.sessions is not None:
                del body["cache_slot"]
                headers.append(("X-Session-Id", self.sessions[i]))
            # connections opened beforehand: the run measures streaming, not TCP
            streams.append(SseStream(target.hostname, target.port, json.dumps(body).encode(), headers))
        try:
            for stream in streams:
                stream.send()
            with selectors.DefaultSelector() as sel:
                for stream in streams:
                    sel.register(stream.sock, selectors.EVENT_READ, stream)
                while sel.get_map():
                    for key, _ in sel.select():
                        if key.data.receive():
                            sel.unregister(key.fileobj)
        finally:
            for stream in streams:
                stream.sock.close()
        arrivals, usage = [s.arrivals for s in streams], sum(s.usage for s in streams)
        got = sum(len(a) for a in arrivals)
        if got != usage:
            raise RuntimeError(f"counted {got} token frames, usage says {usage}")
        return window_rate(arrivals)[0], usage

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--nginx", action="store_true", help="two replicas behind nginx against one")
    return ap


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    from colibri.settings import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    if args.nginx:
        from bench_nginx import replicas_main

        return replicas_main(model, Server, args.runs, args.tokens)
    streams = [int(x) for x in args.streams.split(",")]
    if max(streams) > SLOTS:
        ap.error(f"at most {SLOTS} streams")
    prompts = render_prompts(model)
    engine, server = Engine(model), Server(model)
    try:
        for n in streams:  # warm-up at every width: first-call costs (kernel compiles) out of the figures
            engine.run(prompts[:n], args.tokens)
            server.run(QUESTIONS[:n], args.tokens)
        results: dict[int, dict[str, list[Sample]]] = {}
        for n in streams:
            samples: dict[str, list[Sample]] = {"engine": [], "http": []}
            for r in range(args.runs):
                # alternate which goes first, so a drift in the machine's speed hits both alike
                for path in ("engine", "http") if r % 2 == 0 else ("http", "engine"):
                    if path == "engine":
                        samples[path].append(engine.run(prompts[:n], args.tokens))
                    else:
                        samples[path].append(server.run(QUESTIONS[:n], args.tokens))
                print(f"  streams {n} run {r + 1}: engine {samples['engine'][-1].rate:.1f} tok/s, "
                      f"http {samples['http'][-1].rate:.1f} tok/s", file=sys.stderr, flush=True)
            results[n] = samples
    finally:
        engine.close()
        server.close()
    print(f"decode tok/s of all streams together, {args.tokens} tokens each, greedy, {args.runs} runs: "
          "median, and best (the least disturbed by other load)")
    print(f"{'streams':>8}{'engine':>10}{'http':>10}{'http/engine':>13}{'engine best':>13}{'http best':>11}"
          f"{'ratio best':>12}")
    for n, samples in results.items():
        e = statistics.median(x.rate for x in samples["engine"])
        h = statistics.median(x.rate for x in samples["http"])
        eb, hb = max(x.rate for x in samples["engine"]), max(x.rate for x in samples["http"])
        print(f"{n:8d}{e:10.1f}{h:10.1f}{h / e:13.3f}{eb:13.1f}{hb:11.1f}{hb / eb:12.3f}")
    print("\nCPU ms per generated token, median of the runs (client: this script's reader of each protocol)")
    print(f"{'streams':>8}{'engine path: client':>21}{'engine':>8}{'http path: client':>19}{'server':>8}"
          f"{'engine':>8}{'server/engine':>15}")

    def per_token(xs: list[Sample], who: str) -> float:
        return statistics.median(1000 * x.cpu.get(who, float("nan")) / x.tokens for x in xs)

    for n, samples in results.items():
        e, h = samples["engine"], samples["http"]
        server, engine_cpu = per_token(h, "server"), per_token(h, "engine")
        print(f"{n:8d}{per_token(e, 'client'):21.2f}{per_token(e, 'engine'):8.2f}"
              f"{per_token(h, 'client'):19.2f}{server:8.2f}{engine_cpu:8.2f}{server / engine_cpu:14.1%}")

if __name__ == "__main__":
    main()
