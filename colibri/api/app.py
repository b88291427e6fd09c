"""The quart-trio application: OpenAI routes, health, experts, metrics, the web page.

Each generation holds a KV slot (``Admission``) while it streams events from the engine
(``EngineClient``); leaving early (a client gone, a stop string) cancels it in the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import PathConverter

from colibri import __version__
from colibri.api import openai
from colibri.api.admission import Admission, QueueFull, QueueTimeout
from colibri.api.engine_client import EngineClient, EngineDied
from colibri.api.metrics import CONTENT_TYPE, server_metrics
from colibri.api.security import CorsPolicy, HostGuard, check_api_key
from colibri.api.static import StaticSite
from colibri.api.stop import StopMatcher
from colibri.io.events import Data, Done, Error, ErrorCode, Perf, TopK

# Request bodies: a long conversation is a few hundred KB of JSON; 4 MiB bounds what a client can
# make us buffer (the engine's own payload limit is 16 MiB).
MAX_BODY = 4 << 20
# Seconds a client may take to send its body: a slow-loris guard.
BODY_TIMEOUT_S = 30
# No bound on sending a response: a stream lasts as long as its generation (Quart's default, 60 s,
# would cut a long stream off mid-body).
RESPONSE_TIMEOUT_S = None


class PagePath(PathConverter):
    """A path of the web page: anything outside the API's ``v1/`` (an unknown API path is a 404, a
    GET on a POST route a 405, never the page)."""

    regex = r"(?!v1(?:/|$))[^/].*?"


@dataclass
class ServerState:
    model_id: str
    n_slots: int
    n_ctx: int
    api_key: str | None
    engine: EngineClient
    admission: Admission
    render: object  # (messages, enable_thinking) -> prompt
    count_tokens: object  # prompt -> tokens
    host_guard: HostGuard
    cors: CorsPolicy
    web_dist: Path | None
    draining: bool = False
    counters: dict[str, int] = field(
        default_factory=lambda: dict(completed=0, rejected=0, cancelled=0, failed=0)
    )
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(state: ServerState) -> QuartTrio:
    app = QuartTrio("colibri")
    app.url_map.converters["page"] = PagePath
    app.config.update(
        MAX_CONTENT_LENGTH=MAX_BODY, BODY_TIMEOUT=BODY_TIMEOUT_S, RESPONSE_TIMEOUT=RESPONSE_TIMEOUT_S
    )
    registry, metrics = server_metrics()
    site = StaticSite(state.web_dist)

    def error(err: openai.ApiError) -> Response:
        return Response(json.dumps(err.body()), status=err.status, mimetype="application/json")

    @app.before_request
    async def guard():
        if not state.host_guard.allowed(request.headers.get("host")):
            return error(
                openai.ApiError(
                    421, "Host header not allowed", type_="invalid_request_error", code="host_not_allowed"
                )
            )
        if request.method == "OPTIONS":
            headers = state.cors.headers_for(
                request.headers.get("origin"), True, request.headers.get("access-control-request-headers")
            )
            return Response("", status=204 if headers else 403, headers=headers)
        if request.path.startswith("/v1/") and not check_api_key(
            state.api_key, request.headers.get("authorization"), request.headers.get("x-api-key")
        ):
            return error(
                openai.ApiError(
                    401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key"
                )
            )
        return None

    @app.after_request
    async def cors(response: Response) -> Response:
        response.headers.update(state.cors.headers_for(request.headers.get("origin"), False, None))
        return response

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        kind = "not_found_error" if e.code == 404 else "invalid_request_error"
        message = {413: f"request body over {MAX_BODY} bytes", 408: "request body too slow"}.get(
            e.code, e.description or e.name
        )
        response = error(openai.ApiError(e.code or 400, message, type_=kind))
        if e.code in (408, 413):  # the body is left unread: say the connection ends, so no client reuses it
            response.headers["connection"] = "close"
        return response

    @app.errorhandler(Exception)
    async def crash(e: Exception) -> Response:
        app.logger.exception("unhandled error")
        return error(openai.ApiError(500, "internal error", type_="server_error"))

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "colibri"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/<path:model>")
    async def model(model: str):
        if model != state.model_id:
            return error(openai.ApiError(404, f"model {model!r} not found", "model", code="model_not_found"))
        return model_card()

    @app.get("/health")
    async def health():
        ok = state.engine.ready and not state.draining
        body = {
            "status": "ok" if ok else ("draining" if state.draining else "unavailable"),
            "reason": "draining" if state.draining else state.engine.reason,
            "model": state.model_id,
            "version": __version__,
            "active": state.admission.active,
            "queued": state.admission.queued,
            "slots": state.n_slots,
            "engine_restarts": state.engine.restarts,
            **state.counters,
        }
        return Response(json.dumps(body), status=200 if ok else 503, mimetype="application/json")

    @app.get("/experts")
    async def experts():
        t = state.engine.telemetry
        emap, hits = t.emap, t.hits
        return {
            "rows": emap.rows if emap else 0,
            "cols": emap.cols if emap else 0,
            "map": emap.data.hex() if emap else "",
            "hits": hits.data.hex() if hits else "",
            "seq": t.seq,
            "gpus": [],
            "entropy": [],
            "repin": [],
            "tiers": t.tiers.__dict__ if t.tiers else None,
            "hit_pct": t.hit_pct,
        }

    @app.get("/metrics")
    async def prometheus():
        metrics.queue_depth.set(state.admission.queued)
        metrics.active.set(state.admission.active)
        return Response(
            registry.render(), mimetype=CONTENT_TYPE.split(";")[0], headers={"content-type": CONTENT_TYPE}
        )

    async def body_json() -> object:
        raw = await request.get_data(cache=False)
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise openai.bad("", "the request body is not UTF-8") from None
        except json.JSONDecodeError as e:
            raise openai.bad("", f"the request body is not valid JSON: {e.msg} at {e.pos}") from None

    async def generate(kind: str):
        endpoint = f"/v1/{'chat/' if kind == 'chat' else ''}completions"
        try:
            if state.draining:
                raise openai.ApiError(503, "the server is shutting down", type_="server_error")
            if not state.engine.ready:
                raise openai.ApiError(
                    503, f"the engine is not ready: {state.engine.reason}", type_="server_error"
                )
            body = await body_json()
            if kind == "chat":
                gen = openai.parse_chat(body, state.render, state.n_ctx, state.n_slots)
            else:
                gen = openai.parse_completion(body, state.n_ctx, state.n_slots)
        except openai.ApiError as e:
            metrics.requests.inc(endpoint=endpoint, status=str(e.status))
            return error(e)
        holder = state.admission.slot(gen.cache_slot)
        try:
            slot, waited = await holder.__aenter__()
        except trio.Cancelled:
            state.counters["cancelled"] += 1  # the client left while queued
            raise
        except (QueueFull, QueueTimeout) as e:
            state.counters["rejected"] += 1
            metrics.requests.inc(endpoint=endpoint, status="429")
            why = "the queue is full" if isinstance(e, QueueFull) else "timed out waiting for a slot"
            return error(
                openai.ApiError(
                    429,
                    f"server busy: {why}",
                    type_="rate_limit_error",
                    code="queue_full" if isinstance(e, QueueFull) else "queue_timeout",
                )
            )
        metrics.queue_wait.observe(waited)
        headers = {"x-colibri-queue-wait-ms": str(int(waited * 1000))}
        run = _Run(state, gen, slot, metrics)
        if gen.stream:

            async def stream() -> AsyncIterator[bytes]:
                frames = run.sse()
                try:
                    async for frame in frames:
                        yield frame
                finally:
                    with trio.CancelScope(shield=True):
                        await frames.aclose()  # ends the request in the engine before the slot is freed
                        await holder.__aexit__(None, None, None)
                    metrics.requests.inc(endpoint=endpoint, status="200")

            return Response(
                stream(),
                mimetype="text/event-stream",
                headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        try:
            result = await run.complete()
        except openai.ApiError as e:
            metrics.requests.inc(endpoint=endpoint, status=str(e.status))
            return error(e)
        finally:
            with trio.CancelScope(shield=True):
                await holder.__aexit__(None, None, None)
        metrics.requests.inc(endpoint=endpoint, status="200")
        return Response(json.dumps(result), mimetype="application/json", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions():
        return await generate("completion")

    @app.get("/")
    @app.get("/<page:path>")
    async def web(path: str = ""):
        return await site.serve(path)

    return app


class _Run:
    """One generation: engine events -> text with stops applied, logprobs, usage, stats."""

    def __init__(self, state: ServerState, gen: openai.Generation, slot: int, metrics) -> None:
        self.state, self.gen, self.slot, self.metrics = state, gen, slot, metrics
        self.rid = openai.new_id(gen.kind)
        self.created = int(time.time())
        self.stops = StopMatcher(gen.stops)
        self.tokens: list[openai.TokenLogprob] = []
        self.done: Done | None = None
        self.perf: Perf | None = None
        self.finish = "length"

    async def events(self) -> AsyncIterator[tuple[str, list[openai.TokenLogprob]]]:
        """(text to emit, tokens completed) pairs; sets finish, done, perf at the end."""
        g, start, last = self.gen, time.perf_counter(), None
        pending: list[openai.TokenLogprob] = []
        held: tuple[str, bool] | None = None  # a DATA's text and stop hit, until its TOPK (which follows)
        stream = self.state.engine.generate(g.prompt, self.slot, g.max_tokens, g.temperature, g.top_p, g.seed)
        try:
            async for event in stream:
                if isinstance(event, TopK):
                    pending.append(self._token(event.candidates))
                if held is not None:  # the text goes out with the logprobs of the tokens that made it
                    (out, hit), held = held, None
                    yield out, pending
                    pending = []
                    if hit:
                        self.finish = "stop"
                        return  # closing the stream (below) cancels the request in the engine
                match event:
                    case TopK():
                        now = time.perf_counter()
                        if last is None:
                            self.metrics.time_to_first_token.observe(now - start)
                        else:
                            self.metrics.token_latency.observe(now - last)
                        last = now
                    case Data(text=data):
                        held = self.stops.feed(data.decode("utf-8", errors="replace"))
                    case Perf():
                        self.perf = event
                    case Done():
                        self.done = event
                        self.finish = "length" if event.length_limited else "stop"
                    case Error(code=code, args=args):
                        if code == ErrorCode.CONTEXT_EXCEEDED:
                            raise openai.ApiError(
                                400,
                                f"the prompt has {args[0]} tokens, the context {args[1]}",
                                "messages" if g.kind == "chat" else "prompt",
                                code="context_length_exceeded",
                            )
                        self.state.counters["failed"] += 1
                        raise openai.ApiError(
                            500, f"the engine refused the request: {code}", type_="server_error"
                        )
        except EngineDied as e:
            self.state.counters["failed"] += 1
            raise openai.ApiError(503, f"the engine stopped: {e}", type_="server_error") from None
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()  # left early: CANCEL, and wait until the engine frees the slot
        out = held[0] if held is not None else ""
        tail = self.stops.flush()
        if self.stops.stopped:
            self.finish = "stop"
        if out or tail or pending:
            yield out + tail, pending

    def _token(self, cands) -> openai.TokenLogprob:
        (lp, text), top = cands[0], sorted(cands, key=lambda c: -c[0])
        tok = openai.TokenLogprob(text, lp, [(t, p) for p, t in top])
        self.tokens.append(tok)
        return tok

    def usage(self) -> dict[str, int]:
        prompt = self.done.prompt_tokens if self.done else self.state.count_tokens(self.gen.prompt)
        completion = len(self.tokens) if self.tokens or not self.done else self.done.emitted
        self.metrics.tokens.inc(prompt, kind="prompt")
        self.metrics.tokens.inc(completion, kind="completion")
        return openai.usage(prompt, completion)

    def stats(self) -> dict:
        d, p = self.done, self.perf
        out: dict = {"slot": self.slot}
        if d:
            out["stats"] = {
                "emitted": d.emitted,
                "tok_s": d.tok_s,
                "hit_pct": d.hit_pct,
                "rss_gb": d.rss_gb,
                "prompt_tokens": d.prompt_tokens,
                "length_limited": d.length_limited,
            }
        if p:
            out["perf"] = {k: v for k, v in p.__dict__.items() if k != "id"}
        return out

    def _logprobs(self, tokens: list[openai.TokenLogprob], offset: int = 0) -> dict | None:
        if not self.gen.logprobs:
            return None
        if self.gen.kind == "chat":
            return openai.chat_logprobs(tokens, self.gen.top_logprobs)
        return openai.completion_logprobs(tokens, self.gen.top_logprobs, offset)

    async def complete(self) -> dict:
        parts, tokens = [], []
        async for text, toks in self.events():
            parts.append(text)
            tokens.extend(toks)
        self.state.counters["completed"] += 1
        extra = {"colibri": self.stats()}
        return openai.final(
            self.gen,
            self.rid,
            self.state.model_id,
            "".join(parts),
            self.finish,
            self.usage(),
            self._logprobs(tokens),
            extra,
        )

    async def sse(self) -> AsyncIterator[bytes]:
        g, model = self.gen, self.state.model_id

        def frame(obj) -> bytes:
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

        events = self.events()
        try:
            if g.kind == "chat":
                yield frame(openai.chunk(g, self.rid, model, self.created, role=True, text=""))
            offset = 0
            async for text, toks in events:
                if text or toks:
                    yield frame(
                        openai.chunk(
                            g, self.rid, model, self.created, text=text, logprobs=self._logprobs(toks, offset)
                        )
                    )
                    offset += len(text)
            yield frame(
                openai.chunk(
                    g,
                    self.rid,
                    model,
                    self.created,
                    finish=self.finish,
                    text=None if g.kind == "chat" else "",
                )
            )
            def closing(**field) -> bytes:
                """A chunk with no choices that carries one more field: usage, then our stats."""
                return frame({
                    "id": self.rid,
                    "object": "chat.completion.chunk" if g.kind == "chat" else "text_completion",
                    "created": self.created, "model": model, "choices": [], **field,
                })

            use = self.usage()
            if g.include_usage:
                yield closing(usage=use)
            yield closing(colibri=self.stats())
            yield b"data: [DONE]\n\n"
            self.state.counters["completed"] += 1
        except openai.ApiError as e:  # after the headers: the error travels as a final SSE event
            yield frame(e.body())
            yield b"data: [DONE]\n\n"
        except (trio.Cancelled, GeneratorExit):
            self.state.counters["cancelled"] += 1  # the client went away
            raise
        finally:
            with trio.CancelScope(shield=True):
                await events.aclose()
