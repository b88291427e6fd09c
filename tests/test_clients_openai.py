"""Real OpenAI clients work unchanged against ``coli serve``.

The quickstart streaming loop (``chunk.choices[0]`` on every chunk) runs to the end, the usage
chunk is the last one before [DONE], the SDK's stream helper keeps its usage, and colibri's stats
ride on the finish and usage chunks; a prompt over the context is refused in OpenAI's words; the
defaults, nulls and metadata that proxies and SDKs send are accepted, and a real unsupported value
is blamed on the field the client needs. One real server (a small context) shared by the module.
"""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
from serve_harness import read_sse, user

CTX = 256
SERVER_ARGS = ("--web-dist", "/nonexistent/web/dist", "--ctx", str(CTX))
Q = "Tell me a story about the sea."
N = 4
LONG = "lighthouse " * (2 * CTX)  # well over the context in any tokenizer
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def usage_option(include_usage: bool) -> dict:
    return {"stream_options": {"include_usage": True}} if include_usage else {}


# ------------------------------------------------------------------------------------------ streams


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_quickstart_loop_runs_to_the_end(client, server, include_usage):
    stream = client.chat.completions.create(
        model=server.model_id, messages=user(Q), max_tokens=N, temperature=0, stream=True,
        **usage_option(include_usage),
    )
    # The README's loop, unguarded; with include_usage, as written for OpenAI, whose usage chunk
    # (and only that one) has no choices.
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.usage is None]
    assert "".join(p or "" for p in pieces)


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_quickstart_loop_runs_to_the_end(client, server, include_usage):
    stream = client.completions.create(
        model=server.model_id, prompt="Once upon a time", max_tokens=N, temperature=0, stream=True,
        **usage_option(include_usage),
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.usage is None)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": user(Q)}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
])
def test_raw_sse_usage_last_and_stats_on_the_finish_chunk(http, path, body, include_usage):
    body = {**body, "max_tokens": N, "temperature": 0, "stream": True, **usage_option(include_usage)}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = read_sse(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    frames = [json.loads(e) for e in events[:-1]]
    finishes = [i for i, f in enumerate(frames) if f["choices"] and f["choices"][0]["finish_reason"]]
    assert len(finishes) == 1
    finish = frames[finishes[0]]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["colibri"]["stats"]["emitted"] == N and "slot" in finish["colibri"]
    if include_usage:
        *rest, last = frames
        assert last is not finish and last["choices"] == []
        assert last["usage"]["completion_tokens"] == N
        assert last["colibri"]["stats"]["emitted"] == N
        assert all(f["usage"] is None for f in rest)
        assert rest[-1] is finish
    else:
        assert frames[-1] is finish
        assert all("usage" not in f for f in frames)
    assert all(f["choices"] for f in frames[: len(frames) - include_usage])  # no other empty chunk


def test_stream_helper_keeps_the_usage(client, server):
    with client.chat.completions.stream(
        model=server.model_id, messages=user(Q), max_tokens=N, temperature=0,
        stream_options={"include_usage": True},
    ) as stream:
        for _ in stream:
            pass
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as e:  # the helper's rule for a reply cut at max_tokens
            final = e.completion
    assert final.usage is not None and final.usage.completion_tokens == N
    assert final.choices[0].message.content and final.choices[0].finish_reason == "length"


def test_stats_reach_the_sdk_on_the_finish_chunk(client, server):
    chunks = list(client.chat.completions.create(
        model=server.model_id, messages=user(Q), max_tokens=N, temperature=0, stream=True,
    ))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].to_dict()["colibri"]["stats"]["emitted"] == N


def test_async_client_quickstart_loop(server):
    async def main() -> tuple[list, object]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=server.model_id, messages=user(Q), max_tokens=N, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            pieces, last = [], None
            async for chunk in stream:
                last = chunk
                if chunk.usage is None:
                    pieces.append(chunk.choices[0].delta.content)
            return pieces, last

    pieces, last = asyncio.run(main())
    assert "".join(p or "" for p in pieces)
    assert last.usage is not None and last.usage.completion_tokens == N


# ------------------------------------------------------------------------------------------ context


CHAT_WORDING = re.compile(
    rf"^This model's maximum context length is {CTX} tokens\. However, your messages resulted in "
    r"(\d+) tokens\. Please reduce the length of the messages\.$"
)
PROMPT_WORDING = re.compile(
    rf"^This model's maximum context length is {CTX} tokens\. However, your prompt resulted in "
    r"(\d+) tokens\. Please reduce the length of the prompt\.$"
)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_prompt_over_the_context(client, server, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model_id, messages=user(LONG), max_tokens=N, stream=stream
        )
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    m = CHAT_WORDING.match(e.value.body["message"])
    assert m and int(m.group(1)) > CTX, e.value.body
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_prompt_over_the_context(http, stream):
    r = http.post("/v1/completions", json={"prompt": LONG, "max_tokens": N, "stream": stream})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    m = PROMPT_WORDING.match(err["message"])
    assert m and int(m.group(1)) > CTX, err


# ------------------------------------------------------------------------------------------ fields


ACCEPTED = [
    ("n", None), ("n", 1),
    ("presence_penalty", None), ("frequency_penalty", None), ("frequency_penalty", 0.0),
    ("response_format", None), ("response_format", {"type": "text"}),
    ("modalities", ["text"]), ("modalities", None),
    ("prediction", None),
    ("logit_bias", {}), ("logit_bias", None),
    ("prompt_cache_key", "conversation-7"), ("safety_identifier", "user-hash"),
    ("verbosity", None), ("verbosity", "medium"),
    ("parallel_tool_calls", True), ("parallel_tool_calls", False), ("parallel_tool_calls", None),
    ("tools", []), ("tools", None), ("tool_choice", "none"), ("tool_choice", None),
    ("functions", None), ("function_call", None),
    ("user", "alice"), ("metadata", {"team": "search"}), ("metadata", None),
    ("store", False), ("store", True), ("service_tier", "auto"), ("service_tier", None),
]


@pytest.mark.parametrize(("name", "value"), ACCEPTED, ids=[f"{n}={json.dumps(v)}" for n, v in ACCEPTED])
def test_chat_default_or_metadata_accepted(http, name, value):
    body = {"messages": user("Hi"), "max_tokens": 1, name: value}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


COMPLETION_ACCEPTED = [
    ("n", None), ("best_of", None), ("echo", None), ("suffix", None), ("logit_bias", {}),
    ("presence_penalty", None), ("user", "alice"), ("metadata", {"k": "v"}),
]


@pytest.mark.parametrize(("name", "value"), COMPLETION_ACCEPTED,
                         ids=[f"{n}={json.dumps(v)}" for n, v in COMPLETION_ACCEPTED])
def test_completion_default_or_metadata_accepted(http, name, value):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, name: value})
    assert r.status_code == 200, r.text


def test_the_langchain_bind_tools_request_is_served(client, server):
    r = client.chat.completions.create(
        model=server.model_id, messages=user("Hi"), max_tokens=1, parallel_tool_calls=False, tools=[TOOL],
    )
    assert len(r.choices) == 1


@pytest.mark.parametrize(("body", "field"), [
    ({"parallel_tool_calls": False, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}], "response_format": {"type": "json_object"}}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"logit_bias": {"42": 1}, "response_format": {"type": "json_object"}}, "logit_bias"),
    ({"verbosity": "high"}, "verbosity"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"n": 2}, "n"),
])
def test_real_values_still_refused_by_the_right_name(http, body, field):
    r = http.post("/v1/chat/completions", json={"messages": user("Hi"), "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
