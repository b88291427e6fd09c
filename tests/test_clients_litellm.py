"""litellm, unchanged, against ``coli serve``.

``litellm.completion`` on the ``openai/`` provider with ``api_base``: a plain reply, a stream, a
structured output and a forced tool call; a prompt over the context, streamed or not, raises
litellm's own ``ContextWindowExceededError`` (it reads OpenAI's wording). litellm is kept off the
network (no machine here reaches it): its cost map is the bundled one and offline mode is on, and
an audit hook records every connection so a test can show that only the server was reached. One
real server with a small context, shared.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys

# Before litellm is imported: the import itself would fetch the model cost map from GitHub.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

CONNECTIONS: list[object] = []  # every socket.connect / getaddrinfo target of this process


def _audit(event: str, args: tuple) -> None:
    if event == "socket.connect":
        CONNECTIONS.append(args[1])
    elif event == "socket.getaddrinfo":
        CONNECTIONS.append((args[0], args[1]))


sys.addaudithook(_audit)

import jsonschema  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402
from serve_harness import user  # noqa: E402

litellm.telemetry = False
# litellm's own use of pydantic warns (``ReadOnly`` TypedDict items, instance ``model_fields``):
# not ours to fix.
pytestmark = [pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning"),
              pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince211")]

CTX = 256
SERVER_ARGS = ("--web-dist", "/nonexistent/web/dist", "--ctx", str(CTX))
N = 6
LONG = "lighthouse " * (2 * CTX)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False},
}}


@pytest.fixture(scope="module")
def kw(server) -> dict:
    """What a litellm user passes for an OpenAI-compatible server."""
    return {"model": f"openai/{server.model_id}", "api_base": server.base_url + "/v1",
            "api_key": "unused", "num_retries": 0, "timeout": 120}


def test_completion(kw):
    """``completion``: litellm's ``ModelResponse`` with the text, the finish reason and the usage."""
    r = litellm.completion(messages=user("Hi"), max_tokens=N, temperature=0, **kw)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens > 0


def test_streaming(kw):
    """``stream=True``: the deltas join into the reply; the last choice says why it ended, and with
    ``include_usage`` litellm hands the usage on."""
    chunks = list(litellm.completion(messages=user("Hi"), max_tokens=N, temperature=0, stream=True,
                                     stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"], finishes
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == N
    rebuilt = litellm.stream_chunk_builder(chunks, messages=user("Hi"))
    assert rebuilt.choices[0].message.content == text


@pytest.mark.parametrize("stream", [False, True])
def test_context_window_exceeded(kw, stream):
    """A prompt over the context: litellm's ``ContextWindowExceededError`` (not a connection
    error, not a retry), carrying OpenAI's wording."""
    with pytest.raises(litellm.exceptions.ContextWindowExceededError) as e:
        r = litellm.completion(messages=user(LONG), max_tokens=N, stream=stream, **kw)
        if stream:
            list(r)
    assert e.value.status_code == 400
    assert f"maximum context length is {CTX} tokens" in str(e.value)


def test_structured_output(kw):
    """``response_format`` json_schema through litellm: the content validates against the schema."""
    r = litellm.completion(
        messages=user("Invent a person."), max_tokens=80, temperature=1, seed=5, **kw,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_forced_tool_call(kw):
    """``tools`` + ``tool_choice: "required"`` through litellm: one call, arguments valid."""
    r = litellm.completion(messages=user("What is the weather in Oslo?"), tools=[WEATHER],
                           tool_choice="required", max_tokens=80, temperature=0, **kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r
    assert calls[0].function.name == "get_weather" and calls[0].id
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_nothing_but_the_server_was_reached():
    """Every connection and name lookup this process made went to the loopback (litellm fetched
    no cost map and sent no telemetry). Runs last in the module."""
    assert CONNECTIONS, "the audit hook saw nothing: it is not installed"
    for target in CONNECTIONS:
        if not isinstance(target, tuple):
            continue  # an AF_UNIX path
        host = target[0]
        if isinstance(host, bytes):
            host = host.decode()
        if host in (None, "localhost"):
            continue
        assert ipaddress.ip_address(host).is_loopback, f"litellm reached {target!r}"
