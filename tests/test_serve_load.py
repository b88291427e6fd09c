"""``coli serve`` under load: admission, the FIFO queue, 429s, disconnects, and no slot leaks.

A real server (the default model, 4 KV slots, a queue of 8) on loopback. The greedy text of each prompt
is first taken alone; then many concurrent streaming clients must each get either that exact text
(batching changes nothing) or a 429 before any streaming header, and ``/health`` must account for
every one of them. Clients that vanish at random moments must leave no slot behind.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest
import trio
from serve_harness import LoadServer

MAX_TOKENS = 16
N_CLIENTS = 32
N_DISCONNECTS = 16
N_COMPLETERS = 3
LONG_TOKENS = 48  # the completers among the leaving clients: they outlast most of the disconnects
LEAVING_MAX_TOKENS = 256  # the leaving clients: long enough that they leave mid-answer
MAX_FRAMES_BEFORE_LEAVING = 8
HOLDING_TOKENS = 1500  # the request that holds the only slot while another times out in the queue
HTTP_TIMEOUT = httpx.Timeout(240.0, connect=30.0)

PROMPTS = [
    "Tell me about the ocean.",
    "Describe a forest in spring.",
    "Explain how a bicycle works.",
    "Write about a city at night.",
    "Tell me about the moon.",
    "Describe a thunderstorm.",
    "Tell me about honey bees.",
    "Explain how bread is made.",
]


# --- the server process -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = LoadServer("--kv-slots", "4", "--max-queue", "8")
    yield srv
    status = srv.stop()
    assert status == 0, f"SIGTERM: exit status {status} (None: did not stop)\n{srv.stderr()}"


# --- requests and SSE -------------------------------------------------------------------------------


def chat_body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": "any",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


@dataclass
class Outcome:
    status: int = 0
    content_type: str = ""
    text: str = ""
    finish: list = field(default_factory=list)  # every non-null finish_reason seen
    done: bool = False  # the [DONE] sentinel came, last
    errors: list = field(default_factory=list)  # error objects inside the stream
    body: object = None  # the JSON body of a non-stream (error) answer
    problems: list = field(default_factory=list)


class SSE:
    """Feeds SSE lines, collects the chat deltas, the finish reasons and [DONE]."""

    def __init__(self, out: Outcome) -> None:
        self.out = out

    def line(self, line: str) -> None:
        out = self.out
        if not line.startswith("data: "):
            if line.strip():
                out.problems.append(f"unexpected line {line!r}")
            return
        data = line[len("data: "):]
        if out.done:
            out.problems.append(f"data after [DONE]: {data!r}")
            return
        if data == "[DONE]":
            out.done = True
            return
        obj = json.loads(data)
        if "error" in obj:
            out.errors.append(obj["error"])
            return
        for choice in obj.get("choices", []):
            out.text += choice.get("delta", {}).get("content") or ""
            if choice.get("finish_reason") is not None:
                out.finish.append(choice["finish_reason"])


def check_complete(out: Outcome, reference: str, who: str) -> None:
    assert out.status == 200, f"{who}: status {out.status}"
    assert out.content_type.startswith("text/event-stream"), f"{who}: {out.content_type}"
    assert not out.problems and not out.errors, f"{who}: {out.problems} {out.errors}"
    assert out.done, f"{who}: no [DONE]"
    assert len(out.finish) == 1 and out.finish[0] in ("stop", "length"), f"{who}: finish {out.finish}"
    assert out.text == reference, f"{who}: {out.text!r} != reference {reference!r}"


def check_429(out: Outcome, who: str) -> None:
    """Refused before any streaming header: a plain 429 with an OpenAI-shaped JSON error."""
    assert out.status == 429, who
    assert out.content_type.startswith("application/json"), f"{who}: {out.content_type}"
    err = out.body["error"] if isinstance(out.body, dict) else None
    assert isinstance(err, dict), f"{who}: body {out.body!r}"
    assert set(err) == {"message", "type", "param", "code"}, f"{who}: {err}"
    assert isinstance(err["message"], str) and err["message"], f"{who}: {err}"
    assert err["type"] == "rate_limit_error", f"{who}: {err}"
    assert err["code"] in ("queue_full", "queue_timeout"), f"{who}: {err}"


async def stream_chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = MAX_TOKENS,
                      headers_seen: trio.Event | None = None) -> Outcome:
    out = Outcome()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens)) as r:
        out.status, out.content_type = r.status_code, r.headers.get("content-type", "")
        if headers_seen is not None:
            headers_seen.set()
        if out.content_type.startswith("text/event-stream"):
            sse = SSE(out)
            async for line in r.aiter_lines():
                sse.line(line)
        else:
            out.body = json.loads(await r.aread())
    return out


async def health(client: httpx.AsyncClient, url: str) -> dict:
    r = await client.get(f"{url}/health")
    assert r.status_code == 200, r.text
    return r.json()


async def wait_idle(client: httpx.AsyncClient, url: str, within_s: float) -> dict:
    """/health once active == queued == 0; fails with the last counters if that takes longer."""
    h = {}
    with trio.move_on_after(within_s):
        while True:
            h = await health(client, url)
            if h["active"] == 0 and h["queued"] == 0:
                return h
            await trio.sleep(0.1)
    pytest.fail(f"not idle {within_s}s after the clients: a slot or queue entry leaked: {h}")


def content_of(line: str) -> str:
    """The text a chat SSE line carries ("" for none)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[len("data: "):]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def delta(before: dict, after: dict, key: str) -> int:
    return after[key] - before[key]


