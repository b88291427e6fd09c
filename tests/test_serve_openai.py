"""End-to-end tests of ``coli serve``'s OpenAI API through the official SDK: chat and legacy
completions, streamed or not, logprobs, stop strings, seeds, and the fields refused with a 400.

A real server process with the real default model, shared by the module; generations are greedy
and short, so the file runs in a few minutes on two cores.
"""

from __future__ import annotations

import json

import openai
import pytest
from serve_harness import (
    read_sse,
    user,
)

CHAT_Q = "Tell me a story about the sea."
CHAT_N = 8  # tokens of the greedy chat reference
LEGACY_N = 10
LEGACY_PROMPT = "Once upon a time"


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def chat_ref(client, server):
    """The greedy answer to CHAT_Q, with logprobs: the reference for several tests."""
    return client.chat.completions.create(
        model=server.model_id, messages=user(CHAT_Q), max_tokens=CHAT_N, temperature=0,
        logprobs=True, top_logprobs=3,
    )


@pytest.fixture(scope="module")
def legacy_ref(client, server):
    return client.completions.create(
        model=server.model_id, prompt=LEGACY_PROMPT, max_tokens=LEGACY_N, temperature=0, logprobs=2
    )


def check_usage(usage, max_tokens: int, finish: str) -> None:
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == max_tokens


# ------------------------------------------------------------------------------------------ chat


def test_chat_completion(chat_ref):
    choice = chat_ref.choices[0]
    assert chat_ref.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"  # a few tokens do not finish a story
    check_usage(chat_ref.usage, CHAT_N, choice.finish_reason)
    stats = chat_ref.to_dict()["colibri"]
    assert stats["stats"]["emitted"] == CHAT_N and stats["stats"]["length_limited"] is True
    assert 0 <= stats["slot"] < 4


