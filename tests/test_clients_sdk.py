"""openai-python's structured outputs and tools against ``coli serve``.

What ``test_clients_openai.py`` does not already show: ``parse()`` with a Pydantic model (the GA
``chat.completions.parse`` and the ``beta`` alias, sync and async), the ``.stream()`` helper's
events and final completion for a structured output and for a tool call, ``json_object`` mode, and
``tools`` with ``tool_choice`` required, named, auto and none, streamed tool calls reassembled from
their deltas, a second turn carrying the assistant's ``tool_calls`` message and the tool's result
back, and the ``/v1/responses`` subset (text, streamed events, a function call). Every structured
output is parsed and checked against its schema with ``jsonschema``. One real server, shared.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serve_harness import user

N_JSON = 120  # room for the small objects below; a cut reply is a failure, not a pass


class Person(BaseModel):
    """A small structured output: bounded so a sampled reply always fits in ``N_JSON``."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": WEATHER_PARAMS, "strict": True,
}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": TIME_PARAMS, "strict": True,
}}
TOOLS = [WEATHER, TIME]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK_WEATHER = user("What is the weather like in Paris today? Use the tool.")


def assert_valid_call(call, names: set[str]) -> dict:
    """One OpenAI tool call: an id, type function, a known name, arguments valid for its schema."""
    assert call.id and call.type == "function", call
    assert call.function.name in names, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return args


def assert_tool_call_reply(choice, names: set[str]) -> list[dict]:
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content, choice.message  # null (or empty), as OpenAI sends it
    assert choice.message.tool_calls, choice.message
    return [assert_valid_call(c, names) for c in choice.message.tool_calls]


# ------------------------------------------------------------------------------- structured outputs


@pytest.mark.parametrize("api", ["ga", "beta"])
def test_parse_with_a_pydantic_model(client, server, api):
    """``parse()`` sends the model's strict JSON schema and gets back a parsed, valid ``Person``."""
    completions = client.chat.completions if api == "ga" else client.beta.chat.completions
    completion = completions.parse(
        model=server.model_id, messages=user("Invent a person: a name and an age."),
        response_format=Person, max_tokens=N_JSON, temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", completion
    assert isinstance(message.parsed, Person), message
    assert message.refusal is None
    assert Person.model_validate_json(message.content) == message.parsed


def test_async_parse_with_a_pydantic_model(server):
    """The async client's ``parse()``: the same contract."""
    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                      max_retries=0) as c:
            return await c.chat.completions.parse(
                model=server.model_id, messages=user("Invent a person."),
                response_format=Person, max_tokens=N_JSON, temperature=1, seed=7,
            )

    completion = asyncio.run(main())
    assert isinstance(completion.choices[0].message.parsed, Person), completion


def test_json_schema_as_a_plain_dict(client, server):
    """A hand-written ``json_schema`` response_format (strict): the content validates against it."""
    schema = {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "shiny": {"type": "boolean"},
        },
        "required": ["colour", "count", "shiny"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=server.model_id, messages=user("Describe a marble."), max_tokens=N_JSON, temperature=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "marble", "schema": schema, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_mode(client, server):
    """``{"type": "json_object"}``: the reply is one JSON object and the generation stops after it."""
    r = client.chat.completions.create(
        model=server.model_id, max_tokens=N_JSON, temperature=0,
        messages=user("Give a JSON object with the keys name and age for Ann, aged 30."),
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict), r


def test_stream_helper_with_a_structured_output(client, server):
    """The ``.stream()`` helper: content deltas, a ``content.done`` event carrying the parsed
    object, and a final completion whose message is parsed."""
    with client.chat.completions.stream(
        model=server.model_id, messages=user("Invent a person."), response_format=Person,
        max_tokens=N_JSON, temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    types = [e.type for e in events]
    assert "chunk" in types and "content.delta" in types, types
    done = [e for e in events if e.type == "content.done"]
    assert len(done) == 1 and isinstance(done[0].parsed, Person), done
    assert "".join(e.delta for e in events if e.type == "content.delta") == done[0].content
    assert final.choices[0].message.parsed == done[0].parsed


# ------------------------------------------------------------------------------------------- tools


def test_tool_choice_required(client, server):
    """``tool_choice: "required"``: a call of one of the tools, with arguments valid for it."""
    r = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        max_tokens=N_JSON, temperature=0,
    )
    assert_tool_call_reply(r.choices[0], {"get_weather", "get_time"})


def test_tool_choice_named(client, server):
    """A named function: that one is called, even when the question fits the other tool better."""
    r = client.chat.completions.create(
        model=server.model_id, messages=user("What time is it in Tokyo?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=N_JSON, temperature=1, seed=3,
    )
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert_tool_call_reply(r.choices[0], {"get_weather"})


def test_tool_choice_auto(client, server):
    """``auto``: either a valid call (finish ``tool_calls``) or a plain answer with no calls."""
    r = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="auto",
        max_tokens=N_JSON, temperature=0,
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert_tool_call_reply(choice, {"get_weather", "get_time"})
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content, choice


def test_tool_choice_none_with_tools(client, server):
    """``none`` with tools given: plain text, no calls."""
    r = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
        max_tokens=16, temperature=0,
    )
    choice = r.choices[0]
    assert not choice.message.tool_calls and choice.message.content, choice
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("parallel", [False, openai.omit])
def test_one_call_unless_parallel_is_asked_for(client, server, parallel):
    """``parallel_tool_calls`` false (what LangChain's structured output sends) or left out (the
    generic format's default, as llama.cpp's): exactly one call."""
    r = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=parallel, max_tokens=N_JSON, temperature=1, seed=11,
    )
    assert len(assert_tool_call_reply(r.choices[0], {"get_weather", "get_time"})) == 1


