"""``coli serve``: hypercorn serving the app, the engine as a child, systemd's notify protocol.

``run_server`` is the entry point (``colibri.cli``).

Start: the engine is started and must say READY, then the socket is bound, then ``READY=1``.
SIGTERM: ``STOPPING=1``; new generations get 503 while those in flight finish; then the engine gets
EOF (it persists its slots) and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)

from colibri import settings
from colibri.api import sdnotify, serving
from colibri.api.admission import MIN_PREFIX_SHARE, Admission
from colibri.api.affinity import default_replica_id
from colibri.api.app import BODY_TIMEOUT_S, MAX_BODY, create_app
from colibri.api.engine_client import EngineClient, EngineStartFailed
from colibri.api.openai_errors import ambiguous_framing, overloaded
from colibri.api.openai_requests import Generation
from colibri.api.reasoning import opens_reasoning
from colibri.api.security import CorsPolicy, HostGuard, ambiguous_framing_headers, require_key_for_bind
from colibri.api.server_state import ServerState
from colibri.api.slot_owners import SlotOwners
from colibri.model.hparams import HParams
from colibri.model.text import ModelText
from colibri.state_files import check_state_dir

# The defaults of --max-requests, --keep-alive and --drain-timeout (reasons: colibri/settings.py).
MAX_CONCURRENT_REQUESTS = settings.MAX_REQUESTS.default
KEEP_ALIVE_S = settings.KEEP_ALIVE.default
WRITE_TIMEOUT_S = settings.WRITE_TIMEOUT.default
DRAIN_TIMEOUT_S = settings.DRAIN_TIMEOUT.default
DRAIN_POLL_S = 0.05  # how often the drain looks at admission: a stop a client barely notices
# Seconds for the engine to persist its slots and exit after EOF: a few slot files to write.
ENGINE_EXIT_TIMEOUT_S = 60
# The 503 beyond MAX_CONCURRENT_REQUESTS, made once: it is sent before the app sees the request.
_OVERLOADED = overloaded().json_bytes()
_AMBIGUOUS = ambiguous_framing().json_bytes()  # the 400 to a request framed two ways, made once
# How much of such a request's body is read (and dropped) before the 400, and for how long: what a
# client sent at once arrives within this; one still sending is answered anyway, then closed.
DISCARD_BODY_BYTES = 1 << 20
DISCARD_BODY_S = 1.0


@dataclass(frozen=True)
class ServeConfig:
    model_path: Path
    host: str
    port: int
    model_id: str
    api_key: str | None
    kv_slots: int
    ctx: int
    max_queue: int
    queue_timeout: float
    cors_origins: tuple[str, ...]
    state_dir: Path | None
    insecure: bool
    web_dist: Path | None
    open_browser: bool = False
    ram_budget_gb: float | None = None  # --ram-budget for the engine; None: its own default
    kv_type: str = settings.KV_TYPE.default  # --kv-type for the engine
    # --speculative, --draft-max and --draft-min for the engine
    speculation: tuple[str, int, int] = (settings.SPECULATIVE.default, settings.DRAFT_MAX.default,
                                         settings.DRAFT_MIN.default)
    max_body: int = MAX_BODY  # bytes
    body_timeout_s: float = BODY_TIMEOUT_S
    max_requests: int = MAX_CONCURRENT_REQUESTS
    keep_alive_s: float = KEEP_ALIVE_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    prefix_share: float = MIN_PREFIX_SHARE
    replica_id: str | None = None  # None: the bound host:port
    # --temperature, --top-p: the values of a request that leaves them out (``sampling_defaults``)
    sampling_defaults: tuple[tuple[str, float], ...] = ()


class ConcurrencyLimit:
    """ASGI middleware, the first to see a request's raw headers: a request framed by both
    Content-Length and Transfer-Encoding gets 400 and its connection closed (request smuggling);
    at most ``limit`` HTTP requests in progress, the rest get 503 at once. The parent of every
    request's task: what a request leaves held when it ends is released here
    (``serving.release_leftovers``)."""

    def __init__(self, app: ASGIFramework, limit: int, state: ServerState | None = None) -> None:
        self.app, self.limit, self.active, self.state = app, limit, 0, state

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if ambiguous_framing_headers(scope["headers"]):
            # Connection: close makes hypercorn close after the answer: what follows is never read.
            await _discard_body(receive)
            return await _answer(_shield_last_send(send), 400, _AMBIGUOUS, (b"connection", b"close"))
        if self.active >= self.limit:
            return await _answer(send, 503, _OVERLOADED, (b"retry-after", b"1"))
        self.active += 1
        scope = {**scope, serving.LEFTOVER_LEASES: []}
        body = _BodyEnd(receive, chunked=_chunked(scope["headers"]))
        try:
            await self.app(scope, body.receive, _shield_last_send(body.after_body(_gone_quietly(send))))
        finally:
            self.active -= 1
            with trio.CancelScope(shield=True):
                await serving.release_leftovers(scope, self.state)


async def _discard_body(receive: ASGIReceiveCallable) -> None:
    """Let hypercorn read a refused request to its end (as chunked: h11 lets Transfer-Encoding
    win), within bounds. Answered sooner, the answer raced hypercorn's close against a pipelined
    request: half of those 400s were lost (a reset, or a send clashing with the close)."""
    received = 0
    with trio.move_on_after(DISCARD_BODY_S):
        while received <= DISCARD_BODY_BYTES:
            message = await receive()
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


async def _answer(send: ASGISendCallable, status: int, body: bytes, header: tuple[bytes, bytes]) -> None:
    """A JSON error sent before the app sees the request."""
    headers = [(b"content-type", b"application/json"), header]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"transfer-encoding" for name, _ in headers)


class _BodyEnd:
    """Whether a chunked request's body has been read to its end (or the client has gone), for an
    answer that comes before it: a refusal from the headers alone (403, 415, ...). Sent at once,
    such an answer lets hypercorn close the connection while its reader is still parsing the
    chunks; a chunk header it cannot parse then has it send its own 400 on the same socket as the
    close, and the clash (trio's BusyResourceError) escaped hypercorn and ended the whole server. So
    the answer waits, for a bounded time, until quart-trio (which reads every body) has seen the
    body end. A body of a Content-Length has no chunk header to fail on: no wait."""

    def __init__(self, receive: ASGIReceiveCallable, chunked: bool) -> None:
        self._receive, self.ended = receive, trio.Event()
        if not chunked:
            self.ended.set()

    async def receive(self) -> ASGIReceiveEvent:
        message = await self._receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self.ended.set()
        return message

    def after_body(self, send: ASGISendCallable) -> ASGISendCallable:
        async def wrapped(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.start" and not self.ended.is_set():
                with trio.move_on_after(DISCARD_BODY_S):
                    await self.ended.wait()
            await send(message)

        return wrapped


def _gone_quietly(send: ASGISendCallable) -> ASGISendCallable:
    """A send that meets hypercorn closing the connection (a client that left mid-body, answered
    413 or 408): hypercorn's close does not take its send lock, so the answer's send fails with
    BusyResourceError (or finds the socket closed) and hypercorn logged it as an error of the app.
    The client is gone; so is the answer, quietly."""

    async def wrapped(message: ASGISendEvent) -> None:
        try:
            await send(message)
        except (trio.BusyResourceError, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    return wrapped


def _shield_last_send(send: ASGISendCallable) -> ASGISendCallable:
    """hypercorn closes or recycles the connection inside the ``send`` of a response's last body
    message, and quart-trio cancels the request's tasks as soon as hypercorn reports the stream
    closed, cutting that short: the socket then stayed open for good (no close after
    ``Connection: close`` or an unread body, no keep-alive timeout). Shielded, it completes."""

    async def wrapped(message: ASGISendEvent) -> None:
        if message.get("type") == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                return await send(message)
        return await send(message)

    return wrapped


def run_server(cfg: ServeConfig) -> int:
    """``coli serve``: the exit status once SIGTERM or SIGINT has drained the server."""
    require_key_for_bind(cfg.host, cfg.api_key, cfg.insecure)
    if cfg.state_dir is not None:
        check_state_dir(cfg.state_dir)  # /atlas reads from it: no other user may plant files there
    text = ModelText.open(cfg.model_path)  # the template and the vocabulary: no weights in this process
    _ = text.chat_template  # built now: a model without a usable template fails at start, not later
    n_ctx = min(cfg.ctx, text.context_length or cfg.ctx)
    try:
        return trio.run(_serve, cfg, text, n_ctx)
    except BaseExceptionGroup as group:  # the nursery's: a start failure is the one to tell
        failed, _ = group.split(EngineStartFailed)
        if failed is None:
            raise
        raise _first(failed) from None


def _first(group: BaseExceptionGroup) -> BaseException:
    inner = group.exceptions[0]
    return _first(inner) if isinstance(inner, BaseExceptionGroup) else inner


def prompt_ids(text: ModelText, gen: Generation, limit: int | None = None) -> list[int]:
    """A request's prompt by the trust rule: for chat, the template's markup with its control
    tokens and the messages as plain text (and the tools, for a template that takes them); for a
    completion, the client's text, plain. ``limit``: a prompt that cannot fit in that many tokens,
    by its length, raises ``TooManyTokens`` untokenized."""
    if gen.kind == "chat":
        tools = gen.tools.template_tools if gen.tools is not None else None
        segments = text.render_segments(gen.messages, gen.enable_thinking, tools, gen.template_kwargs)
        if gen.reasoning:  # only the template's own markup can leave the reply inside a block
            last = segments[-1] if segments else None
            gen.reasoning_open = last is not None and last.markup and opens_reasoning(last.text)
        return text.encode_segments(segments, limit)
    return text.encode_text(gen.prompt, limit)


def _engine(cfg: ServeConfig, n_ctx: int) -> EngineClient:
    """The ``coli engine`` child, told what this server was told."""
    engine_args = ["--model", str(cfg.model_path), "--kv-slots", str(cfg.kv_slots), "--ctx", str(n_ctx),
                   "--kv-type", cfg.kv_type, "--speculative", cfg.speculation[0],
                   "--draft-max", str(cfg.speculation[1]), "--draft-min", str(cfg.speculation[2])]
    engine_args += ["--state-dir", str(cfg.state_dir)] if cfg.state_dir else ["--no-persist"]
    if cfg.ram_budget_gb is not None:  # else the engine resolves COLI_RAM_GB or its default itself
        engine_args += ["--ram-budget", str(cfg.ram_budget_gb)]
    # TOPK lines for logprobs, PERF for the stats, and batched decoding across slots
    return EngineClient(engine_args, {**os.environ, "SERVE_TOPK": "1", "SERVE_PERF": "1", "SERVE_BATCH": "1"})


class _WriteTimeoutConfig(Config):
    """hypercorn's configuration, its listening sockets carrying the write timeout.

    hypercorn sends with no timeout (shielded: nothing above it can cut a send short), so a client
    that stops reading would hold its request, and its KV slot, for ever. Accepted sockets inherit
    TCP_USER_TIMEOUT from the listener; with it the kernel resets a connection whose peer has taken
    nothing of what was sent (its window closed, or gone) for that long, the send fails, hypercorn
    reports the connection closed, quart-trio cancels the request, and serving's clean-up frees the
    slot. A client reading slowly keeps its connection: any progress restarts the clock."""

    write_timeout_s: float = WRITE_TIMEOUT_S

    def create_sockets(self):  # noqa: ANN201 (hypercorn's Sockets)
        sockets = super().create_sockets()
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            set_write_timeout(sock, self.write_timeout_s)
        return sockets


def set_write_timeout(sock: socket.socket, seconds: float) -> bool:
    """TCP_USER_TIMEOUT on a TCP socket; False where the system has none (then no write timeout)."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))
    return True


def _hypercorn_config(cfg: ServeConfig) -> Config:
    hconfig = _WriteTimeoutConfig()
    hconfig.write_timeout_s = cfg.write_timeout_s
    hconfig.bind = [f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"]
    hconfig.accesslog = None
    hconfig.keep_alive_timeout = cfg.keep_alive_s
    hconfig.graceful_timeout = cfg.drain_timeout_s
    return hconfig


def kv_bytes_per_token(hp: HParams, kv_type: str) -> int:
    """A slot's cache per token as the engine allocates it (``KVCache``): halves or float32."""
    return hp.kv_layers * hp.kv_values_per_token * (2 if kv_type == "f16" else 4)


async def _serve(cfg: ServeConfig, text: ModelText, n_ctx: int) -> int:
    engine = _engine(cfg, n_ctx)
    owners = SlotOwners(cfg.kv_slots, cfg.state_dir)
    state = ServerState(
        model_id=cfg.model_id,
        n_slots=cfg.kv_slots,
        n_ctx=n_ctx,
        api_key=cfg.api_key,
        engine=engine,
        admission=Admission(cfg.kv_slots, cfg.max_queue, cfg.queue_timeout, cfg.prefix_share, owners),
        owners=owners,
        render=text.render,
        count_tokens=text.count_tokens,
        encode=partial(prompt_ids, text),
        host_guard=HostGuard(cfg.host, cfg.port),
        cors=CorsPolicy(list(cfg.cors_origins)),
        web_dist=cfg.web_dist,
        atlas_path=cfg.state_dir / settings.ATLAS_FILE if cfg.state_dir else None,
        block_types=tuple(sorted({t.gtype.name for t in text.gguf.tensors.values()})),
        kv_bytes_per_token=kv_bytes_per_token(HParams.from_gguf(text.gguf), cfg.kv_type),
        sampling_defaults=dict(cfg.sampling_defaults),
    )
    app = ConcurrencyLimit(create_app(state, cfg.max_body, cfg.body_timeout_s), cfg.max_requests, state)
    hconfig = _hypercorn_config(cfg)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        sdnotify.status("starting the engine")
        await nursery.start(engine.run)
        binds = await nursery.start(partial(hypercorn_serve, app, hconfig, shutdown_trigger=stop.wait))
        state.replica_id = cfg.replica_id or default_replica_id((binds or hconfig.bind)[0])
        for bind in binds or hconfig.bind:
            print(f"colibri: serving {cfg.model_id} on {bind}", file=sys.stderr, flush=True)
        sdnotify.ready()
        if cfg.open_browser:
            nursery.start_soon(_open_browser, (binds or hconfig.bind)[0])
        await _until_sigterm()
        sdnotify.stopping()
        await _drain(state, cfg.drain_timeout_s)
        stop.set()
        with trio.move_on_after(ENGINE_EXIT_TIMEOUT_S):
            await engine.shutdown()
        nursery.cancel_scope.cancel()
    return 0


async def _drain(state: ServerState, timeout_s: float) -> None:
    """New generations get 503 from now; those admitted or queued may finish, for a bounded time."""
    state.draining = True
    with trio.move_on_after(timeout_s):
        while state.admission.active or state.admission.queued:
            await trio.sleep(DRAIN_POLL_S)


async def _until_sigterm() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


async def _open_browser(url: str) -> None:
    import webbrowser

    url = url if url.startswith("http") else f"http://{url}"
    await trio.to_thread.run_sync(webbrowser.open, url.replace("0.0.0.0", "127.0.0.1"))