def test_chat_stream_equals_json(client, server, chat_ref):
    stream = client.chat.completions.create(
        model=server.model_id, messages=user(CHAT_Q), max_tokens=CHAT_N, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=1,
    )
    chunks = list(stream)
    # Each chunk carries the logprobs of the tokens whose text it carries.
    entries = []
    for c in chunks:
        if not c.choices or not c.choices[0].delta.content:
            continue
        lp = c.choices[0].logprobs
        assert lp is not None and lp.content, c
        assert "".join(e.token for e in lp.content) == c.choices[0].delta.content
        entries += lp.content
    assert [e.token for e in entries] == [e.token for e in chat_ref.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_ref.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0].choices == []
    assert with_usage[0].usage.to_dict() == chat_ref.usage.to_dict()
    # OpenAI's contract: the usage chunk is the last one, and the only one without a choice.
    assert chunks[-1] is with_usage[0]
    assert all(c.choices for c in chunks[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"


def test_raw_sse_ends_with_finish_and_stats_then_done(http):
    body = {"messages": user(CHAT_Q), "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert int(r.headers["x-colibri-queue-wait-ms"]) >= 0
        events = read_sse(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    frames = [json.loads(e) for e in events[:-1]]
    last = frames[-1]  # no include_usage: the finish chunk, carrying colibri's stats
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["colibri"]["stats"]["emitted"] == 4
    assert all(f["choices"] for f in frames)
    assert all("error" not in f for f in frames)


def test_queue_wait_header(client, server):
    raw = client.chat.completions.with_raw_response.create(
        model=server.model_id, messages=user("Hi"), max_tokens=2, temperature=0
    )
    assert int(raw.headers["x-colibri-queue-wait-ms"]) >= 0
    parsed = raw.parse()
    assert parsed.choices[0].message.content is not None
    assert "colibri" in parsed.to_dict()


# ------------------------------------------------------------------------------------------ legacy


def test_completion(legacy_ref):
    choice = legacy_ref.choices[0]
    assert legacy_ref.object == "text_completion"
    assert choice.text and choice.finish_reason == "length"
    check_usage(legacy_ref.usage, LEGACY_N, "length")
    assert "colibri" in legacy_ref.to_dict()


def test_completion_stream(client, server, legacy_ref):
    chunks = list(client.completions.create(
        model=server.model_id, prompt=LEGACY_PROMPT, max_tokens=LEGACY_N, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == legacy_ref.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == LEGACY_N


def test_completion_logprobs(legacy_ref):
    lp = legacy_ref.choices[0].logprobs
    n = legacy_ref.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == legacy_ref.choices[0].text
    for i, (tok, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                strict=True)):
        assert logprob <= 0
        assert len(top) == 2 and all(v <= 0 for v in top.values())
        assert max(top, key=top.get) == tok  # greedy: the chosen token is the most likely
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


# ------------------------------------------------------------------------------------------ logprobs


def test_chat_logprobs(chat_ref):
    content = chat_ref.choices[0].logprobs.content
    assert len(content) == chat_ref.usage.completion_tokens
    assert "".join(e.token for e in content) == chat_ref.choices[0].message.content
    for e in content:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy
        assert e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes) == e.token.encode()


# ------------------------------------------------------------------------------------------ stop


def _stop_inside(tokens: list[str]) -> tuple[str, str]:
    """A 3-character stop string spanning the token boundary mid-output, and the text before it."""
    text = "".join(tokens)
    b = len("".join(tokens[: len(tokens) // 2]))
    assert 1 <= b < len(text) - 2, tokens
    stop = text[b - 1 : b + 2]
    return stop, text[: text.find(stop)]


def test_stop_string_chat(client, server, chat_ref):
    stop, expected = _stop_inside([e.token for e in chat_ref.choices[0].logprobs.content])
    r = client.chat.completions.create(
        model=server.model_id, messages=user(CHAT_Q), max_tokens=CHAT_N, temperature=0, stop=stop
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content


def test_stop_strings_legacy_stream(client, server, legacy_ref):
    stop, expected = _stop_inside(legacy_ref.choices[0].logprobs.tokens)
    stops = ["#never#", stop, "@@nope", "\u00a7\u00a7"]  # four: the most OpenAI allows
    chunks = list(client.completions.create(
        model=server.model_id, prompt=LEGACY_PROMPT, max_tokens=LEGACY_N, temperature=0, stop=stops,
        stream=True,
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]


def test_five_stops_refused(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model_id, messages=user("Hi"), max_tokens=4, stop=["a", "b", "c", "d", "e"]
        )
    assert e.value.body["param"] == "stop" and "stop" in e.value.body["message"]


def test_stop_then_same_slot_at_once(http):
    """A stop ends the request in the engine before its slot is free: the next request on that
    slot must not find it busy."""
    body = {"prompt": LEGACY_PROMPT, "max_tokens": LEGACY_N, "temperature": 0, "cache_slot": 2}
    first = http.post("/v1/completions", json={**body, "stop": [" the"]})
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    again = http.post("/v1/completions", json={**body, "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["colibri"]["slot"] == 2


# ------------------------------------------------------------------------------------------ seed


def test_seed_reproducible(client, server):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=server.model_id, messages=user("Write a poem about anything you like."),
            max_tokens=10, temperature=1.0, seed=seed,
        )
        return r.choices[0].message.content

    first, second = sample(42), sample(42)
    assert first == second
    others = [sample(7)]
    if others[0] == first:  # improbable over 10 tokens at temperature 1; one more seed settles it
        others.append(sample(1234))
    assert any(o != first for o in others)


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", dict(n=2)),
        ("functions", dict(extra_body={"functions": [{"name": "f", "parameters": {}}]})),
        ("tools", dict(tools=[{"type": "function",
                               "function": {"name": "f", "parameters": {"type": "nope"}}}])),
        ("response_format", dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(["}}})),
        ("presence_penalty", dict(presence_penalty=0.5)),
        ("logit_bias", dict(logit_bias={"42": 10})),
        ("frobnicate", dict(extra_body={"frobnicate": 1})),
        ("cache_slot", dict(extra_body={"cache_slot": 99})),
        ("temperature", dict(extra_body={"temperature": "hot"})),
        ("max_tokens", dict(max_tokens=-1)),
        ("stream", dict(extra_body={"stream": "yes"})),
        ("messages[0].content", dict(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}])),
    ],
)
def test_unsupported_or_invalid_field_is_400(client, server, field, kwargs):
    kwargs = {"messages": user("Hi"), "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == field, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert field in json.dumps(e.value.body)


def test_missing_messages_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body={"model": server.model_id}, cast_to=object)
    assert e.value.body["param"] == "messages"


# ------------------------------------------------------------------------------------------ models


def test_models(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids == [server.model_id]
    assert client.models.retrieve(server.model_id).id == server.model_id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
