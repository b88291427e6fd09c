"""The real Gemma 3 270M file behind ``coli serve`` (the engine process behind the HTTP server), read
by the official openai SDK: its template (no system role), streaming, several turns, a prompt
past the 512-token sliding window."""

from __future__ import annotations

import pytest
from gemma_harness import gemma3_path
from serve_harness import running_server

from colibri.model.generate import SingleSequence
from colibri.model.sampling import Sampler, SamplingParams
from colibri.model.text import ModelText

SYSTEM = "You are a terse assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def gemma_server():
    with running_server("--model", str(gemma3_path()), "--ctx", "2048", "--kv-slots", "2") as server:
        yield server


@pytest.fixture(scope="module")
def client(gemma_server):
    with gemma_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def text():
    return ModelText.open(gemma3_path())


def _ask(client, model: str, messages: list[dict], **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, **kw)


def test_a_system_prompt_joins_the_first_turn(client, gemma_server, text):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the sea?"}]
    reply = _ask(client, gemma_server.model_id, messages)
    assert reply.choices[0].message.content.strip()
    # the prompt the server counted is the template's, the system text inside the user's turn
    assert reply.usage.prompt_tokens == len(text.encode_chat(messages))


def test_streamed_reply_is_the_plain_one(client, gemma_server):
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = _ask(client, gemma_server.model_id, messages).choices[0].message.content
    stream = _ask(client, gemma_server.model_id, messages, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == plain
    assert plain


def test_several_turns(client, gemma_server, text):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi, I am Ada."}]
    first = _ask(client, gemma_server.model_id, messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What is my name?"}]
    second = _ask(client, gemma_server.model_id, messages)
    assert second.choices[0].message.content.strip()
    assert second.usage.prompt_tokens == len(text.encode_chat(messages)) > first.usage.prompt_tokens
    assert text.render(messages).count("<start_of_turn>model\n") == 2  # the reply, then the new turn


def test_a_prompt_past_the_window_is_the_models_greedy_reply(client, gemma_server, text):
    """A prompt of 600+ tokens (the local layers see the last 512, the global ones all): the
    server's reply is the model's own greedy continuation, computed here in-process."""
    from colibri.model.loader import Model

    facts = " ".join(f"Box {i} holds a {'red' if i % 3 else 'blue'} ball." for i in range(90))
    messages = [{"role": "user", "content": facts + " Which colour is in box 3?"}]
    reply = _ask(client, gemma_server.model_id, messages)
    ids = text.encode_chat(messages)
    assert reply.usage.prompt_tokens == len(ids) > 600
    model = Model(gemma3_path())
    want = list(SingleSequence(model, 2048, 512).generate(ids, Sampler(SamplingParams()), 24,
                                                         model.tokenizer.stop_ids))
    assert want
    assert reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.content == model.tokenizer.decode(want)
