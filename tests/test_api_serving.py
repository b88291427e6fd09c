"""The one serving path (``colibri.api.serving``) with a scripted engine: however a request ends (the
answer's end, a failure, the client gone mid-stream or mid-answer), the engine's request is ended
before its slot is released, and the request is counted once, in /health and in /metrics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import trio
from test_api_generation import ScriptedEngine, done, state_for, token

from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import parse_chat, parse_completion
from colibri.api.responses_api import parse as parse_responses
from colibri.api.server_state import ServerState
from colibri.api.serving import admit, answer_json, answer_sse
from colibri.io.events import Error, ErrorCode

USER = [{"role": "user", "content": "x"}]


def render(messages: list, thinking: bool, tools: list | None = None) -> str:
    return "prompt"


class HangingEngine(ScriptedEngine):
    """One token, then nothing until the request is closed (a long generation)."""

    async def generate(self, *args: object, **kw: object) -> AsyncIterator:
        try:
            for event in token("Hel"):
                yield event
            await trio.sleep_forever()
        finally:
            self.closed_early = True


def requests_counted(state: ServerState, endpoint: str, status: int) -> int:
    line = f'colibri_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    found = [row for row in state.registry.render().splitlines() if row.startswith(line)]
    return int(found[0].removeprefix(line)) if found else 0


@pytest.mark.parametrize(("request_of", "endpoint"), [
    (lambda: parse_chat({"messages": USER, "stream": True}, render, 64, 2), "/v1/chat/completions"),
    (lambda: parse_completion({"prompt": "p", "stream": True}, 64, 2), "/v1/completions"),
    (lambda: parse_responses({"input": "x", "stream": True}, render, 64, 2), "/v1/responses"),
])
async def test_a_client_gone_mid_stream_ends_the_request_then_frees_the_slot(request_of, endpoint):
    engine = HangingEngine([])
    state = state_for(engine)
    request = request_of()
    gen = getattr(request, "gen", request)
    frames = answer_sse(state, request, await admit(state, gen))
    async for frame in frames:  # until the first text: the generation is under way
        if b"Hel" in frame:
            break
    await frames.aclose()  # what the server does when the client leaves
    assert engine.closed_early and state.admission.active == 0
    assert state.counters == {"completed": 0, "rejected": 0, "cancelled": 1, "failed": 0}
    assert requests_counted(state, endpoint, 200) == 1


async def test_a_client_gone_before_a_whole_answer_is_counted_cancelled():
    engine = HangingEngine([])
    state = state_for(engine)
    gen = parse_chat({"messages": USER}, render, 64, 2)
    lease = await admit(state, gen)
    with trio.move_on_after(0.5):  # the client's request is cancelled while the answer is made
        await answer_json(state, gen, lease)
    assert engine.closed_early and state.admission.active == 0
    assert state.counters["cancelled"] == 1 and state.counters["completed"] == 0
    assert requests_counted(state, "/v1/chat/completions", 200) == 0  # no answer went out


async def test_whole_answers_count_their_status_once():
    state = state_for(ScriptedEngine([*token("hi"), done(1, length_limited=False)]))
    gen = parse_completion({"prompt": "p"}, 64, 2)
    assert (await answer_json(state, gen, await admit(state, gen)))["object"] == "text_completion"
    state.engine = ScriptedEngine([Error(1, ErrorCode.CONTEXT_EXCEEDED, (90, 64))])
    with pytest.raises(ApiError):
        await answer_json(state, gen, await admit(state, gen))
    assert requests_counted(state, "/v1/completions", 200) == 1
    assert requests_counted(state, "/v1/completions", 400) == 1
    assert state.counters == {"completed": 1, "rejected": 0, "cancelled": 0, "failed": 0}
    assert state.admission.active == 0


async def test_tool_calls_are_held_until_the_answer_is_whole():
    call = '{"tool_call": {"name": "f", "arguments": {}}}'
    state = state_for(ScriptedEngine([*token(call[:10]), *token(call[10:]), done(2, length_limited=False)]))
    body = {"messages": USER, "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}]}
    gen = parse_chat(body, render, 64, 2)
    frames = [f async for f in answer_sse(state, gen, await admit(state, gen))]
    deltas = [json.loads(f.removeprefix(b"data: "))["choices"][0]["delta"] for f in frames[1:-2]]
    assert len(deltas) == 1 and b'"finish_reason": "tool_calls"' in frames[-2]
    [call] = deltas[0]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": "{}"}