def test_parse_with_a_pydantic_function_tool(client, server):
    """``pydantic_function_tool`` + ``parse()``: the call's ``parsed_arguments`` is the model."""
    r = client.chat.completions.parse(
        model=server.model_id, messages=ASK_WEATHER, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", max_tokens=N_JSON, temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "GetWeather", r
    assert isinstance(calls[0].function.parsed_arguments, GetWeather)


def test_streamed_tool_call_reassembled_from_deltas(client, server):
    """Streamed: the call's id, type and name arrive first, its arguments in pieces by index;
    reassembled they are valid, and the finish reason is ``tool_calls``."""
    stream = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        max_tokens=N_JSON, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    calls: dict[int, dict] = {}
    finish, usage = None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls, (finish, calls)
    assert sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    assert usage is not None and usage.completion_tokens > 0


def test_stream_helper_with_a_tool_call(client, server):
    """The ``.stream()`` helper on a tool call: argument deltas, then a ``done`` event whose
    ``parsed_arguments`` is the Pydantic model, and the same call in the final completion."""
    with client.chat.completions.stream(
        model=server.model_id, messages=ASK_WEATHER, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=N_JSON, temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    types = [e.type for e in events]
    assert "tool_calls.function.arguments.delta" in types, types
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].name == "GetWeather", done
    assert isinstance(done[0].parsed_arguments, GetWeather)
    call = final.choices[0].message.tool_calls[0]
    assert call.function.parsed_arguments == done[0].parsed_arguments


def test_async_stream_helper_with_a_tool_call(server):
    """The async ``.stream()`` helper: the same events, the same final call."""
    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                      max_retries=0) as c:
            async with c.chat.completions.stream(
                model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                max_tokens=N_JSON, temperature=0,
            ) as stream:
                events = [e async for e in stream]
                return events, await stream.get_final_completion()

    events, final = asyncio.run(main())
    assert any(e.type == "tool_calls.function.arguments.done" for e in events)
    assert_tool_call_reply(final.choices[0], {"get_weather", "get_time"})


def test_tool_result_carried_back_in_a_second_turn(client, server):
    """The agent loop: the assistant's ``tool_calls`` message (content null, as the SDK returns
    it) and a ``tool`` message answering it go back; the server renders both into the prompt
    (longer than the same request without them) and answers in text."""
    first = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
        max_tokens=N_JSON, temperature=0,
    )
    assert_tool_call_reply(first.choices[0], {"get_weather", "get_time"})
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    assistant.setdefault("content", None)
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 21})}
               for c in first.choices[0].message.tool_calls]
    second = client.chat.completions.create(
        model=server.model_id, messages=[*ASK_WEATHER, assistant, *results], tools=TOOLS,
        tool_choice="none", max_tokens=16, temperature=0,
    )
    choice = second.choices[0]
    assert choice.message.content and not choice.message.tool_calls, choice
    baseline = client.chat.completions.create(
        model=server.model_id, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=1,
    )
    # the call's arguments and the result's JSON are in the prompt: well over a dozen tokens
    assert second.usage.prompt_tokens > baseline.usage.prompt_tokens + 12, (baseline.usage, second.usage)


# --------------------------------------------------------------------------------- /v1/responses


def test_responses_text(client, server):
    """``responses.create``: a completed (or length-cut) response with its ``output_text``."""
    r = client.responses.create(model=server.model_id, input="Say hello.", max_output_tokens=16,
                                temperature=0)
    assert r.output_text and r.status in ("completed", "incomplete"), r
    assert r.usage is not None and r.usage.output_tokens > 0


def test_responses_stream_helper(client, server):
    """``responses.stream``: created, text deltas, completed; the final response's text is the
    deltas joined."""
    # Room to finish: the SDK's helper wants ``response.completed`` (a cut reply ends incomplete).
    with client.responses.stream(model=server.model_id, input="Say hello.", max_output_tokens=64,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[0] == "response.created" and "response.output_text.delta" in types, types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text


def test_responses_function_call(client, server):
    """A function tool with ``tool_choice: "required"``: a ``function_call`` output item with a
    call id and arguments valid for the tool's schema."""
    r = client.responses.create(
        model=server.model_id, input="What is the weather like in Paris?", max_output_tokens=N_JSON,
        temperature=0, tool_choice="required",
        tools=[{"type": "function", "name": "get_weather", "description": "Get the weather",
                "parameters": WEATHER_PARAMS, "strict": True}],
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id, r.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
