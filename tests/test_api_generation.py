"""Unit tests of one generation and its answer, with a scripted engine in place of the real one.

The end-to-end files (test_serve_*.py) run the real engine; here the engine's events are chosen, so
the rare paths are certain: a stop string mid-stream, each kind of engine failure, and the order
of the SSE frames, the counters and the slot's release.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from colibri.api.admission import Admission
from colibri.api.engine_client import EngineDied
from colibri.api.generation import ContextExceeded, EngineRefused, EngineStopped, GenerationRun
from colibri.api.metrics import server_metrics
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import MAX_TOP_LOGPROBS, parse_chat, parse_completion
from colibri.api.security import CorsPolicy, HostGuard
from colibri.api.server_state import ServerState
from colibri.api.serving import admit, answer_json, answer_sse
from colibri.io.events import TOPK_CANDIDATES, Data, Done, Error, ErrorCode, TopK

PROMPT_TOKENS = 3


def token(text: str, lp: float = -0.5) -> list:
    """A DATA and its TOPK: the sampled token first, then one less likely candidate."""
    return [Data(1, text.encode()), TopK(1, ((lp, text.encode()), (lp - 1, b"?")))]


def done(emitted: int, length_limited: bool = True) -> Done:
    return Done(1, emitted, 10.0, 0.0, 0.1, PROMPT_TOKENS, length_limited)


class ScriptedEngine:
    """Plays ``events`` for every request; records whether the consumer closed the stream early."""

    ready, reason = True, "ok"

    def __init__(self, events: list, die: bool = False) -> None:
        self.events, self.die, self.closed_early = events, die, False
        self.stopped: int | None = None  # the id a STOP named

    async def stop(self, rid: int) -> None:
        self.stopped = rid

    async def generate(self, prompt: str, slot: int, *args: object, grammar: str | None = None,
                       ticket=None, forget: bool = False, speculative: bool | None = None) -> AsyncIterator:
        self.speculative = speculative
        finished = False
        if ticket is not None:
            ticket.id = 1
        try:
            for event in self.events:
                await trio.lowlevel.checkpoint()
                if self.stopped and isinstance(event, Data | TopK):
                    continue  # STOP: the engine ends the turn; no more tokens come
                finished = isinstance(event, Done | Error)
                yield event
            if self.die:
                raise EngineDied("killed")
        finally:
            self.closed_early = not finished and not self.die


def state_for(engine: ScriptedEngine) -> ServerState:
    return ServerState(
        model_id="m", n_slots=2, n_ctx=64, api_key=None, engine=engine,  # type: ignore[arg-type]
        admission=Admission(2, 4, 5.0), render=lambda messages, thinking: "prompt",
        count_tokens=lambda prompt: PROMPT_TOKENS, host_guard=HostGuard("127.0.0.1", 8000),
        cors=CorsPolicy(), web_dist=Path("/nonexistent"),
    )


def run_of(engine: ScriptedEngine, stops: list[str] | None = None) -> tuple[GenerationRun, dict]:
    counters = dict.fromkeys(("completed", "rejected", "cancelled", "failed"), 0)
    gen = parse_completion({"prompt": "p", "stop": stops, "logprobs": 1}, 64, 2)
    _, metrics = server_metrics()
    run = GenerationRun(engine, gen, 0, metrics=metrics, counters=counters,  # type: ignore[arg-type]
                        count_tokens=lambda prompt: PROMPT_TOKENS)
    return run, counters


def test_top_logprobs_bound_is_the_protocols() -> None:
    assert MAX_TOP_LOGPROBS == TOPK_CANDIDATES
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    parse_chat({**body, "top_logprobs": TOPK_CANDIDATES}, lambda m, t: "p", 64, 1)
    with pytest.raises(ApiError) as e:
        parse_chat({**body, "top_logprobs": TOPK_CANDIDATES + 1}, lambda m, t: "p", 64, 1)
    assert e.value.param == "top_logprobs"


async def test_pieces_carry_their_tokens_logprobs() -> None:
    run, counters = run_of(ScriptedEngine([*token("Hel"), *token("lo"), done(2)]))
    pieces = [p async for p in run.pieces()]
    assert [p.text for p in pieces] == ["Hel", "lo"]
    assert [[t.text for t in p.tokens] for p in pieces] == [[b"Hel"], [b"lo"]]
    assert pieces[0].tokens[0].top == [(b"Hel", -0.5), (b"?", -1.5)]
    assert run.finish == "length" and run.record_usage() == (PROMPT_TOKENS, 2)
    assert run.stats()["stats"]["emitted"] == 2 and counters["failed"] == 0


async def test_stop_string_ends_the_request_in_the_engine() -> None:
    engine = ScriptedEngine([*token("a b"), *token(" c d"), *token("never"), done(3)])
    run, _ = run_of(engine, stops=["b c"])
    text = "".join([p.text async for p in run.pieces()])
    assert text == "a " and run.finish == "stop"
    # the engine was told to STOP, not left to run to max_tokens, and its DONE (the stats) came
    assert engine.stopped == 1 and not engine.closed_early and run.done is not None


@pytest.mark.parametrize(
    ("events", "die", "raised", "failed"),
    [
        ([Error(1, ErrorCode.CONTEXT_EXCEEDED, (90, 64))], False, ContextExceeded, 0),  # the client's fault
        ([Error(1, ErrorCode.SLOT_BUSY)], False, EngineRefused, 1),
        (token("x"), True, EngineStopped, 1),
    ],
)
async def test_engine_failures(events: list, die: bool, raised: type, failed: int) -> None:
    run, counters = run_of(ScriptedEngine(events, die))
    with pytest.raises(raised):
        [p async for p in run.pieces()]
    assert counters["failed"] == failed


async def test_json_answer_releases_the_slot_and_counts() -> None:
    state = state_for(ScriptedEngine([*token("hi"), done(1, length_limited=False)]))
    gen = parse_chat({"messages": [{"role": "user", "content": "x"}]}, state.render, 64, 2)
    lease = await admit(state, gen)
    assert state.admission.active == 1
    answer = await answer_json(state, gen, lease)
    assert state.admission.active == 0 and state.counters["completed"] == 1
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == "hi"
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["colibri"]["slot"] == lease.slot
    assert answer["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": 4}


async def test_json_answer_error_is_an_api_error() -> None:
    state = state_for(ScriptedEngine([Error(1, ErrorCode.CONTEXT_EXCEEDED, (90, 64))]))
    gen = parse_completion({"prompt": "p"}, 64, 2)
    with pytest.raises(ApiError) as e:
        await answer_json(state, gen, await admit(state, gen))
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "context_length_exceeded")
    assert state.admission.active == 0


async def test_sse_frames_in_order_then_slot_released() -> None:
    state = state_for(ScriptedEngine([*token("hi"), done(1)]))
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}
    gen = parse_chat(body, state.render, 64, 2)
    frames = [f async for f in answer_sse(state, gen, await admit(state, gen))]
    assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") for f in frames)
    assert frames[-1] == b"data: [DONE]\n\n"
    kinds = [f.split(b'"choices": ', 1)[1][:2] for f in frames[:-1]]
    assert kinds == [b"[{", b"[{", b"[{", b"[]"]  # role, text, finish (+ colibri); usage (+ colibri)
    assert b'"finish_reason": "length"' in frames[-3] and b'"colibri": {"slot"' in frames[-3]
    assert b'"usage": {"prompt_tokens"' in frames[-2] and b'"colibri": {"slot"' in frames[-2]
    assert state.admission.active == 0 and state.counters["completed"] == 1


async def test_sse_error_after_headers_is_a_frame() -> None:
    state = state_for(ScriptedEngine([Error(1, ErrorCode.SLOT_BUSY)]))
    gen = parse_completion({"prompt": "p", "stream": True}, 64, 2)
    frames = [f async for f in answer_sse(state, gen, await admit(state, gen))]
    assert frames[-2].startswith(b'data: {"error": {"message": "the engine refused the request: SLOT_BUSY"')
    assert frames[-1] == b"data: [DONE]\n\n"
    assert state.counters == {"completed": 0, "rejected": 0, "cancelled": 0, "failed": 1}
    assert state.admission.active == 0
