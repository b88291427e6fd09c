"""LangChain's ``ChatOpenAI``, unchanged, against ``coli serve``.

``invoke`` and ``stream`` (with the usage LangChain asks for), ``bind_tools`` with a forced and a
named ``tool_choice`` (plain and streamed, the tool-call chunks merged by LangChain), and every
``with_structured_output`` method: ``json_schema`` (strict ``response_format``), ``function_calling``
(a forced tool with ``parallel_tool_calls: false``) and ``json_mode`` (``json_object``). One real
server, shared.
"""

from __future__ import annotations

from typing import Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

N = 8
N_JSON = 120


class Person(BaseModel):
    """A person: a name and an age."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Get the current time in a timezone."""

    timezone: str = Field(max_length=32)


def chat(server, **kw) -> ChatOpenAI:
    """``ChatOpenAI`` as a user points it at an OpenAI-compatible server; no retries."""
    kw = {"temperature": 0, "max_tokens": N_JSON, **kw}
    return ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=server.model_id,
                      max_retries=0, timeout=120, **kw)


def test_invoke(server):
    """``invoke``: an ``AIMessage`` with text, LangChain's usage metadata and the finish reason."""
    message = chat(server, max_tokens=N).invoke("Hi")
    assert isinstance(message, AIMessage) and isinstance(message.content, str) and message.content
    assert message.usage_metadata["output_tokens"] == N
    assert message.usage_metadata["input_tokens"] > 0
    assert message.response_metadata["finish_reason"] == "length"


def test_stream_with_usage(server):
    """``stream``: several chunks that merge into the whole reply, with the usage LangChain asks
    for (``stream_usage``: the usage chunk must be the last) and the finish reason."""
    chunks = list(chat(server, max_tokens=N, stream_usage=True).stream("Hi"))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.content and merged.content == "".join(c.content for c in chunks)
    assert merged.usage_metadata is not None and merged.usage_metadata["output_tokens"] == N
    assert merged.response_metadata.get("finish_reason") == "length"


def assert_weather_call(message: AIMessage) -> dict:
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    assert len(message.tool_calls) >= 1, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"], call
    jsonschema.validate(call["args"], GetWeather.model_json_schema())
    return call


@pytest.mark.parametrize("tool_choice", ["any", "GetWeather"])
def test_bind_tools_forced(server, tool_choice):
    """``bind_tools`` with ``tool_choice`` "any" (OpenAI's "required") or a tool's name: a tool
    call LangChain parses, with arguments valid for the tool."""
    llm = chat(server).bind_tools([GetWeather, GetTime], tool_choice=tool_choice,
                                  parallel_tool_calls=False)
    message = llm.invoke("What is the weather like in Paris?")
    if tool_choice == "GetWeather":
        assert_weather_call(message)
    else:
        assert len(message.tool_calls) == 1 and not message.invalid_tool_calls, message
        call = message.tool_calls[0]
        schema = {"GetWeather": GetWeather, "GetTime": GetTime}[call["name"]].model_json_schema()
        jsonschema.validate(call["args"], schema)
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_bind_tools_streamed(server):
    """Streamed: LangChain merges the tool-call chunks by index into one valid call."""
    llm = chat(server).bind_tools([GetWeather], tool_choice="GetWeather")
    chunks = list(llm.stream("What is the weather like in Rome?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.tool_call_chunks, merged
    assert_weather_call(merged)


def test_bind_tools_round_trip(server):
    """The agent loop: the ``AIMessage`` with its tool call and a ``ToolMessage`` go back; the
    model answers in text (``tool_choice`` "none")."""
    llm = chat(server)
    question = HumanMessage("What is the weather like in Paris?")
    first = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke([question])
    call = assert_weather_call(first)
    answer = ToolMessage(content='{"temperature_c": 21}', tool_call_id=call["id"])
    second = llm.bind_tools([GetWeather], tool_choice="none").invoke([question, first, answer],
                                                                      max_tokens=N)
    assert isinstance(second.content, str) and second.content and not second.tool_calls, second


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_pydantic(server, method):
    """``with_structured_output(Person, method=...)``: a validated ``Person`` instance, and the raw
    message beside it with no parsing error."""
    structured = chat(server).with_structured_output(Person, method=method, include_raw=True)
    out = structured.invoke("Invent a person: a name and an age.")
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], Person), out
    assert isinstance(out["raw"], AIMessage)


def test_with_structured_output_json_schema_strict_dict(server):
    """``json_schema`` with a dict schema and ``strict=True``: a dict valid for the schema."""
    schema = {
        "title": "marble", "description": "A marble", "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["colour", "count"], "additionalProperties": False,
    }
    out = chat(server, temperature=1).with_structured_output(schema, method="json_schema", strict=True) \
        .invoke("Describe a marble.")
    jsonschema.validate(out, schema)


def test_with_structured_output_json_mode(server):
    """``json_mode`` (``response_format: json_object``, no schema travels): the reply parses as a
    JSON object, which LangChain returns as a dict."""
    structured = chat(server).with_structured_output(method="json_mode", include_raw=True)
    out = structured.invoke("Reply in JSON: an object with the keys name and age for Ann, aged 30.")
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], dict), out
    assert out["raw"].response_metadata["finish_reason"] == "stop"


def test_with_structured_output_json_mode_pydantic(server):
    """``json_mode`` with a Pydantic schema: LangChain's docs have the prompt describe the keys
    (no schema travels); the JSON object that comes back validates as a ``Person``."""
    structured = chat(server).with_structured_output(Person, method="json_mode")
    out = structured.invoke('Reply with a JSON object with exactly two keys: "name" (a string) '
                            'and "age" (an integer). Invent a person.')
    assert isinstance(out, Person), out
