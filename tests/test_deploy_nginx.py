"""Two ``coli serve`` replicas behind the real nginx, configured by ``coli deploy nginx``.

With the official SDK and ``X-Session-Id`` headers: a conversation's turns reach one replica (its
``x-colibri-replica``) and reuse their prefix there; a stream arrives token by token (its first token
is in while the replica is still generating); a replica killed with SIGKILL costs no request that had
not started (the next ones go to the other, all 200), and it rejoins once restarted.

nginx is Debian's (``make test`` installs it with apt-get, as it does chromium); where it could not
be installed the tests that run it skip with the reason the Makefile recorded.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_harness import REQUEST_TIMEOUT, ServerProcess, user, wait_until

NGINX = Path("/usr/sbin/nginx")
NGINX_NOTE = Path(__file__).parent.parent / ".venv" / ".nginx-missing"  # the Makefile's reason


def need_nginx() -> None:
    if not NGINX.is_file():
        why = NGINX_NOTE.read_text().strip() if NGINX_NOTE.is_file() else "not installed"
        pytest.skip(f"nginx ({NGINX}) is missing: {why} (`make test` installs it: `apt-get install nginx`)")

REPLICA_ARGS = ("--kv-slots", "2", "--ctx", "1024", "--web-dist", "/nonexistent/web/dist")
FAIL_TIMEOUT_S = 1  # the passive health check's window: short, so the rejoin is seen soon
NGINX_START_S = 30.0
REJOIN_TIMEOUT_S = 60.0
MAX_SESSIONS = 16  # candidate conversation keys tried until each replica holds one conversation
QUESTIONS = ["Name one colour of the sea, in a few words.", "Why is that so?", "And at night?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(name: str, port: int) -> ServerProcess:
    return ServerProcess.start(*REPLICA_ARGS, "--port", str(port), "--replica-id", name)


def deploy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri", "deploy", "nginx", *args], capture_output=True,
                          text=True)


def test_deploy_nginx_prints_the_directives_and_refuses_bad_addresses():
    out = deploy("--listen", "0.0.0.0:8080", "--replica", "10.0.0.1:8001", "--replica", "[::1]:8002")
    assert out.returncode == 0, out.stderr
    conf = out.stdout
    for directive in ("hash $http_x_session_id consistent;", "least_conn;", "proxy_buffering off;",
                      "proxy_next_upstream error timeout;", "proxy_read_timeout 3600s;",
                      "server 10.0.0.1:8001 max_fails=1 fail_timeout=10s;", "server [::1]:8002 max_fails=1",
                      "proxy_set_header Authorization $http_authorization;", "listen 0.0.0.0:8080;"):
        assert directive in conf, directive
    assert "non_idempotent" not in conf.replace("(no `non_idempotent`)", "")  # a started POST is never resent
    for bad in (["--listen", "x:80;", "--replica", "a:1"], ["--listen", "a:1", "--replica", "a:1; b"],
                ["--listen", "a:1", "--replica", "a:99999"], ["--listen", "a:1", "--replica", "a:1",
                                                             "--replica", "a:1"]):
        out = deploy(*bad)
        assert out.returncode != 0 and out.stderr.startswith("coli: error: ") and not out.stdout, bad


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """{"r1": ServerProcess, "r2": ServerProcess} and nginx's base URL; the test may replace r1."""
    need_nginx()
    ports = {"r1": free_port(), "r2": free_port()}
    replicas = {name: start_replica(name, port) for name, port in ports.items()}
    prefix = tmp_path_factory.mktemp("nginx")
    (prefix / "logs").mkdir()
    listen = free_port()
    args = ["deploy", "nginx", "--listen", f"127.0.0.1:{listen}", "--fail-timeout", str(FAIL_TIMEOUT_S)]
    for port in ports.values():
        args += ["--replica", f"127.0.0.1:{port}"]
    conf = subprocess.run([sys.executable, "-m", "colibri", *args], capture_output=True, text=True,
                          check=True).stdout
    (prefix / "nginx.conf").write_text(conf)
    # daemon off: a child the test owns; user root: as root, workers would run as nobody, who cannot
    # enter pytest's private temporary directory (a real install gives nginx its own prefix).
    proc = subprocess.Popen([str(NGINX), "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                             "-g", "daemon off; user root;"], stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{listen}"
    try:
        wait_until(lambda: httpx.get(url + "/health").status_code == 200 or proc.poll() is not None,
                   NGINX_START_S, what="nginx")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        yield {"replicas": replicas, "url": url, "ports": ports, "log": prefix / "logs"}
    finally:
        proc.terminate()
        proc.wait(10)
        for r in replicas.values():
            r.kill()


def client(url: str, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT,
                         default_headers=headers)


def turn(c: openai.OpenAI, messages: list[dict], max_tokens: int = 6) -> dict:
    raw = c.chat.completions.with_raw_response.create(model="any", messages=messages, max_tokens=max_tokens,
                                                      temperature=0)
    answer = raw.parse()
    return {"replica": raw.headers["x-colibri-replica"], "text": answer.choices[0].message.content,
            "reused": answer.model_extra["colibri"]["reused_tokens"], "prompt": answer.usage.prompt_tokens}


@pytest.fixture(scope="module")
def conversations(cluster) -> dict[str, dict]:
    """One conversation per replica: {replica: {"session", "messages", "turns"}}, first turn done.
    Keys are tried until the hash has put one on each (which keys go where depends on the ports),
    by /health, which nginx routes by the key as any other path: a generation would take a slot,
    and a third key's turn on a replica could evict a chosen conversation's (each slot's cache is
    its own session's: a slot another session filled is forgotten, not reused)."""
    sessions: dict[str, str] = {}
    for i in range(MAX_SESSIONS):
        session = f"conv-{i}"
        health = httpx.get(cluster["url"] + "/health", headers={"X-Session-Id": session})
        sessions.setdefault(health.headers["x-colibri-replica"], session)
        if len(sessions) == 2:
            break
    else:
        pytest.fail(f"{MAX_SESSIONS} session ids all hashed to {list(sessions)}")
    found: dict[str, dict] = {}
    for replica, session in sessions.items():
        messages = user(QUESTIONS[0])
        got = turn(client(cluster["url"], session), messages)
        assert got["replica"] == replica, (session, got)
        messages.append({"role": "assistant", "content": got["text"]})
        found[replica] = {"session": session, "messages": messages, "turns": [got]}
    return found


def test_a_conversation_stays_on_its_replica_and_reuses_its_prefix(cluster, conversations):
    assert set(conversations) == {"r1", "r2"}
    for replica, conv in conversations.items():
        c = client(cluster["url"], conv["session"])
        for question in QUESTIONS[1:]:
            prev = conv["turns"][-1]
            conv["messages"].append({"role": "user", "content": question})
            got = turn(c, conv["messages"])
            conv["messages"].append({"role": "assistant", "content": got["text"]})
            conv["turns"].append(got)
            assert got["replica"] == replica, (conv["session"], got)
            assert prev["prompt"] <= got["reused"] < got["prompt"], (conv["session"], got, prev)


def test_requests_without_a_session_are_served(cluster):
    seen = {turn(client(cluster["url"]), user("Say hello."), max_tokens=2)["replica"] for _ in range(4)}
    assert seen <= {"r1", "r2"} and seen


def test_streaming_is_not_buffered(cluster, conversations):
    """The first token arrives while its replica is still generating: nginx passed it on at once."""
    conv = conversations["r2"]
    replica = cluster["replicas"]["r2"]
    c = client(cluster["url"], conv["session"])
    with c.chat.completions.with_streaming_response.create(
        model="any", messages=user("Write a very long story about a dragon."), max_tokens=400,
        temperature=0, stream=True,
    ) as response:
        assert response.headers["x-colibri-replica"] == "r2"
        lines = response.iter_lines()
        first = next(line for line in lines if '"content":"' in line.replace(" ", ""))
        active = httpx.get(replica.base_url + "/health").json()["active"]  # straight to the replica
        assert active >= 1, f"the stream's first token ({first[:80]}) came only after the generation"
        rest = [line for line in lines if line.startswith("data:")]
    assert len(rest) > 10 and rest[-1] == "data: [DONE]"  # the rest followed, chunk by chunk


def test_a_killed_replica_costs_no_unstarted_request_and_rejoins(cluster, conversations):
    url, conv = cluster["url"], conversations["r1"]
    cluster["replicas"]["r1"].kill()  # SIGKILL to the replica and its engine
    # Its conversation and fresh ones now go to r2; nginx retries the refused connections there.
    for session in (conv["session"], None, conv["session"], None):
        got = turn(client(url, session), user("Still there?"), max_tokens=2)
        assert got["replica"] == "r2"
    with client(url, conv["session"]).chat.completions.create(
        model="any", messages=user("Count to five."), max_tokens=8, temperature=0, stream=True
    ) as stream:
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)
    cluster["replicas"]["r1"] = start_replica("r1", cluster["ports"]["r1"])
    time.sleep(FAIL_TIMEOUT_S)  # nginx tries r1 again only once its failure window has passed

    def back_on_r1() -> bool:
        return turn(client(url, conv["session"]), user("Hello again."), max_tokens=1)["replica"] == "r1"

    wait_until(back_on_r1, REJOIN_TIMEOUT_S, interval=0.5, what="the restarted replica to rejoin")
    log = (cluster["log"] / "access.log").read_text()
    statuses = [line.split('" ', 1)[1].split()[0] for line in log.splitlines() if '" ' in line]
    assert statuses and all(s == "200" for s in statuses), log[-2000:]
    retried = [line for line in log.splitlines() if "upstream_status=502, 200" in line]
    assert retried, log[-2000:]  # nginx found r1 dead on a request and sent that request to r2
