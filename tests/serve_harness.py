"""Drive a real ``coli serve`` process from tests: start it, address it, signal it, find its engine.

``ServerProcess.start`` runs ``python -m colibri serve --port 0 --no-persist ...`` with the real
default model, waits for ``colibri: serving <model-id> on http://HOST:PORT`` on stderr and parses
the address. Stderr is drained by a thread (the engine child writes to the same pipe), so a chatty
server never blocks on a full pipe, and what it said is at hand for assertion messages.

Also: the engine child's pid (from /proc, no psutil), raw HTTP over a socket for requests a client
library would normalise or refuse to send, a bound SSE reader, and what the end-to-end files share
(the arguments of their shared server, a chat message, the check of an error body).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

STARTUP_TIMEOUT = 120.0  # a cold numba cache compiles the kernels first
LOAD_STARTUP_TIMEOUT_S = 180  # the same, on a machine the load tests keep busy
STOP_TIMEOUT = 60.0
REQUEST_TIMEOUT = 120.0
SERVING = re.compile(r"colibri: serving (?P<model>\S+) on (?P<url>\S+)")
# Settings the environment could carry into the server; the tests give theirs explicitly.
_SCRUB = (
    "COLI_API_KEY", "COLI_HOST", "COLI_PORT", "COLI_MODEL_ID", "COLI_KV_SLOTS", "COLI_MAX_QUEUE",
    "COLI_QUEUE_TIMEOUT", "COLI_CORS_ORIGINS", "COLI_WEB_DIST", "COLI_STATE_DIR", "COLI_CTX",
    "COLI_PREFILL_CHUNK", "COLI_MAX_BODY_MB", "COLI_BODY_TIMEOUT", "COLI_MAX_REQUESTS", "COLI_KEEP_ALIVE",
    "COLI_DRAIN_TIMEOUT", "COLI_PREFIX_SHARE", "COLI_REPLICA_ID", "COLI_WRITE_TIMEOUT",
    "COLI_SPECULATIVE", "COLI_DRAFT_MAX", "COLI_DRAFT_MIN", "COLI_TEMPERATURE", "COLI_TOP_P",
    "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KV_SLOTS", "SERVE", "SERVE_BATCH", "SERVE_TOPK",
)


LONG_Q = "Write a very long story about a dragon, with many chapters."  # a generation that runs on
UI_ORIGIN = "https://ui.example"  # a browser origin allowed beside the defaults
# The server each end-to-end file shares among its tests: one more CORS origin, and --web-dist naming
# no directory so the page is "not built", whatever the checkout holds.
SHARED_SERVER_ARGS = ("--cors-origin", UI_ORIGIN, "--web-dist", "/nonexistent/web/dist", "--ctx", "1024")


def server_env(**overrides: str | None) -> dict[str, str]:
    """The test process's environment without the server's settings, plus ``overrides`` (None drops)."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def serve_command(*args: str) -> list[str]:
    """``--no-persist`` unless the test names a ``--state-dir`` of its own."""
    persist = [] if "--state-dir" in args else ["--no-persist"]
    return [sys.executable, "-m", "colibri", "serve", "--port", "0", *persist, *args]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    base_url: str = ""  # http://127.0.0.1:PORT, connectable even when bound to 0.0.0.0
    bound: str = ""  # the address as printed
    model_id: str = ""
    _serving: threading.Event = field(default_factory=threading.Event)
    _eof: threading.Event = field(default_factory=threading.Event)

    # ---------------------------------------------------------------- life cycle

    @classmethod
    def start(cls, *args: str, env: dict[str, str] | None = None,
              timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        proc = subprocess.Popen(
            serve_command(*args), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env if env is not None else server_env(),
            start_new_session=True,  # its own process group: a failed test can still kill it all
        )
        server = cls(proc)
        threading.Thread(target=server._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not server._serving.wait(0.1):
            if proc.poll() is not None and server._eof.is_set():
                raise RuntimeError(f"coli serve exited {proc.returncode} before serving:\n{server.log}")
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"coli serve did not start in {timeout:.0f}s:\n{server.log}")
        return server

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            m = SERVING.search(line)
            if m and not self._serving.is_set():
                self.model_id, self.bound = m["model"], m["url"]
                u = urlsplit(self.bound if "://" in self.bound else f"http://{self.bound}")
                host = u.hostname or "127.0.0.1"
                if host in ("0.0.0.0", "::"):
                    host = "127.0.0.1" if host == "0.0.0.0" else "::1"
                host = f"[{host}]" if ":" in host else host
                self.base_url = f"http://{host}:{u.port}"
                self._serving.set()
        self._eof.set()

    @property
    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    @property
    def port(self) -> int:
        return int(urlsplit(self.base_url).port or 0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        code = self.proc.wait(timeout)
        self._eof.wait(5)
        return code

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait; the exit status (the caller asserts it)."""
        if self.proc.poll() is None:
            self.terminate()
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the whole process group (the server and its engine)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    # ---------------------------------------------------------------- clients

    def client(self, api_key: str = "unused", timeout: float = REQUEST_TIMEOUT, **kw) -> openai.OpenAI:
        """The official SDK, no retries (a 503 or 429 must reach the test as it is)."""
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=timeout, **kw)

    def http(self, timeout: float = REQUEST_TIMEOUT, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, **kw)

    # ---------------------------------------------------------------- the engine child

    def engine_pid(self, timeout: float = 10.0) -> int:
        """The pid of the ``coli engine`` child (waits for one, e.g. during a restart)."""
        deadline = time.monotonic() + timeout
        while True:
            for pid in child_pids(self.pid):
                if "engine" in cmdline(pid):
                    return pid
            if time.monotonic() > deadline:
                raise AssertionError(f"no engine child of {self.pid}:\n{self.log}")
            time.sleep(0.05)


class LoadServer:
    """``python -m colibri serve`` on port 0 for the load tests; its stderr goes to a file, read for
    the bound address, so what a long run printed is kept whole. No ``COLI_*`` setting leaks in."""

    def __init__(self, *extra: str) -> None:
        self.log = Path(tempfile.mkdtemp(prefix="coli-load-")) / "stderr.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}  # no stray key or port
        env["XDG_STATE_HOME"] = str(self.log.parent)
        cmd = [sys.executable, "-m", "colibri", "serve", "--port", "0", "--no-persist", *extra]
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err, env=env)
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + LOAD_STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("colibri: serving ") and " on " in line:
                    url = line.rsplit(" on ", 1)[1].strip()
                    return url if url.startswith("http") else f"http://{url}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.proc.kill()
        self.proc.wait()
        pytest.fail(f"the server did not start (status {self.proc.returncode}):\n{self.stderr()}")

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int | None:
        """SIGTERM; the exit status, or None if it had to be killed (a leaked slot blocks the drain)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A server for the block; stopped with SIGTERM after it, which must exit 0."""
    server = ServerProcess.start(*args, env=env)
    try:
        yield server
    except BaseException:
        server.kill()
        raise
    code = server.stop()
    assert code == 0, f"coli serve exited {code}:\n{server.log}"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def error_body(response) -> dict:
    """An OpenAI-shaped error body: {"error": {"message", "type", ...}}."""
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    assert isinstance(body["error"].get("message"), str) and body["error"].get("type"), body
    return body["error"]


# -------------------------------------------------------------------- /proc


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``: /proc/PID/task/*/children, else a scan of /proc/*/stat."""
    found: list[int] = []
    tasks = Path(f"/proc/{pid}/task")
    try:
        for task in tasks.iterdir():
            found += [int(x) for x in (task / "children").read_text().split()]
        return found
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        pass
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # the name may hold spaces and parentheses
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] != "Z"


# -------------------------------------------------------------------- raw HTTP


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def raw_request(base_url: str, data: bytes, timeout: float = 30.0) -> RawResponse:
    """Send ``data`` as is and read one response (to its length, the end of its chunks or the close).

    The server need not close after ``Connection: close`` (hypercorn keeps the socket until the
    client leaves), so the body is delimited by its framing.
    """
    u = urlsplit(base_url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(data)
        buf = b""
        while True:
            if _complete(buf):
                break
            piece = sock.recv(65536)
            if not piece:
                break
            buf += piece
    return parse_response(buf)


def _complete(buf: bytes) -> bool:
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head.split(b" ", 2)[1:2] == [b"100"]:  # 100 Continue: the real answer follows
        return _complete(body)
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip().lower()
    if b"content-length" in fields:
        return len(body) >= int(fields[b"content-length"])
    if fields.get(b"transfer-encoding") == b"chunked":
        return body.endswith(b"0\r\n\r\n")
    return False  # delimited by the close


def raw_get(base_url: str, target: str, host: str | None = None, extra: str = "",
            timeout: float = 30.0) -> RawResponse:
    """GET ``target`` byte for byte (no client normalising ``..`` or ``%2e``)."""
    u = urlsplit(base_url)
    host = host if host is not None else f"localhost:{u.port}"
    req = f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
    return raw_request(base_url, req.encode("latin-1"), timeout)


def parse_response(raw: bytes) -> RawResponse:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        raise AssertionError(f"not an HTTP response: {raw[:200]!r}")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return RawResponse(status, headers, body)


def _dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            break
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            break
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2
    return b"".join(out)


def read_to_close(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes; AssertionError if it is still open at ``deadline``."""
    data = b""
    while True:
        # At least a short wait even past the deadline: what was sent long ago is read at once.
        sock.settimeout(max(deadline - time.monotonic(), 0.5))
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise AssertionError(f"the server kept the connection open (got {data[:80]!r})") from None
            continue
        except ConnectionResetError:
            return data
        if not piece:
            return data
        data += piece


# -------------------------------------------------------------------- SSE


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of an SSE stream (httpx ``iter_lines``)."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def read_sse(response: httpx.Response) -> list[str]:
    return list(sse_events(response.iter_lines()))


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; that value, or AssertionError."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, OSError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


# -------------------------------------------------------------------- sd_notify


class NotifySocket:
    """An AF_UNIX datagram socket standing in for systemd's ``$NOTIFY_SOCKET``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def wait_for(self, assignment: str, timeout: float) -> list[str]:
        """Receive until a datagram holds the line ``assignment`` (e.g. READY=1); all received."""
        deadline = time.monotonic() + timeout
        while not any(assignment in m.splitlines() for m in self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {assignment} on {self.path}; got {self.messages}")
            self.sock.settimeout(left)
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
        return self.messages

    def close(self) -> None:
        self.sock.close()
