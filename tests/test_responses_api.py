"""OpenAI's Responses API (``POST /v1/responses``), for the text and tool subset.

Unit tests: the translation of a Responses body into a chat body (items, instructions, tools,
``text.format``), the refusals (what needs a stored response, built-in tools), the errors renamed to
the Responses field, and the answer's events with a scripted engine. End to end: the official SDK's
``client.responses.create`` against a real ``coli serve``, plain and streamed, its stream helper,
``max_output_tokens`` giving an incomplete response, and the 400s in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.responses import Response
from serve_harness import error_body, read_sse
from test_api_generation import done, state_for, token

from colibri.api.openai_errors import ApiError
from colibri.api.responses_api import parse, renamed, to_chat
from colibri.api.responses_shapes import EventStream, ResponseEnvelope
from colibri.api.serving import admit, answer_json, answer_sse
from colibri.io.events import Error, ErrorCode

CTX = 512
SERVER_ARGS = ("--web-dist", "/nonexistent/web/dist", "--ctx", str(CTX))
N = 4
Q = "Tell me a story about the sea."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ENVELOPE_CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'


class ScriptedEngine:
    """Plays ``events`` for every request, whatever it is asked (a grammar, a seed...)."""

    ready, reason = True, "ok"

    def __init__(self, events: list) -> None:
        self.events = events

    async def generate(self, *args: object, **kw: object) -> AsyncIterator:
        for event in self.events:
            yield event


def render(messages: list, thinking: bool, tools: list | None = None) -> str:
    return "prompt"


def parse_body(body: dict):
    return parse(body, render, 64, 2)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_body(body)
    assert e.value.status == 400
    return e.value


# ----------------------------------------------------------------------------- the translation


def test_string_input_with_instructions_is_system_then_user():
    chat, origins, _ = to_chat({"input": "hi", "instructions": "be brief", "max_output_tokens": 7,
                             "temperature": 0, "stream": True})
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert origins == ["instructions", "input"]
    assert (chat["max_tokens"], chat["temperature"], chat["stream"]) == (7, 0, True)


def test_items_become_messages_tool_calls_and_tool_results():
    items = [
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    chat, origins, _ = to_chat({"input": items})
    m = chat["messages"]
    assert m[0] == {"role": "developer", "content": "sys"} and m[1] == {"role": "user", "content": "ab"}
    assert m[2]["content"] == "let me look" and [c["id"] for c in m[2]["tool_calls"]] == ["c1", "c2"]
    assert m[2]["tool_calls"][1] == {"id": "c2", "type": "function",
                                     "function": {"name": "g", "arguments": "{\"x\": 1}"}}
    assert m[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert m[4]["role"] == "assistant" and m[4]["content"] is None and m[4]["tool_calls"][0]["id"] == "c3"
    assert origins == ["input[0]", "input[1]", "input[2]", "input[5]", "input[6]"]


def test_tools_tool_choice_and_text_format_in_chat_shape():
    chat, _, _ = to_chat({
        "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}},
    })
    fn = {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}
    assert chat["tools"] == [{"type": "function", "function": fn}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    assert to_chat({"input": "x", "text": {"format": {"type": "json_object"}}})[0]["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in to_chat({"input": "x", "text": {"format": {"type": "text"}}})[0]


def test_defaults_and_metadata_are_accepted():
    req = parse_body({"model": "any", "input": "hi", "metadata": {"k": "v"}, "user": "u", "store": True,
                      "prompt_cache_key": "p", "safety_identifier": "s", "service_tier": "auto",
                      "background": False, "include": [], "truncation": "disabled",
                      "previous_response_id": None, "tool_choice": "auto", "tools": [],
                      "text": {"format": {"type": "text"}}, "reasoning": {"effort": None}})
    assert req.gen.kind == "chat" and req.gen.messages == [{"role": "user", "content": "hi"}]
    assert not req.parse_tools
    assert req.echo["metadata"] == {"k": "v"} and req.echo["tool_choice"] == "auto"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store"),
    ({"conversation": "conv_1"}, "conversation", "does not store"),
    ({"background": True}, "background", "does not store"),
    ({"tools": [{"name": "typeless"}]}, "tools[0]", "'type'"),
    ({"tools": [{"type": "namespace", "name": "ns"}]}, "tools[0]", "namespace"),
    ({"reasoning": {"effort": "low", "summary": "verbose"}}, "reasoning.summary", "one of"),
    ({"reasoning": {"effort": "low", "context": "x"}}, "reasoning.context", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]", "logprobs"),
    ({"include": ["reasoning.encrypted_content", "frobnicate"]}, "include[1]", "not supported"),
    ({"include": "reasoning.encrypted_content"}, "include", "list"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "does not store"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "only text"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "unknown role"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "json_schema"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "function"),
    ({"frobnicate": 1}, "frobnicate", "not supported"),
])
def test_refusals_name_the_responses_field(body, param, words):
    err = refused({"input": "hi", **body})
    assert err.param == param and words in err.message


@pytest.mark.parametrize(("body", "param"), [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"instructions": "ok", "input": [{"role": "user", "content": "\ud800"}]}, "input[0].content"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
])
def test_chat_path_errors_are_renamed(body, param):
    err = refused({"input": "hi", **body})
    assert err.param == param
    assert "max_tokens" not in err.message and "messages" not in err.message


def test_renamed_maps_a_message_index_to_its_item():
    err = renamed(ApiError(400, "bad", "messages[1].content"), ["instructions", "input[3]"])
    assert err.param == "input[3].content"


def test_tools_are_planned_and_tool_choice_none_offers_none():
    req = parse_body({"input": "hi", "tools": [WEATHER], "parallel_tool_calls": False})
    assert req.parse_tools and req.gen.tools is not None and req.gen.tools.names == ("get_weather",)
    assert req.gen.grammar  # the generic style: the answer is held to the envelope
    assert not parse_body({"input": "hi", "tools": [WEATHER], "tool_choice": "none"}).parse_tools


def test_tool_errors_name_the_flat_field():
    err = refused({"input": "hi", "tools": [{**WEATHER, "name": "no spaces allowed"}]})
    assert err.param == "tools" and "'tools[0].name'" in err.message


# ----------------------------------------------------------------------------- the shapes


def test_response_object_parses_as_the_sdks_model():
    env = ResponseEnvelope("m", parse_body({"input": "hi"}).echo)
    started = env.response("in_progress", [])
    assert Response.model_validate(started).status == "in_progress"
    assert started["id"].startswith("resp_") and started["store"] is False


def test_events_are_numbered_and_framed():
    events = EventStream(ResponseEnvelope("m", {}))
    frames = events.send(events.opening() + events.message_start(0, "msg_1"))
    assert [f.split(b"\n")[0] for f in frames] == [
        b"event: response.created", b"event: response.in_progress",
        b"event: response.output_item.added", b"event: response.content_part.added"]
    datas = [json.loads(f.split(b"\n")[1].removeprefix(b"data: ")) for f in frames]
    assert [d["sequence_number"] for d in datas] == [0, 1, 2, 3]
    assert all(f.endswith(b"\n\n") for f in frames)


# ----------------------------------------------------------------------------- the run, scripted


def sse_types(frames: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for f in frames:
        head, data = f.decode().rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append((payload["type"], payload))
    return out


async def test_json_answer_is_a_response():
    state = state_for(ScriptedEngine([*token("Hel"), *token("lo"), done(2, length_limited=False)]))
    req = parse_body({"input": "x", "instructions": "y"})
    answer = await answer_json(state, req, await admit(state, req.gen))
    r = Response.model_validate(answer)
    assert r.status == "completed" and r.output_text == "Hello" and r.instructions == "y"
    assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (3, 2)
    assert answer["colibri"]["stats"]["emitted"] == 2 and state.admission.active == 0


async def test_json_answer_cut_by_the_budget_is_incomplete():
    state = state_for(ScriptedEngine([*token("Hel"), done(1, length_limited=True)]))
    req = parse_body({"input": "x", "max_output_tokens": 1})
    answer = await answer_json(state, req, await admit(state, req.gen))
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["output"][0]["status"] == "incomplete"


async def test_sse_events_in_order_then_slot_released():
    state = state_for(ScriptedEngine([*token("Hel"), *token("lo"), done(2, length_limited=False)]))
    req = parse_body({"input": "x", "stream": True})
    frames = [f async for f in answer_sse(state, req, await admit(state, req.gen))]
    events = sse_types(frames)
    assert [t for t, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["output"][0]["id"] == events[2][1]["item"]["id"] == events[4][1]["item_id"]
    assert Response.model_validate(final).output_text == "Hello" and "colibri" in final
    assert state.admission.active == 0 and state.counters["completed"] == 1


async def test_sse_failure_after_headers_is_error_then_failed():
    state = state_for(ScriptedEngine([Error(1, ErrorCode.SLOT_BUSY)]))
    req = parse_body({"input": "x", "stream": True})
    frames = [f async for f in answer_sse(state, req, await admit(state, req.gen))]
    events = sse_types(frames)
    assert [t for t, _ in events][-2:] == ["error", "response.failed"]
    assert events[-1][1]["response"]["status"] == "failed"
    assert events[-1][1]["response"]["error"]["code"] == "server_error"
    assert state.counters["failed"] == 1 and state.admission.active == 0


async def test_tool_call_answer_is_a_function_call_item():
    state = state_for(ScriptedEngine([*token(ENVELOPE_CALL), done(1, length_limited=False)]))
    req = parse_body({"input": "x", "tools": [WEATHER], "parallel_tool_calls": False})
    r = Response.model_validate(await answer_json(state, req, await admit(state, req.gen)))
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"


async def test_tool_call_streams_after_the_answer_is_whole():
    state = state_for(ScriptedEngine([*token(ENVELOPE_CALL[:20]), *token(ENVELOPE_CALL[20:]),
                                      done(2, length_limited=False)]))
    req = parse_body({"input": "x", "tools": [WEATHER], "stream": True})
    frames = [f async for f in answer_sse(state, req, await admit(state, req.gen))]
    events = sse_types(frames)
    assert [t for t, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done_ = events[2][1]["item"], events[5][1]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert done_["id"] == added["id"] and done_["call_id"] == added["call_id"]
    assert json.loads(events[3][1]["delta"]) == json.loads(done_["arguments"]) == {"city": "Paris"}
    assert events[-1][1]["response"]["output"] == [done_]


async def test_tool_enabled_plain_answer_is_a_message():
    state = state_for(ScriptedEngine([*token('{"response": "Hi there"}'), done(1, length_limited=False)]))
    req = parse_body({"input": "x", "tools": [WEATHER], "stream": True})
    frames = [f async for f in answer_sse(state, req, await admit(state, req.gen))]
    events = sse_types(frames)
    deltas = [p["delta"] for t, p in events if t == "response.output_text.delta"]
    assert deltas == ["Hi there"] and events[-1][0] == "response.completed"
    assert Response.model_validate(events[-1][1]["response"]).output_text == "Hi there"


# ----------------------------------------------------------------------------- end to end, the SDK


def test_sdk_create_with_string_input(client, server):
    r = client.responses.create(model=server.model_id, input=Q, max_output_tokens=N, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model_id
    assert r.output_text and r.output[0].type == "message"
    assert r.usage is not None and r.usage.output_tokens == N and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.model_extra["colibri"]["stats"]["emitted"] == N


def test_sdk_items_and_instructions_match_chat(client, server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another one?"}]
    r = client.responses.create(model=server.model_id, input=items, instructions="Answer in one word.",
                                max_output_tokens=N, temperature=0)
    chat = client.chat.completions.create(
        model=server.model_id, max_tokens=N, temperature=0,
        messages=[{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another one?"}])
    assert r.output_text == chat.choices[0].message.content  # the same prompt, greedy


def test_sdk_stream_events(client, server):
    stream = client.responses.create(model=server.model_id, input=Q, max_output_tokens=N,
                                     temperature=0, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas and deltas == done.text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_sdk_stream_helper_final_response(client, server):
    with client.responses.stream(model=server.model_id, input="Say hi.", max_output_tokens=64,
                                 temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text


def test_raw_stream_has_no_done_sentinel(http):
    body = {"input": Q, "max_output_tokens": N, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = read_sse(r)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["type"] == "response.incomplete"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_abc"}, "previous_response_id"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"input": "lighthouse " * (2 * CTX)}, "input"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_refusals_are_400_before_any_header(http, body, param, stream):
    r = http.post("/v1/responses", json={"input": "hi", **body, "stream": stream})
    assert r.status_code == 400 and error_body(r)["param"] == param


def test_sdk_raises_bad_request_for_previous_response_id(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model_id, input="hi", previous_response_id="resp_abc")
    assert "does not store responses" in str(e.value)


# Sampled at temperature 1, an unbounded name ran past max_output_tokens about once in 7 runs and came
# back cut (not JSON): the name is bounded so that the reply always ends inside the budget.
BOUNDED_SCHEMA = {**SCHEMA, "properties": {"name": {"type": "string", "maxLength": 32},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_sdk_json_schema_output_parses(client, server):
    r = client.responses.create(
        model=server.model_id, input="Invent a person.", max_output_tokens=96, temperature=1,
        text={"format": {"type": "json_schema", "name": "person", "schema": BOUNDED_SCHEMA, "strict": True}},
        extra_body={"seed": 5})  # seeded: maxLength counts characters, and a character may be 3 tokens
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_forced_function_call(client, server, stream):
    kw = {"model": server.model_id, "input": "What is the weather in Paris?", "tools": [WEATHER],
          "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
          "max_output_tokens": 96, "temperature": 0}
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}


def test_sdk_function_call_round_trip(client, server):
    """The agent loop: the call and its output go back as input items; the model answers."""
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": json.dumps({"city": "Paris"})},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 25 C"}]
    r = client.responses.create(model=server.model_id, input=items, tools=[WEATHER],
                                max_output_tokens=48, temperature=0)
    assert r.output and all(item.type in ("message", "function_call") for item in r.output)


def test_raw_stream_of_a_function_call(http):
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 96, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in read_sse(r)]
    kinds = [e["type"] for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert json.loads(events[4]["arguments"]).keys() == {"city"}


def test_tool_choice_none_streams_text(client, server):
    r = client.responses.create(model=server.model_id, input=Q, tools=[WEATHER], tool_choice="none",
                                max_output_tokens=N, temperature=0)
    plain = client.responses.create(model=server.model_id, input=Q, max_output_tokens=N, temperature=0)
    assert r.output_text == plain.output_text and r.output[0].type == "message"
