"""What coding agents send (issue 42), served as real servers serve it.

Codex CLI's Responses requests (``client_metadata``, ``include``, ``reasoning.summary``, ``namespace``
and hosted tools, a tool result without ``call_id``), opencode's ``max_tokens: 32000`` above the
context, an answer cut inside a tool call (Continue printed the raw envelope), the Responses stream's
``sequence_number`` in the order events are sent, and ``/v1/models`` telling the context length.

Unit tests for the pure functions (``cut_call``, ``fit_budget``, ``chat_tools``), the serving path
with a scripted engine for the shapes of a cut answer, and end to end the official openai SDK (or a
plain SSE read) against a real ``coli serve`` on the default model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from openai.types.responses import Response
from serve_harness import read_sse, running_server, user
from test_api_generation import done, state_for, token

from colibri.api.openai_requests import fit_budget, parse_chat
from colibri.api.responses_api import chat_tools, parse
from colibri.api.routes import with_sampling_defaults
from colibri.api.serving import admit, answer_json, answer_sse
from colibri.api.tools import cut_call, parse_tools, split_output
from colibri.model.tool_format import CALL_CLOSE, CALL_OPEN

CTX = 1024  # the shared server's (serve_harness.SHARED_SERVER_ARGS)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function",
                "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawns an agent.",
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}
# The shapes Codex CLI sends (codex-rs: ResponsesApiRequest, CodexRequestIdentity::client_metadata,
# its namespace tool groups and hosted tools).
CODEX_FIELDS = {
    "client_metadata": {"x-codex-installation-id": "0b0e", "session_id": "s1", "thread_id": "t1",
                        "x-codex-window-id": "w1", "turn_id": "u1"},
    "include": ["reasoning.encrypted_content"], "store": False, "reasoning": {"summary": "auto"},
    "prompt_cache_key": "s1", "parallel_tool_calls": False, "tool_choice": "auto",
}
CODEX_TOOLS = [
    WEATHER,
    {"type": "web_search", "external_web_access": False},
    {"type": "namespace", "name": "collaboration", "description": "Agents",
     "tools": [SPAWN, {"type": "custom", "name": "exec", "format": {"type": "grammar"}}]},
]
CUT_CALL = '{"tool_call": {"name": "get_weather", "arguments": {"ci'


def render(messages: list, thinking: bool, tools: list | None = None) -> str:
    return "prompt"


# ----------------------------------------------------------------------------- pure functions


def test_cut_envelope_call_is_dropped_and_a_cut_reply_kept():
    plan = parse_tools({"tools": [CHAT_WEATHER]})
    assert plan is not None and plan.style == "generic"
    content, calls = split_output(CUT_CALL, plan)
    assert (content, calls) == (CUT_CALL, [])  # unparsed: split_output keeps it whole as text
    assert cut_call(CUT_CALL, content, calls, plan) == ("", CUT_CALL)
    reply = '{"response": "It is sunny in Par\\u00e9 to'
    assert cut_call(reply, reply, [], plan) == ("It is sunny in Paré to", None)
    assert cut_call('{"response": "a\\u00', '{"response": "a\\u00', [], plan) == ("a", None)
    whole = '{"response": "Hi"}'  # read whole (the budget ran out on its last token): kept
    assert cut_call(whole, *split_output(whole, plan), plan) == ("Hi", None)


def test_cut_marker_call_is_dropped_the_text_before_it_kept():
    plan = parse_tools({"tools": [CHAT_WEATHER]}, template=True)
    assert plan is not None and plan.style == "template"
    text = f'Let me check. {CALL_OPEN}{{"name": "get_weather", "argu'
    content, calls = split_output(text, plan)
    assert cut_call(text, content, calls, plan) == ("Let me check.", text[text.index(CALL_OPEN):])
    whole = f'{CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{CALL_CLOSE}'
    content, calls = split_output(whole + f" {CALL_OPEN}{{", plan)
    assert len(calls) == 1 and cut_call(whole, content, calls, plan)[0] is None


def test_budget_is_capped_to_what_the_context_leaves():
    gen = parse_chat({"messages": user("hi"), "max_tokens": 32000}, render, CTX, 1)
    assert gen.max_tokens == CTX and gen.requested_max_tokens == 32000  # no 400 above the context
    gen.prompt_ids = tuple(range(1000))
    fit_budget(gen, CTX)
    assert gen.max_tokens == CTX - 1000
    assert gen.notes["max_tokens"] == {"requested": 32000, "capped_to": CTX - 1000,
                                       "context_length": CTX, "prompt_tokens": 1000}
    small = parse_chat({"messages": user("hi"), "max_tokens": 5}, render, CTX, 1)
    small.prompt_ids = tuple(range(1000))
    fit_budget(small, CTX)
    assert small.max_tokens == 5 and "max_tokens" not in small.notes


def test_codex_tools_offer_functions_and_drop_the_rest():
    offered = chat_tools(CODEX_TOOLS)
    assert [t["function"]["name"] for t in offered.tools] == ["get_weather", "spawn_agent"]
    assert offered.namespaces == {"spawn_agent": "collaboration"}
    assert offered.dropped == [{"param": "tools[1]", "type": "web_search"},
                               {"param": "tools[2].tools[1]", "type": "custom", "name": "exec"}]
    req = parse({"input": "hi", "tools": CODEX_TOOLS, **CODEX_FIELDS}, render, CTX, 1)
    assert req.gen.tools is not None and req.gen.tools.names == ("get_weather", "spawn_agent")
    assert req.gen.notes["dropped_tools"] == offered.dropped
    assert req.echo["reasoning"] == {"effort": None, "summary": "auto"}


def test_an_error_in_a_namespaced_tool_names_where_it_is():
    bad_tool = {"type": "namespace", "name": "ns", "tools": [{**SPAWN, "name": "no spaces"}]}
    with pytest.raises(Exception) as e:
        parse({"input": "hi", "tools": [WEATHER, bad_tool]}, render, CTX, 1)
    assert "'tools[1].tools[0].name'" in str(e.value)


def test_a_tool_result_without_call_id_is_a_tool_message():
    items = [{"type": "function_call_output", "name": "create_goal", "output": "goal set"},
             {"role": "user", "content": "go on"}]
    req = parse({"input": items}, render, CTX, 1)
    assert req.gen.messages[0]["role"] == "user"  # generic style: a tool_response in a user turn
    assert json.loads(req.gen.messages[0]["content"]) == {
        "tool_response": {"name": "create_goal", "tool_call_id": "", "content": "goal set"}}


# ----------------------------------------------------------------------------- cut, scripted


def _chat(stream: bool) -> dict:
    return {"messages": user("weather?"), "tools": [CHAT_WEATHER], "max_tokens": 3, "stream": stream}


async def test_chat_answer_cut_inside_a_call_shows_no_envelope():
    state = state_for(_Engine())
    gen = parse_chat(_chat(False), render, 64, 2)
    out = await answer_json(state, gen, await admit(state, gen))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert "tool_calls" not in choice["message"] and out["colibri"]["dropped_tool_call"] == CUT_CALL


async def test_chat_stream_cut_inside_a_call_shows_no_envelope():
    state = state_for(_Engine())
    gen = parse_chat(_chat(True), render, 64, 2)
    frames = [f async for f in answer_sse(state, gen, await admit(state, gen))]
    chunks = [json.loads(f[6:]) for f in frames if f != b"data: [DONE]\n\n"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "" and "tool_call" not in b"".join(frames[:-2]).decode()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["colibri"]["dropped_tool_call"] == CUT_CALL


async def test_responses_cut_inside_a_call_is_incomplete_with_no_text():
    state = state_for(_Engine())
    req = parse({"input": "weather?", "tools": [WEATHER], "max_output_tokens": 3}, render, 64, 2)
    r = Response.model_validate(await answer_json(state, req, await admit(state, req.gen)))
    assert r.status == "incomplete" and r.output_text == ""
    assert all(item.type != "function_call" for item in r.output)
    assert r.model_extra["colibri"]["dropped_tool_call"] == CUT_CALL


class _Engine:
    """Plays an answer cut by its budget inside the tool envelope (``test_api_generation``'s)."""

    ready, reason = True, "ok"

    async def stop(self, rid: int) -> None: ...

    async def generate(self, *args: object, ticket=None, **kw: object):
        for event in [*token(CUT_CALL[:20]), *token(CUT_CALL[20:]), done(3, length_limited=True)]:
            yield event


# ----------------------------------------------------------------------------- end to end


def test_models_tell_the_context_length(http, server):
    listed = http.get("/v1/models").json()["data"][0]
    assert listed["context_length"] == listed["max_model_len"] == CTX
    assert http.get(f"/v1/models/{server.model_id}").json()["context_length"] == CTX


def test_codex_request_is_served_and_says_what_was_dropped(client, server):
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": "Be brief."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "function_call_output", "output": "goal noted"}]
    r = client.responses.create(model=server.model_id, instructions="You are a coding agent.", input=items,
                                tools=CODEX_TOOLS, max_output_tokens=16, temperature=0,
                                extra_body={"client_metadata": CODEX_FIELDS["client_metadata"]},
                                **{k: v for k, v in CODEX_FIELDS.items() if k != "client_metadata"})
    assert r.status in ("completed", "incomplete")
    dropped = r.model_extra["colibri"]["dropped_tools"]
    assert [d["param"] for d in dropped] == ["tools[1]", "tools[2].tools[1]"]
    for call in (item for item in r.output if item.type == "function_call"):
        assert call.name in ("get_weather", "spawn_agent")
        if call.name == "spawn_agent":
            assert call.model_extra["namespace"] == "collaboration"


def test_max_tokens_above_the_context_is_capped_and_binds(client, server):
    """opencode's 32000 on a 1024-token context: served, capped to what the prompt leaves, and the
    raw text completion of a repeated phrase (which the model goes on repeating) runs into the cap."""
    words = "lighthouse keeper " * 480  # ~960 tokens: a few dozen left of the 1024
    r = client.completions.create(model=server.model_id, prompt=words, max_tokens=32000, temperature=0)
    room = CTX - r.usage.prompt_tokens
    assert 0 < room < 100
    assert r.model_extra["colibri"]["max_tokens"] == {
        "requested": 32000, "capped_to": room, "context_length": CTX, "prompt_tokens": r.usage.prompt_tokens}
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=server.model_id, messages=user("Hi"), max_tokens=32000,
                                          max_completion_tokens=None, temperature=0)
    assert chat.model_extra["colibri"]["max_tokens"]["requested"] == 32000


