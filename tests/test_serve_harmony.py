"""gpt-oss's harmony format end to end: the real ``coli serve`` (engine process behind the HTTP server)
on a tiny gpt-oss converted by ``coli convert`` (tests/data/tiny_hf/gpt_oss_harmony, made by
tools/make_tiny_harmony.py: trained to answer its conversations in harmony), read by the openai SDK.

The model writes an ``analysis`` message, then a ``final`` one, or a call through ``commentary
to=functions.get_weather``; the server hands the analysis to ``reasoning_content`` (the Responses
API: a reasoning item), the final message to ``content``, the call to ``tool_calls``, and the
tool's result back through the template for the final answer. ``reasoning_effort`` sets the system
message's reasoning level. The splitter's every case, on chosen text: tests/test_harmony.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import running_server

from colibri.api.openai_requests import parse_chat
from colibri.cli import main
from colibri.model.text import ModelText

SRC = Path(__file__).parent / "data" / "tiny_hf" / "gpt_oss_harmony"
CONVERSATIONS = {c["name"]: c for c in json.loads((SRC / "conversations.json").read_text())["conversations"]}
MAX_TOKENS = 80  # the longest learned reply is ~60 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("harmony") / "gpt_oss_harmony-q8_0.gguf"
    assert main(["convert", str(SRC), "-o", str(out), "--type", "q8_0"]) == 0
    return out


@pytest.fixture(scope="module")
def server(model):
    with running_server("--model", str(model), "--ctx", "512") as server:
        yield server


def learned(name: str) -> tuple[str, str]:
    """(the analysis, the final answer) the model learned for a conversation."""
    reply = CONVERSATIONS[name]["reply"]
    analysis = reply.split("<|channel|>analysis<|message|>")[1].split("<|end|>")[0]
    final = reply.split("<|channel|>final<|message|>")[-1].removesuffix("<|return|>")
    return analysis, final


def ask(server, name: str, client=None, **kw):
    """A learned conversation through the openai SDK, greedy (``client``: open for a stream)."""
    if client is None:
        with server.client() as client:
            return ask(server, name, client, **kw)
    c = CONVERSATIONS[name]
    extra = {"tools": c["tools"]} if c["tools"] else {}
    return client.chat.completions.create(model=server.model_id, messages=sdk_messages(c["messages"]),
                                          temperature=0, max_tokens=MAX_TOKENS, **extra, **kw)


def sdk_messages(messages: list[dict]) -> list[dict]:
    """The conversation as an OpenAI client sends it: a call's arguments as a JSON string."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"],
                                                   "arguments": json.dumps(tc["function"]["arguments"])}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def test_reasoning_content_is_split_from_content(server) -> None:
    reply = ask(server, "greeting")
    analysis, final = learned("greeting")
    message = reply.choices[0].message
    assert message.reasoning_content == analysis and message.content == final
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0


def test_the_stream_is_split_the_same_way(server) -> None:
    reasoning, content = "", ""
    with server.client() as client:
        for chunk in ask(server, "greeting", client, stream=True):
            if chunk.choices:
                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == learned("greeting")
    for markup in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"):
        assert markup not in reasoning + content


def test_a_commentary_call_is_a_tool_call_the_sdk_parses(server) -> None:
    reply = ask(server, "call")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == learned("call")[0]
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


def test_the_tools_result_comes_back_for_the_final_answer(server) -> None:
    message = ask(server, "result").choices[0].message
    assert (message.reasoning_content, message.content) == learned("result")
    assert not message.tool_calls


def test_responses_api_reasoning_item_then_function_call(server) -> None:
    c = CONVERSATIONS["call"]
    tools = [{"type": "function", **t["function"]} for t in c["tools"]]
    with server.client() as client:
        response = client.responses.create(model=server.model_id, input=c["messages"][0]["content"],
                                           tools=tools, temperature=0, max_output_tokens=MAX_TOKENS)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"], kinds
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_sets_the_system_messages_level(model, effort: str) -> None:
    text = ModelText.open(model)
    body = {"messages": [{"role": "user", "content": "Hello!"}], "reasoning_effort": effort}
    gen = parse_chat(body, text.render, 512, 1)
    assert f"Reasoning: {effort}\n" in gen.prompt and gen.harmony and gen.reasoning
    default = parse_chat({"messages": body["messages"]}, text.render, 512, 1)
    assert "Reasoning: medium\n" in default.prompt


def test_coli_chat_shows_the_answer_without_the_markup(model) -> None:
    """``coli chat`` on a harmony model (the legacy protocol: greedy): the ``final`` channel's text;
    the analysis not at all, its output being piped, and no markup."""
    analysis, final = learned("greeting")
    proc = subprocess.run(
        [sys.executable, "-m", "colibri", "chat", "--model", str(model), "--ctx", "512",
         "--max-tokens", str(MAX_TOKENS)],
        input=b"Hello!\n/quit\n", capture_output=True, timeout=300)
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert final in out and analysis not in out and "<|" not in out, out


def test_the_legacy_conversation_keeps_the_answer_alone(model) -> None:
    """The legacy session's history holds a harmony reply's ``final`` text, not its markup: the
    next turn's prompt is the template over [user, assistant answer, user], token for token."""
    first = "Hello!"
    then = CONVERSATIONS["call"]["messages"][0]["content"]
    engine = subprocess.run(
        [sys.executable, "-m", "colibri", "engine", "--no-persist", "--protocol", "legacy", "--model",
         str(model), "--ctx", "512", "--max-tokens", str(MAX_TOKENS)],
        input=f"{first}\n{then}\n".encode(), capture_output=True, timeout=300)
    assert engine.returncode == 0, engine.stderr.decode()
    stats = [line.split() for line in engine.stdout.decode().splitlines() if line.startswith("STAT ")]
    text = ModelText.open(model)
    answer = learned("greeting")[1]
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
               {"role": "user", "content": then}]
    assert int(stats[1][5]) == len(text.encode_chat(history)), stats
