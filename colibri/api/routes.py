"""The HTTP routes: the OpenAI API, health, experts, metrics and the web page, as a Blueprint.

Handlers stay thin: they read the request, find the ``ServerState`` in the app, and hand the work
to ``completion`` (generation), ``openai_*`` (shapes) or ``static`` (the page).
"""

from __future__ import annotations

import json
from typing import Any

import trio
from quart import Blueprint, Response, current_app, request

from colibri import __version__
from colibri.api import completion, openai_errors, openai_responses, responses_api
from colibri.api.metrics import CONTENT_TYPE
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import Generation, parse_chat, parse_completion, parse_json
from colibri.api.server_state import EXTENSION, ServerState
from colibri.api.static import StaticSite

blueprint = Blueprint("colibri", __name__)

ENDPOINTS = {  # the metrics' label
    "chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses",
}
QUEUE_WAIT_HEADER = "x-colibri-queue-wait-ms"
SITE_EXTENSION = "colibri.site"  # the web page's files, in ``app.extensions``


def server_state() -> ServerState:
    return current_app.extensions[EXTENSION]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


# ----------------------------------------------------------------------------- models, status


@blueprint.get("/v1/models")
async def models() -> dict[str, Any]:
    state = server_state()
    return openai_responses.model_list(state.model_id, state.created)


@blueprint.get("/v1/models/<path:model>")
async def model(model: str) -> dict[str, Any] | Response:
    state = server_state()
    if model != state.model_id:
        return error_response(openai_errors.model_not_found(model))
    return openai_responses.model_card(state.model_id, state.created)


@blueprint.get("/health")
async def health() -> Response:
    """200 when generations are served, 503 (with the reason) while the engine is down or draining:
    what a load balancer's health check needs. "degraded" (still 200: answers are served) while
    the engine's most recent save of a KV slot failed: restarts would lose turns."""
    state = server_state()
    ok = state.engine.ready and not state.draining
    persist = state.engine.persist
    status = "ok" if ok else ("draining" if state.draining else "unavailable")
    reason = "draining" if state.draining else state.engine.reason
    if ok and persist.last_failed:
        status, reason = "degraded", "the last turn's KV slot was not persisted; see the engine's log"
    body = {
        "status": status,
        "reason": reason,
        "model": state.model_id,
        "replica": state.replica_id,
        "version": __version__,
        "active": state.admission.active,
        "queued": state.admission.queued,
        "slots": state.n_slots,
        "engine_restarts": state.engine.restarts,
        "persist_failures": persist.failures,
        **state.counters,
        "block_types": list(state.block_types),
        "hardware": _hardware(state),
    }
    return json_response(body, 200 if ok else 503)


def _hardware(state: ServerState) -> dict[str, Any] | None:
    """The engine's HWINFO (cores, RAM, CPU), for the console's runtime panel; None before it."""
    hw = getattr(getattr(state.engine, "telemetry", None), "hwinfo", None)
    return None if hw is None else dict(hw.__dict__)


@blueprint.get("/experts")
async def experts() -> dict[str, Any]:
    """The expert map for the web console (api.md): the engine's latest telemetry, hex-encoded."""
    t = server_state().engine.telemetry
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


@blueprint.get("/atlas")
async def atlas() -> Response:
    """The expert atlas ``coli atlas`` measured (its ``experts.json``), for the console's Atlas view;
    404 until one was written for this state directory."""
    path = server_state().atlas_path
    try:
        body = path.read_bytes() if path is not None else None
    except OSError:
        body = None
    if body is None:
        return error_response(openai_errors.not_found())
    return Response(body, mimetype="application/json")


@blueprint.get("/metrics")
async def prometheus() -> Response:
    state = server_state()
    state.metrics.queue_depth.set(state.admission.queued)
    state.metrics.active.set(state.admission.active)
    return Response(
        state.registry.render(),
        mimetype=CONTENT_TYPE.split(";")[0],
        headers={"content-type": CONTENT_TYPE},
    )


# ----------------------------------------------------------------------------- generation


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    return await _generate("chat")


@blueprint.post("/v1/completions")
async def completions() -> Response:
    return await _generate("completion")


async def _body(state: ServerState) -> Any:
    """The request's JSON body, once the server can serve a generation at all."""
    if state.draining:
        raise openai_errors.draining()
    if not state.engine.ready:
        raise openai_errors.engine_not_ready(state.engine.reason)
    return parse_json(await request.get_data(cache=False))


async def _tokenize(state: ServerState, gen: Generation, where: str) -> None:
    """The prompt's ids, checked against the context before admission (and any header)."""
    if state.encode is not None:  # off the event loop: a prompt may be megabytes of text
        gen.prompt_ids = tuple(await trio.to_thread.run_sync(state.encode, gen))
        if len(gen.prompt_ids) > state.n_ctx:
            raise openai_errors.context_length_exceeded(len(gen.prompt_ids), state.n_ctx, where)


async def _parse(state: ServerState, kind: str) -> Generation:
    body = await _body(state)
    if kind == "chat":
        gen = parse_chat(body, state.render, state.n_ctx, state.n_slots)
    else:
        gen = parse_completion(body, state.n_ctx, state.n_slots)
    await _tokenize(state, gen, "messages" if kind == "chat" else "prompt")
    return gen


async def _generate(kind: str) -> Response:
    state, endpoint = server_state(), ENDPOINTS[kind]
    try:
        gen = await _parse(state, kind)
        lease = await completion.admit(state, gen)
    except ApiError as e:
        state.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
        return error_response(e)
    headers = {QUEUE_WAIT_HEADER: str(int(lease.waited * 1000))}
    if gen.stream:
        return Response(
            completion.answer_sse(state, gen, lease, endpoint),
            mimetype=openai_responses.SSE_MIMETYPE,
            headers={**headers, **openai_responses.SSE_HEADERS},
        )
    try:
        result = await completion.answer_json(state, gen, lease)
    except ApiError as e:
        state.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
        return error_response(e)
    state.metrics.requests.inc(endpoint=endpoint, status="200")
    return json_response(result, headers=headers)


@blueprint.post("/v1/responses")
async def responses() -> Response:
    """OpenAI's Responses API, translated onto the chat path (``responses_api``)."""
    state, endpoint = server_state(), ENDPOINTS["responses"]
    try:
        req = responses_api.parse(await _body(state), state.render, state.n_ctx, state.n_slots)
        await _tokenize(state, req.gen, "input")
        lease = await completion.admit(state, req.gen)
    except ApiError as e:
        state.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
        return error_response(e)
    headers = {QUEUE_WAIT_HEADER: str(int(lease.waited * 1000))}
    if req.gen.stream:
        return Response(
            responses_api.answer_sse(state, req, lease, endpoint),
            mimetype=openai_responses.SSE_MIMETYPE,
            headers={**headers, **openai_responses.SSE_HEADERS},
        )
    try:
        result = await responses_api.answer_json(state, req, lease)
    except ApiError as e:
        state.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
        return error_response(e)
    state.metrics.requests.inc(endpoint=endpoint, status="200")
    return json_response(result, headers=headers)


# ----------------------------------------------------------------------------- the web page


@blueprint.get("/")
@blueprint.get("/<page:path>")
async def web(path: str = "") -> Response:
    site: StaticSite = current_app.extensions[SITE_EXTENSION]
    return await site.serve(path)