def test_prompt_over_the_context_stays_a_400(http):
    body = {"messages": user("lighthouse " * (2 * CTX)), "max_tokens": 32000}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("tool_choice", ["required", "auto", None])
def test_responses_stream_numbers_count_up_as_sent(http, tool_choice):
    """A tool answer (required), a tool-offered text answer (auto), plain text (no tools):
    the raw SSE stream's sequence_number is 0, 1, 2, ... in the order the events arrive."""
    ask = "Weather in Paris?" if tool_choice == "required" else "Say hello."
    body = {"input": ask, "max_output_tokens": 96, "temperature": 0, "stream": True}
    if tool_choice is not None:
        body.update(tools=[WEATHER], tool_choice=tool_choice)
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        payloads = [json.loads(e) for e in read_sse(r)]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    kinds = {p["type"] for p in payloads}
    if tool_choice == "required":
        assert "response.function_call_arguments.done" in kinds
    else:
        assert "response.output_text.delta" in kinds


@pytest.mark.parametrize("stream", [False, True])
def test_chat_cut_inside_a_call_e2e(client, server, stream):
    """The real model, held to the envelope (``required``), cut after 4 tokens: no envelope shown."""
    kw = {"model": server.model_id, "messages": user("Weather in Paris?"), "tools": [CHAT_WEATHER],
          "tool_choice": "required", "max_tokens": 4, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish, extra = chunks[-1].choices[0].finish_reason, chunks[-1].model_extra["colibri"]
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        extra = r.model_extra["colibri"]
    assert finish == "length" and "{" not in text
    assert extra["dropped_tool_call"].startswith('{"tool_call')


def test_responses_cut_inside_a_call_e2e(client, server):
    r = client.responses.create(model=server.model_id, input="Weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.output_text == ""
    assert r.model_extra["colibri"]["dropped_tool_call"].startswith('{"tool_call')


# ----------------------------------------------------------------------------- sampling defaults


def test_sampling_defaults_fill_only_what_a_body_leaves_out():
    defaults = {"temperature": 0.0, "top_p": 0.5}
    assert with_sampling_defaults({"input": "x"}, defaults) == {"input": "x", **defaults}
    mixed = with_sampling_defaults({"temperature": 1.5, "top_p": None}, defaults)
    assert mixed == {"temperature": 1.5, "top_p": 0.5}
    assert with_sampling_defaults({"temperature": "hot"}, defaults)["temperature"] == "hot"  # its own: a 400
    assert with_sampling_defaults(["not", "a", "body"], defaults) == ["not", "a", "body"]
    assert with_sampling_defaults({"input": "x"}, {}) == {"input": "x"}


@pytest.mark.parametrize("flag", [("--temperature", "2.5"), ("--top-p", "0")])
def test_sampling_defaults_out_of_range_fail_at_start(flag):
    out = subprocess.run([sys.executable, "-m", "colibri", "serve", *flag, "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and flag[0] in out.stderr, out.stderr


def test_server_temperature_is_what_codex_gets(tmp_path):
    """Codex never sends a temperature: with ``--temperature 0`` its answers are the greedy ones,
    the Responses echo says so, and a request's own temperature still wins."""
    with running_server("--ctx", "1024", "--temperature", "0", "--no-persist") as server:
        client = server.client()
        ask = {"model": server.model_id, "input": "Name three colors.", "max_output_tokens": 24,
               "extra_body": {"client_metadata": CODEX_FIELDS["client_metadata"]},
               **{k: v for k, v in CODEX_FIELDS.items() if k not in ("tool_choice", "client_metadata")}}
        first, second = client.responses.create(**ask), client.responses.create(**ask)
        greedy = client.responses.create(**ask, temperature=0)
        assert first.temperature == 0 and first.output_text == second.output_text == greedy.output_text
        hot = [client.responses.create(**{**ask, "extra_body": {**ask["extra_body"], "seed": s}},
                                       temperature=2.0).output_text for s in range(3)]
        assert any(text != greedy.output_text for text in hot)
