"""One completion request served, from admission to the last byte, with no web framework in it.

``admit`` takes a KV slot (or refuses with 429); ``answer_json`` and ``answer_sse`` run the
generation on it and shape the answer. A stream outlives the route that returns it, so the slot
goes with it: ``answer_sse`` releases it when the stream ends, after the engine has ended the
request (a slot handed on earlier would still be the engine's: SLOT_BUSY). Each request counts once
in /health's counters, by how it ended.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from colibri.api import openai_errors
from colibri.api.admission import QueueFull, QueueTimeout, SlotLease
from colibri.api.generation import (
    ContextExceeded,
    EngineRefused,
    EngineStopped,
    GenerationFailed,
    GenerationRun,
)
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import Generation
from colibri.api.openai_responses import SSE_DONE, Envelope, logprobs, sse, usage
from colibri.api.server_state import ServerState
from colibri.api.tools import split_output


async def admit(state: ServerState, gen: Generation) -> SlotLease:
    """The request's slot, once free; a 429 ``ApiError`` if the queue is full or the wait too long."""
    try:
        lease = await state.admission.lease(gen.cache_slot, gen.prompt_ids or gen.prompt)
    except trio.Cancelled:
        state.counters["cancelled"] += 1  # the client left while queued
        raise
    except (QueueFull, QueueTimeout) as e:
        state.counters["rejected"] += 1
        raise openai_errors.server_busy(isinstance(e, QueueFull)) from None
    state.metrics.queue_wait.observe(lease.waited)
    if lease.prefix_hit:
        state.metrics.prefix_hits.inc()
    return lease


def start(state: ServerState, gen: Generation, lease: SlotLease) -> tuple[GenerationRun, Envelope]:
    """The generation on the leased slot, and the envelope of its answer."""
    run = GenerationRun(
        state.engine, gen, lease.slot,
        metrics=state.metrics, counters=state.counters, count_tokens=state.count_tokens,
    )
    return run, Envelope.open(gen, state.model_id)


def as_api_error(e: GenerationFailed, gen: Generation) -> ApiError:
    """What the client is told when a generation fails."""
    match e:
        case ContextExceeded():
            return openai_errors.context_length_exceeded(
                e.used, e.limit, "messages" if gen.kind == "chat" else "prompt"
            )
        case EngineRefused():
            return openai_errors.engine_refused(e.code)
        case EngineStopped():
            return openai_errors.engine_stopped(e.reason)
    raise TypeError(f"unexpected {e!r}")


async def answer_json(state: ServerState, gen: Generation, lease: SlotLease) -> dict[str, Any]:
    """The whole answer of a request that does not stream; the slot is released on return."""
    async with lease:
        run, env = start(state, gen, lease)
        parts, tokens = [], []
        try:
            async for piece in run.pieces():
                parts.append(piece.text)
                tokens.extend(piece.tokens)
        except GenerationFailed as e:
            raise as_api_error(e, gen) from None
        state.counters["completed"] += 1
        extra = {"colibri": run.stats()}
        use = usage(*run.record_usage())
        content, calls = answer_of("".join(parts), gen)
        finish = "tool_calls" if calls else run.finish
        return env.final(content, finish, use, logprobs(gen, tokens), extra, calls)


def answer_of(text: str, gen: Generation) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's content and tool calls: with tools offered, the text is the model's call or
    reply in the tools' format (``tools.split_output``); else it is the content."""
    if gen.tools is None:
        return text, []
    return split_output(text, gen.tools)


async def answer_sse(
    state: ServerState, gen: Generation, lease: SlotLease, endpoint: str
) -> AsyncIterator[bytes]:
    """The SSE frames of a streamed answer; owns the lease from here on."""
    frames = _frames(state, gen, lease)
    try:
        async for frame in frames:
            yield frame
    finally:
        with trio.CancelScope(shield=True):
            await frames.aclose()  # ends the request in the engine before the slot is freed
            await lease.release()
        state.metrics.requests.inc(endpoint=endpoint, status="200")


async def _frames(state: ServerState, gen: Generation, lease: SlotLease) -> AsyncIterator[bytes]:
    """The frames proper; the request counts as completed once [DONE] is out, cancelled if the
    client leaves first."""
    run, env = start(state, gen, lease)
    pieces = run.pieces()
    try:
        if gen.kind == "chat":
            yield sse(env.role_chunk())
        offset, held = 0, []
        async for piece in pieces:
            if gen.tools is not None:
                held.append(piece)  # a call or a reply: known once the whole answer is in
            elif piece.text or piece.tokens:
                yield sse(env.chunk(text=piece.text, logprobs=logprobs(gen, piece.tokens, offset)))
                offset += len(piece.text)
        finish = run.finish
        if held:
            content, calls = answer_of("".join(p.text for p in held), gen)
            tokens = [t for p in held for t in p.tokens]
            yield sse(env.chunk(text=content, tool_calls=calls, logprobs=logprobs(gen, tokens)))
            finish = "tool_calls" if calls else finish
        stats = run.stats()
        use = usage(*run.record_usage())
        yield sse(env.finish_chunk(finish, stats))
        if gen.include_usage:
            yield sse(env.usage_chunk(use, stats))  # the last chunk: nothing may follow it
        yield SSE_DONE
        state.counters["completed"] += 1
    except GenerationFailed as e:  # after the headers: the error travels as a final SSE event
        yield sse(as_api_error(e, gen).body())
        yield SSE_DONE
    except (trio.Cancelled, GeneratorExit):
        state.counters["cancelled"] += 1  # the client went away
        raise
    finally:
        with trio.CancelScope(shield=True):
            await pieces.aclose()
