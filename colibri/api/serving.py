"""The one serving path of chat completions, completions and responses, with no web framework in it.

A request, once parsed (``openai_requests``, ``responses_api``): ``tokenize`` (the prompt's ids,
checked against the context), ``admit`` (a KV slot, or a 429), then ``answer_json`` or
``answer_sse``, both ``_served``: the generation's pieces (``GenerationRun``), fed to the
endpoint's shaper (``job``), which alone knows the endpoint's shapes. The engine client's reader
task feeds the request's events into its own memory channel (``EngineClient.generate``); the
request's task reads them here. A separate task per request would need a nursery that outlives the
route, since Quart sends a stream's body after the route has returned, and an async generator may
not hold a nursery across a ``yield``.

``_served``'s ``finally`` is the one clean-up point, whatever ended the request (the answer's end, a
failure, the client gone): the engine is told to CANCEL what still runs and has let go of the slot
before the slot is released (a slot handed on earlier would still be the engine's: SLOT_BUSY), then
the request is counted, once, by how it ended (``count``, which every count goes through). A client
gone between the route's return and the stream's first frame leaves a body Quart never starts, so
its ``finally`` never runs: ``release_at_exit`` puts the lease in the request's ASGI scope too, and
the server's outermost middleware releases what is left there when the request's task ends
(``release_leftovers``; a lease's release is idempotent).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from colibri.api import openai_errors
from colibri.api.admission import QueueFull, QueueTimeout, SlotLease
from colibri.api.completion_shapes import ChatShaper, CompletionShaper
from colibri.api.generation import (
    ContextExceeded,
    EngineRefused,
    EngineStopped,
    GenerationFailed,
    GenerationRun,
)
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import Generation, fit_budget
from colibri.api.responses_api import ResponsesRequest
from colibri.api.responses_shapes import ResponsesShaper
from colibri.api.server_state import ServerState
from colibri.api.shaping import Answer, Shaper
from colibri.api.slot_owners import owner_of
from colibri.api.tools import cut_call, split_output
from colibri.model.tokenizer import TooManyTokens

Served = Generation | ResponsesRequest  # what an endpoint's parser makes of a body


def generation_of(request: Served) -> Generation:
    return request.gen if isinstance(request, ResponsesRequest) else request


def job(request: Served, model: str) -> tuple[Generation, Shaper]:
    """The request's generation and its endpoint's shaper: the one place endpoints differ."""
    if isinstance(request, ResponsesRequest):
        return request.gen, ResponsesShaper(request, model)
    return request, (ChatShaper if request.kind == "chat" else CompletionShaper)(request, model)


def count(state: ServerState, endpoint: str | None, status: int | None, ended: str | None) -> None:
    """A request counted by how it ended: ``status``, the HTTP status sent (None: none was);
    ``ended``, /health's counter ("completed", "rejected", "cancelled"; None: none, as for an
    engine failure, which ``GenerationRun`` counts where it sees it)."""
    if endpoint is not None and status is not None:
        state.metrics.requests.inc(endpoint=endpoint, status=str(status))
    if ended is not None:
        state.counters[ended] += 1


async def tokenize(state: ServerState, gen: Generation) -> None:
    """The prompt's ids, checked against the context before admission (and any header); the
    answer's budget capped to what the context leaves after them (``fit_budget``)."""
    if state.encode is None:
        return
    try:  # off the event loop (the tokenizer lets go of the GIL): a prompt may be megabytes of text
        gen.prompt_ids = tuple(await trio.to_thread.run_sync(state.encode, gen, state.n_ctx))
    except TooManyTokens as e:  # too long by its length alone: refused untokenized
        raise openai_errors.context_length_exceeded(e.at_least, state.n_ctx, gen.prompt_field,
                                                    at_least=True) from None
    if len(gen.prompt_ids) > state.n_ctx:
        raise openai_errors.context_length_exceeded(len(gen.prompt_ids), state.n_ctx, gen.prompt_field)
    fit_budget(gen, state.n_ctx)


# The ASGI scope key under which a request's leases wait for ``release_leftovers``.
LEFTOVER_LEASES = "colibri.leases"


def release_at_exit(scope: dict[str, Any], lease: SlotLease) -> None:
    """Have the server's middleware release ``lease`` when the request ends, whatever its body did
    (no-op without that middleware: a test app)."""
    leases = scope.get(LEFTOVER_LEASES)
    if leases is not None:
        leases.append(lease)


async def release_leftovers(scope: dict[str, Any], state: ServerState | None = None) -> None:
    """The leases a request still holds when its task has ended: its stream never started."""
    for lease in scope.get(LEFTOVER_LEASES, ()):
        if not lease.released and state is not None:
            count(state, None, None, "cancelled")  # the client left before the first frame
        await lease.release()