def reference_texts(url: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """The greedy text of each prompt, each run alone on the idle server."""
    refs = {}
    with httpx.Client(timeout=HTTP_TIMEOUT) as client:
        for prompt in prompts:
            out = Outcome()
            body = chat_body(prompt, max_tokens)
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                out.status, out.content_type = r.status_code, r.headers.get("content-type", "")
                sse = SSE(out)
                for line in r.iter_lines():
                    sse.line(line)
            assert out.status == 200 and out.done and not out.errors and len(out.finish) == 1, out
            assert out.text, f"empty reference for {prompt!r}"
            refs[prompt] = out.text
    return refs


@pytest.fixture(scope="module")
def references(server: LoadServer) -> dict[str, str]:
    return reference_texts(server.url, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def long_references(server: LoadServer) -> dict[str, str]:
    return reference_texts(server.url, PROMPTS[:N_COMPLETERS], LONG_TOKENS)


# --- raw-socket clients that leave at a chosen moment ------------------------------------------------


def raw_request(url: str, prompt: str, max_tokens: int) -> bytes:
    hostport = url.split("://", 1)[1].rstrip("/")
    body = json.dumps(chat_body(prompt, max_tokens)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\n\r\n"
    )
    return head.encode() + body


def http_status(buf: bytes) -> int | None:
    """The status of a raw HTTP/1.1 response once its head is complete, else None."""
    return int(buf.split(b" ", 2)[1]) if b"\r\n\r\n" in buf else None


async def leaving_client(url: str, prompt: str, plan: tuple[str, float], seen: dict) -> None:
    """A raw-socket streaming client that closes its connection early: ("delay", s) after s seconds,
    reading whatever came meanwhile (often nothing: it may still be queued); ("frames", k) once the
    headers and k token frames have arrived. Records what it saw in ``seen``."""
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
    kind, arg = plan
    buf, eof = b"", False

    def enough() -> bool:
        status = http_status(buf)
        if status is None or kind == "delay":
            return False
        return status != 200 or b"[DONE]" in buf or buf.count(b"data: ") >= arg + 1  # + the role frame

    try:
        await stream.send_all(raw_request(url, prompt, LEAVING_MAX_TOKENS))
        with trio.move_on_after(arg if kind == "delay" else math.inf):
            while not enough():
                data = await stream.receive_some(1 << 16)
                if not data:
                    eof = True
                    break
                buf += data
    finally:
        await stream.aclose()
    status = http_status(buf)
    if status is None:
        seen["server_closed" if eof else "left_before_headers"] += 1
    elif status == 429:
        seen["429"] += 1
    elif status != 200:
        seen["other_status"].append(status)
    else:
        for frame in buf.split(b"data: ")[1:]:
            if frame.startswith(b'{"error"'):
                seen["stream_errors"].append(frame.split(b"\n", 1)[0].decode(errors="replace"))
        seen["ended_before_leaving" if b"[DONE]" in buf else "left_mid_stream"] += 1


# --- the tests ----------------------------------------------------------------------------------------


async def test_concurrent_streams_admitted_or_429(server: LoadServer, references: dict[str, str]) -> None:
    url = server.url
    limits = httpx.Limits(max_connections=N_CLIENTS + 4, max_keepalive_connections=N_CLIENTS + 4)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits) as client:
        before = await health(client, url)
        assert before["active"] == 0 and before["queued"] == 0, before
        go = trio.Event()
        outcomes: list[tuple[str, Outcome]] = [None] * N_CLIENTS

        async def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            await go.wait()
            outcomes[i] = (prompt, await stream_chat(client, url, prompt))

        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                for i in range(N_CLIENTS):
                    nursery.start_soon(one, i)
                await trio.sleep(0.2)
                go.set()
            after = await wait_idle(client, url, 5)

    admitted = [(p, o) for p, o in outcomes if o.status != 429]
    rejected = [(p, o) for p, o in outcomes if o.status == 429]
    print(f"\nload: {len(admitted)} admitted, {len(rejected)} refused with 429 of {N_CLIENTS}")
    for i, (prompt, out) in enumerate(admitted):
        check_complete(out, references[prompt], f"admitted #{i} ({prompt!r})")
    for i, (_, out) in enumerate(rejected):
        check_429(out, f"refused #{i}")
    # 4 slots + 8 places in the queue: the first 12 arrivals always get in; 32 at once overflow it
    assert len(admitted) >= 12, len(admitted)
    assert rejected, "32 clients at once on 4 slots + a queue of 8: expected some 429s"
    assert delta(before, after, "completed") == len(admitted), (before, after)
    assert delta(before, after, "rejected") == len(rejected), (before, after)
    assert delta(before, after, "cancelled") == 0 and delta(before, after, "failed") == 0, (before, after)
    assert after["active"] == 0 and after["queued"] == 0, after


def disconnect_plans(rng: random.Random) -> list[tuple[str, float]]:
    """How each leaving client leaves (see ``leaving_client``): every third after a delay, often
    before the first byte (still queued), the others after a few token frames."""
    return [("delay", rng.uniform(0.0, 2.0)) if i % 3 == 0
            else ("frames", rng.randint(1, MAX_FRAMES_BEFORE_LEAVING)) for i in range(N_DISCONNECTS)]


def nothing_seen() -> dict:
    """What the leaving clients saw, by kind (``leaving_client`` fills it)."""
    seen: dict = dict.fromkeys(("left_before_headers", "left_mid_stream", "ended_before_leaving", "429",
                                "server_closed"), 0)
    seen["stream_errors"], seen["other_status"] = [], []
    return seen


async def completers_among_leavers(client: httpx.AsyncClient, url: str, plans: list[tuple[str, float]],
                                   seen: dict) -> list[tuple[str, Outcome]]:
    """N_COMPLETERS long streams admitted first, then the leaving clients; the completers' outcomes."""
    completers: list[tuple[str, Outcome]] = []

    async def complete(prompt: str, admitted: trio.Event) -> None:
        out = await stream_chat(client, url, prompt, LONG_TOKENS, headers_seen=admitted)
        completers.append((prompt, out))

    async with trio.open_nursery() as nursery:
        for prompt in PROMPTS[:N_COMPLETERS]:  # 3 slots first, then they share the batch
            admitted = trio.Event()
            nursery.start_soon(complete, prompt, admitted)
            await admitted.wait()
        for i, plan in enumerate(plans):
            nursery.start_soon(leaving_client, url, PROMPTS[(i + 3) % len(PROMPTS)], plan, seen)
    return completers


async def streams_at_once(client: httpx.AsyncClient, url: str,
                          prompts: list[str]) -> list[tuple[str, Outcome]]:
    results: list[tuple[str, Outcome]] = []

    async def normal(prompt: str) -> None:
        results.append((prompt, await stream_chat(client, url, prompt)))

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(normal, prompt)
    return results


def incomplete(outcomes: list[tuple[str, Outcome]], references: dict[str, str], who: str) -> list[str]:
    """``check_complete``'s complaints about each outcome, collected rather than raised."""
    problems = []
    for i, (prompt, out) in enumerate(outcomes):
        try:
            check_complete(out, references[prompt], f"{who} #{i} ({prompt!r})")
        except AssertionError as e:
            problems.append(str(e))
    return problems


def disconnect_problems(seen: dict, completers: list[tuple[str, Outcome]], long_references: dict[str, str],
                        before: dict, after: dict) -> list[str]:
    problems = []
    # no admitted stream may fail; a slot handed to the next request while the engine still holds
    # it for the cancelled one shows here as "the engine refused the request: SLOT_BUSY"
    if seen["stream_errors"]:
        problems.append(f"streams that errored after a disconnect: {seen['stream_errors']}")
    problems += incomplete(completers, long_references, "completer")
    if seen["server_closed"] or seen["other_status"]:
        problems.append(f"connections closed before an answer, or unexpected statuses: {seen}")
    if delta(before, after, "cancelled") <= 0:
        problems.append(f"'cancelled' did not grow: {before} -> {after}")
    if delta(before, after, "completed") < len(completers):
        problems.append(f"'completed' grew less than the completers: {before} -> {after}")
    if delta(before, after, "rejected") < seen["429"]:
        problems.append(f"'rejected' grew less than the 429s seen: {before} -> {after}")
    if delta(before, after, "failed"):
        problems.append(f"'failed' grew: {before} -> {after}")
    return problems


async def test_disconnects_leak_no_slot(server: LoadServer, references: dict[str, str],
                                        long_references: dict[str, str]) -> None:
    url = server.url
    seed = int(os.environ.get("COLI_LOAD_SEED", random.randrange(1 << 30)))
    print(f"\ndisconnect plans: seed {seed} (COLI_LOAD_SEED to replay)")
    plans, seen = disconnect_plans(random.Random(seed)), nothing_seen()
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        before = await health(client, url)
        assert before["active"] == 0 and before["queued"] == 0, before
        with trio.fail_after(120):
            completers = await completers_among_leavers(client, url, plans, seen)
            after = await wait_idle(client, url, 10)
        print(f"disconnects: {seen}; /health before {before}, after {after}")
        problems = disconnect_problems(seen, completers, long_references, before, after)

        # every slot is usable again: 4 at once, all complete with their reference text
        with trio.fail_after(90):
            results = await streams_at_once(client, url, PROMPTS[3:7])
            final = await wait_idle(client, url, 5)
        problems += incomplete(results, references, "after the disconnects")
        if delta(after, final, "completed") != 4 or delta(after, final, "rejected") != 0:
            problems.append(f"4 requests on an idle server: {after} -> {final}")
    assert not problems, "\n".join(problems)


@asynccontextmanager
async def holding_the_slot(client: httpx.AsyncClient, url: str) -> AsyncIterator[AsyncIterator[str]]:
    """A long streaming request that has its first token (so it holds a slot); its SSE lines.
    Leaving the block closes it early, which gives its slot back."""
    async with client.stream("POST", f"{url}/v1/chat/completions",
                             json=chat_body(PROMPTS[0], HOLDING_TOKENS)) as long:
        assert long.status_code == 200
        lines = long.aiter_lines()
        async for line in lines:
            if content_of(line):
                break
        yield lines


async def still_streaming(lines: AsyncIterator[str]) -> None:
    async for line in lines:
        if line.startswith("data: "):
            assert '"error"' not in line, line
            break


async def test_queue_timeout_429() -> None:
    srv = LoadServer("--kv-slots", "1", "--max-queue", "8", "--queue-timeout", "1")
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            before = await health(client, srv.url)
            with trio.fail_after(90):
                async with holding_the_slot(client, srv.url) as lines:
                    start = trio.current_time()
                    second = await stream_chat(client, srv.url, PROMPTS[1])
                    waited = trio.current_time() - start
                    check_429(second, "second request")
                    assert second.body["error"]["code"] == "queue_timeout", second.body
                    assert 0.9 <= waited <= 6, f"429 after {waited:.2f}s, the timeout is 1s"
                    await still_streaming(lines)  # untouched by the refusal
                # leaving the long stream early: its slot comes back
                after = await wait_idle(client, srv.url, 10)
            print(f"\nqueue timeout: 429 after {waited:.2f}s; /health {after}")
            assert delta(before, after, "rejected") == 1, (before, after)
            assert delta(before, after, "completed") == 0, (before, after)
    finally:
        status = srv.stop()
    assert status == 0, f"SIGTERM: exit status {status} (None: did not stop)\n{srv.stderr()}"


async def test_client_leaving_while_queued_is_counted() -> None:
    """A client that gives up while its request waits for a slot: counted as cancelled, the queue
    empties, and the request holding the slot is untouched."""
    srv = LoadServer("--kv-slots", "1", "--max-queue", "8", "--queue-timeout", "60")
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            before = await health(client, srv.url)
            with trio.fail_after(90):
                async with holding_the_slot(client, srv.url) as lines:
                    with trio.move_on_after(1.0):  # queued behind it, then the client leaves
                        await stream_chat(client, srv.url, PROMPTS[1])
                    while (await health(client, srv.url))["queued"]:
                        await trio.sleep(0.05)
                    await still_streaming(lines)
                after = await wait_idle(client, srv.url, 10)
            # two left: the queued one, and the long stream, closed before its end
            assert delta(before, after, "cancelled") == 2, (before, after)
            assert delta(before, after, "failed") == delta(before, after, "rejected") == 0, (before, after)
    finally:
        status = srv.stop()
    assert status == 0, f"SIGTERM: exit status {status} (None: did not stop)\n{srv.stderr()}"
