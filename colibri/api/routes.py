"""The HTTP routes: the OpenAI API, health, experts, metrics and the web page, as a Blueprint.

Handlers stay thin: they read the request, find the ``ServerState`` in the app, and hand the work
to ``serving`` (every generation endpoint, one path) or ``static`` (the page).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import trio
from quart import Blueprint, Response, current_app, request

from colibri import __version__, state_files
from colibri.api import openai_errors, responses_api, serving
from colibri.api.affinity import SESSION_HEADER
from colibri.api.completion_shapes import ChatShaper, CompletionShaper
from colibri.api.metrics import CONTENT_TYPE
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import parse_chat, parse_completion, parse_json
from colibri.api.responses_shapes import ResponsesShaper
from colibri.api.server_state import EXTENSION, ServerState
from colibri.api.serving import Served
from colibri.api.shaping import SSE_HEADERS, SSE_MIMETYPE
from colibri.api.static import StaticSite

blueprint = Blueprint("colibri", __name__)

OWNER = "colibri"  # the model card's ``owned_by``
QUEUE_WAIT_HEADER = "x-colibri-queue-wait-ms"
SITE_EXTENSION = "colibri.site"  # the web page's files, in ``app.extensions``


def server_state() -> ServerState:
    return current_app.extensions[EXTENSION]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


def model_card(model_id: str, created: int, n_ctx: int | None = None) -> dict[str, Any]:
    """OpenAI's model object, with the served context (prompt and answer together, per request)
    under the two names clients read it by: ``context_length`` (OpenRouter's, read by clients that
    size their prompts from it) and ``max_model_len`` (vLLM's)."""
    card = {"id": model_id, "object": "model", "created": created, "owned_by": OWNER}
    if n_ctx is not None:
        card.update(context_length=n_ctx, max_model_len=n_ctx)
    return card


# ----------------------------------------------------------------------------- models, status


@blueprint.get("/v1/models")
async def models() -> dict[str, Any]:
    state = server_state()
    return {"object": "list", "data": [model_card(state.model_id, state.created, state.n_ctx)]}


@blueprint.get("/v1/models/<path:model>")
async def model(model: str) -> dict[str, Any] | Response:
    state = server_state()
    if model != state.model_id:
        return error_response(openai_errors.model_not_found(model))
    return model_card(state.model_id, state.created, state.n_ctx)


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
        "kv_bytes_per_token": state.kv_bytes_per_token,
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


# experts.json is held whole per request: the largest real atlas (61 MoE layers x 256 experts x 64
# topics, ~9 bytes a number) is ~10 MB; a bigger file is not one ``coli atlas`` wrote.
MAX_ATLAS_BYTES = 32 << 20
_atlas_refusals: set[str] = set()  # each reason a file was refused is logged once, not per request


@blueprint.get("/atlas")
async def atlas() -> Response:
    """The expert atlas ``coli atlas`` measured (its ``experts.json``), for the console's Atlas view;
    404 until one was written for this state directory, and for anything there but a regular file
    (a link, a FIFO) or a file over MAX_ATLAS_BYTES. Read on a worker thread, never through a link."""
    path = server_state().atlas_path
    try:
        body = None if path is None else await trio.to_thread.run_sync(
            state_files.read_regular, path, MAX_ATLAS_BYTES)
    except (state_files.Refused, OSError) as e:
        reason = str(e) if isinstance(e, state_files.Refused) else f"cannot read: {e.strerror or e}"
        if reason not in _atlas_refusals:
            _atlas_refusals.add(reason)
            print(f"colibri: warning: /atlas: {path}: {reason}, answered 404", file=sys.stderr, flush=True)
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


# Each generation endpoint's parser: the one thing, with its shaper (``serving.job``), that differs.
PARSERS: dict[str, Callable[[Any, ServerState], Served]] = {
    ChatShaper.endpoint: lambda body, s: parse_chat(body, s.render, s.n_ctx, s.n_slots),
    CompletionShaper.endpoint: lambda body, s: parse_completion(body, s.n_ctx, s.n_slots),
    ResponsesShaper.endpoint: lambda body, s: responses_api.parse(body, s.render, s.n_ctx, s.n_slots),
}


def with_sampling_defaults(body: Any, defaults: dict[str, float]) -> Any:
    """The body with the server's ``--temperature``/``--top-p`` where it sets none (absent or
    null); a value it sets, however odd, is its own, checked by the parser."""
    if not defaults or not isinstance(body, dict):
        return body
    return {**body, **{k: v for k, v in defaults.items() if body.get(k) is None}}


async def _body(state: ServerState) -> Any:
    """The request's JSON body, once the server can serve a generation at all."""
    if state.draining:
        raise openai_errors.draining()
    if not state.engine.ready:
        raise openai_errors.engine_not_ready(state.engine.reason)
    return parse_json(await request.get_data(cache=False))


async def generate() -> Response:
    """Every generation endpoint (``PARSERS``): parse, tokenize and admit, then the answer."""
    state, endpoint = server_state(), request.url_rule.rule
    try:
        served = PARSERS[endpoint](with_sampling_defaults(await _body(state), state.sampling_defaults), state)
        gen = serving.generation_of(served)
        await serving.tokenize(state, gen)
        lease = await serving.admit(state, gen, request.headers.get(SESSION_HEADER))
    except ApiError as e:
        serving.count(state, endpoint, e.status, None)
        return error_response(e)
    headers = {QUEUE_WAIT_HEADER: str(int(lease.waited * 1000))}
    if gen.stream:
        serving.release_at_exit(request.scope, lease)  # if the client leaves before the body starts
        return Response(serving.answer_sse(state, served, lease), mimetype=SSE_MIMETYPE,
                        headers={**headers, **SSE_HEADERS})
    try:
        return json_response(await serving.answer_json(state, served, lease), headers=headers)
    except ApiError as e:
        return error_response(e)


for _path in PARSERS:
    blueprint.add_url_rule(_path, view_func=generate, methods=["POST"])


# ----------------------------------------------------------------------------- the web page


@blueprint.get("/")
@blueprint.get("/<page:path>")
async def web(path: str = "") -> Response:
    site: StaticSite = current_app.extensions[SITE_EXTENSION]
    return await site.serve(path)