async def admit(state: ServerState, gen: Generation, session_id: str | None = None) -> SlotLease:
    """The request's slot, once free; a 429 ``ApiError`` if the queue is full or the wait too long.
    ``session_id``: the client's ``X-Session-Id``; a slot holding another owner's conversation is
    forgotten before this request runs in it (``slot_owners``)."""
    owner = owner_of(session_id)
    try:
        lease = await state.admission.lease(gen.cache_slot, gen.prompt_ids or gen.prompt, owner)
    except trio.Cancelled:
        count(state, None, None, "cancelled")  # the client left while queued
        raise
    except (QueueFull, QueueTimeout) as e:
        count(state, None, None, "rejected")
        raise openai_errors.server_busy(isinstance(e, QueueFull)) from None
    lease.owner = owner
    if state.owners is not None:
        try:
            lease.forget = await state.owners.claim(lease.slot, owner)
        except BaseException:
            await lease.release()
            raise
    state.metrics.queue_wait.observe(lease.waited)
    if lease.prefix_hit:
        state.metrics.prefix_hits.inc()
    return lease


def as_api_error(e: GenerationFailed, gen: Generation) -> ApiError:
    """What the client is told when a generation fails."""
    match e:
        case ContextExceeded():
            return openai_errors.context_length_exceeded(e.used, e.limit, gen.prompt_field)
        case EngineRefused():
            return openai_errors.engine_refused(e.code)
        case EngineStopped():
            return openai_errors.engine_stopped(e.reason)
    raise TypeError(f"unexpected {e!r}")


def answer_of(run: GenerationRun, gen: Generation, text: str, reasoning: str = "") -> Answer:
    """The finished answer; its tokens are counted into the metrics here, once. With tools
    offered, the text is the model's call or reply in the tools' format (``tools.split_output``);
    ``text`` is the answer alone, a thinking model's reasoning apart (``reasoning``)."""
    content, calls = split_output(text, gen.tools)
    if run.finish == "length" and gen.tools is not None:  # cut: no half call is shown as text
        content, partial = cut_call(text, content, calls, gen.tools)
        if partial is not None:
            gen.notes["dropped_tool_call"] = partial
    prompt, completion = run.record_usage()
    cached = run.perf.reused_tokens if run.perf else 0
    stats = {**run.stats(), **gen.notes}  # what the server changed, beside the engine's figures
    return Answer(content, calls, run.finish, prompt, completion, cached, stats, run.tokens,
                  reasoning if run.has_reasoning else None, run.reasoning_tokens, gen.reasoning)


async def answer_json(state: ServerState, request: Served, lease: SlotLease) -> dict[str, Any]:
    """The whole answer of a request that does not stream, or its ``ApiError``; owns the lease."""
    served = _served(state, request, lease, stream=False)
    try:
        return await anext(served)
    finally:
        await served.aclose()  # the clean-up, once the answer is whole


def answer_sse(state: ServerState, request: Served, lease: SlotLease) -> AsyncIterator[bytes]:
    """The SSE frames of a streamed answer; owns the lease. A failure after the headers travels
    as the endpoint's last frames."""
    return _served(state, request, lease, stream=True)


async def _served(state: ServerState, request: Served, lease: SlotLease, stream: bool) -> AsyncIterator[Any]:
    """The frames of a stream, or the one JSON object of a whole answer (module docstring)."""
    gen, shaper = job(request, state.model_id)
    run = GenerationRun(
        state.engine, gen, lease.slot, forget=lease.forget,
        metrics=state.metrics, counters=state.counters, count_tokens=state.count_tokens,
    )
    pieces = run.pieces()
    status: int | None = 200 if stream else None  # a stream's headers are out: 200, however it ends
    ended: str | None = "cancelled"  # unless it ends otherwise: the client went away
    try:
        parts: list[str] = []
        thoughts: list[str] = []
        for frame in shaper.opening() if stream else []:
            yield frame
        async for piece in pieces:
            parts.append(piece.text)
            thoughts.append(piece.reasoning)
            for frame in shaper.delta(piece) if stream else []:
                yield frame
        answer = answer_of(run, gen, "".join(parts), "".join(thoughts))
        status, ended = 200, "completed"
        if stream:
            for frame in shaper.closing(answer):
                yield frame
        else:
            yield shaper.whole(answer)
    except GenerationFailed as e:
        err, ended = as_api_error(e, gen), None  # counted by the run (a prompt too long: the client's)
        if not stream:
            status = err.status
            raise err from None
        for frame in shaper.failed(err):
            yield frame
    finally:
        with trio.CancelScope(shield=True):
            await pieces.aclose()  # ends the request in the engine before the slot is freed
            if state.owners is not None:
                await state.owners.settle(lease.slot, lease.owner, run.done.saved if run.done else None)
            await lease.release()
        count(state, shaper.endpoint, status, ended)
