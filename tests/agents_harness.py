"""The coding agents' test bench: where `make test` installed them, and a recording proxy.

The agents (Codex CLI, opencode, Continue's ``cn`` from npm; aider from PyPI) are installed by the
Makefile's agents stamp: npm's into ``.venv/agents`` (``npm install --prefix``), aider into its own
venv ``.venv/aider`` (its exact pins — openai, litellm, numpy, ... — would move the test venv's).
When npm itself is missing the stamp writes why into ``.venv/.agents-missing`` and the npm clients'
tests skip with that line; a client that is not there for any other reason fails its test.

``RecordingProxy`` stands between an agent and ``coli serve`` (whose access log is off): a threaded
HTTP/1.1 forwarder that passes each request through unchanged, streams the answer back as it comes
(SSE included) and records method, path, status, the request body and the start of the answer, so
a test can say that every request was answered 2xx and, when one was not, which body caused it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
AGENTS_BIN = ROOT / ".venv" / "agents" / "node_modules" / ".bin"
AGENTS_NOTE = ROOT / ".venv" / ".agents-missing"
AIDER = ROOT / ".venv" / "aider" / "bin" / "aider"
INSTALL_LOG = ROOT / ".venv" / ".agents-install.log"
KEPT_BODY = 4096  # bytes of each answer kept for the report (an error body whole)
CALL_ID = re.compile(rb'"(call_[A-Za-z0-9_-]{1,96})"')  # a tool call's id, as colibri writes them
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection",
        "te", "trailer", "upgrade"}


def agent_bin(name: str) -> Path:
    """The npm-installed ``name``; the test skips only when npm itself was missing at set-up."""
    path = AGENTS_BIN / name
    if path.exists():
        return path
    if AGENTS_NOTE.exists():
        pytest.skip(f"{name}: {AGENTS_NOTE.read_text().strip()}")
    raise AssertionError(f"{path} is missing: `make agents` installs it{_install_log()}")


def aider_bin() -> Path:
    if AIDER.exists():
        return AIDER
    raise AssertionError(f"{AIDER} is missing: `make agents` installs it{_install_log()}")


def _install_log() -> str:
    if not INSTALL_LOG.exists():
        return ""
    return f"; the last install said ({INSTALL_LOG}):\n" + "\n".join(
        INSTALL_LOG.read_text(errors="replace").splitlines()[-15:])


@dataclass
class Exchange:
    method: str
    path: str
    status: int = 0
    request: bytes = b""
    answer: bytes = b""  # the first KEPT_BODY bytes
    call_ids: set[str] = field(default_factory=set)  # tool call ids anywhere in the answer
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def body(self) -> dict:
        try:
            return json.loads(self.request)
        except ValueError:
            return {}

    def brief(self) -> str:
        return f"{self.method} {self.path} -> {self.status} ({self.seconds:.1f}s): {self.answer[:600]!r}"


@dataclass
class RecordingProxy:
    upstream: str  # http://127.0.0.1:PORT
    exchanges: list[Exchange] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> RecordingProxy:
        proxy = self
        up = urlsplit(self.upstream)

        class Handler(_Forward):
            host, port, record = up.hostname, up.port, proxy.exchanges.append

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def settle(self, timeout: float) -> list[Exchange]:
        """Every exchange so far, once each has ended (an agent may leave one running as it exits)."""
        deadline = time.monotonic() + timeout
        for e in list(self.exchanges):
            e.done.wait(max(deadline - time.monotonic(), 0.01))
        return list(self.exchanges)

    def mark(self) -> int:
        return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        return list(self.exchanges[mark:])

    @staticmethod
    def report(exchanges: list[Exchange]) -> str:
        return "\n".join(e.brief() for e in exchanges)


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    host: str
    port: int
    record = staticmethod(lambda exchange: None)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def _forward(self) -> None:
        started = time.monotonic()
        length = int(self.headers.get("content-length") or 0)
        data = self.rfile.read(length) if length else b""
        exchange = Exchange(self.command, self.path, request=data)
        self.record(exchange)  # listed at once: a request still in flight is not missed
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
        try:
            conn.request(self.command, self.path, body=data, headers=headers)
            resp = conn.getresponse()
            exchange.status = resp.status
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            bodyless = self.command == "HEAD" or resp.status in (204, 304)
            if not bodyless:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            tail = b""
            while not bodyless and (piece := resp.read1(65536)):
                exchange.call_ids |= {m.decode() for m in CALL_ID.findall(tail + piece)}
                tail = piece[-128:]  # an id split between two reads
                if len(exchange.answer) < KEPT_BODY:
                    exchange.answer += piece[: KEPT_BODY - len(exchange.answer)]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            if not bodyless:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except OSError as e:  # the client left (an agent's own timeout) or the server failed
            exchange.answer += f" [proxy: {e!r}]".encode()
            self.close_connection = True
        finally:
            conn.close()
            exchange.seconds = time.monotonic() - started
            exchange.done.set()

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward


def scratch_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment for an agent: its own HOME/XDG dirs, no real keys, no telemetry."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SSL_CERT_FILE", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    node = shutil.which("node")
    if node:
        env["PATH"] = f"{Path(node).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    for sub in ("config", "data", "cache", "state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / "config"), XDG_DATA_HOME=str(home / "data"),
               XDG_CACHE_HOME=str(home / "cache"), XDG_STATE_HOME=str(home / "state"),
               NO_COLOR="1", CI="1", TERM="dumb", DO_NOT_TRACK="1")
    env.update(extra)
    return env


@dataclass
class Run:
    args: list[str]
    code: int
    out: str
    err: str
    seconds: float

    def describe(self) -> str:
        return (f"{' '.join(self.args[:3])}... exited {self.code} after {self.seconds:.0f}s\n"
                f"--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-3000:]}")


def run_agent(args: list[str], cwd: Path, env: dict[str, str], timeout: float,
              stdin: str = "") -> Run:
    """Run an agent to the end of its turn (``PWD`` set with ``cwd``: the node agents read it)."""
    env = {**env, "PWD": str(cwd)}
    started = time.monotonic()
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and what it started (node's native binary)
        out, err = proc.communicate()
        code, err = -1, err + f"\n[timed out after {timeout}s]"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of it outlives the turn
        except ProcessLookupError:
            pass
    return Run(args, code, out, err, time.monotonic() - started)
