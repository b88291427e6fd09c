"""Thinking models end to end: the real ``coli serve`` (engine process behind the HTTP server) with the
default model's weights under two thinking chat templates, read by the openai SDK and LangChain.

The model files are copies of the default SmolLM2 GGUF whose ``tokenizer.chat_template`` is
replaced (``thinking_copy``, in the test's tmp dir): a Qwen3-style template (``enable_thinking``
false writes an empty ``<think>\\n\\n</think>\\n\\n`` in the generation prompt, else the model opens
the block itself) and an R1-style one (the generation prompt ends with ``<think>\\n``: the reply
starts inside the block). SmolLM2 was never trained to think, so the reasoning block is forced by
the conversation: a system message and two earlier turns whose replies are written
``<think>\\n…\\n</think>\\n\\nanswer``, which it copies under greedy decoding. What that shows is the
server's side (the split, the shapes, the switches), on a real model's real token stream (the tags
arrive cut into several tokens: ``</`` ``think`` ``>``); how a real thinking model writes its
block is the model's. The same forcing makes it call a tool after reasoning (the Qwen3-style
template renders tools and Hermes ``<tool_call>`` markers). The parser's every case, on chosen
text: tests/test_reasoning.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import pytest
from langchain_openai import ChatOpenAI
from serve_harness import running_server

# Qwen3's shape, shortened: its tools and Hermes markers too (a tool call after the reasoning).
QWEN3_STYLE = (
    "{%- if tools %}<|im_start|>system\nYou may call tools.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Return each call within <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
R1_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SYSTEM = "Answer in the format: reasoning, then </think>, then the answer."
SHOTS = [("What is 2+2?", "The user asks 2+2. That is 4.", "4"),
         ("What is 3+3?", "The user asks 3+3. That is 6.", "6")]
QUESTION = "What is 5+5?"
MAX_TOKENS = 40


def few_shot() -> list[dict]:
    """The conversation that makes the model write a block: earlier replies written as the model
    is to write its own (under the R1-style template too, whose generation prompt opens the block
    of the reply to come)."""
    turns = [{"role": "system", "content": SYSTEM}]
    for q, reasoning, answer in SHOTS:
        turns += [{"role": "user", "content": q},
                  {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}]
    return [*turns, {"role": "user", "content": QUESTION}]


def thinking_copy(source: Path, template: str, out: Path) -> Path:
    """``source`` with its ``tokenizer.chat_template`` replaced: the KV rewritten in place, the
    tensor infos kept, the data section re-aligned (its offsets are relative to its start)."""
    reader = gguf.GGUFReader(source)
    field = reader.fields["tokenizer.chat_template"]
    start, end = field.offset, field.offset + sum(p.nbytes for p in field.parts)
    infos_end = max(t.field.offset + sum(p.nbytes for p in t.field.parts) for t in reader.tensors)
    raw = source.read_bytes()
    key, value = b"tokenizer.chat_template", template.encode()
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", gguf.GGUFValueType.STRING, len(value)) + value
    head = raw[:start] + kv + raw[end:infos_end]
    head += b"\0" * (-len(head) % reader.alignment)
    out.write_bytes(head + raw[reader.data_offset:])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("thinking")
    return {name: thinking_copy(model_path, template, folder / f"smollm2-{name}.gguf")
            for name, template in (("qwen3", QWEN3_STYLE), ("r1", R1_STYLE))}


@pytest.fixture(scope="module")
def qwen3(models):
    with running_server("--model", str(models["qwen3"]), "--ctx", "1024") as server:
        yield server


@pytest.fixture(scope="module")
def r1(models):
    with running_server("--model", str(models["r1"]), "--ctx", "1024") as server:
        yield server


def ask(server, client=None, **kw):
    """The few-shot question through the openai SDK, greedy."""
    if client is None:
        with server.client() as client:
            return ask(server, client, **kw)
    return client.chat.completions.create(model=server.model_id, messages=few_shot(),
                                          temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def assert_split(reasoning: str | None, content: str | None) -> None:
    """A reasoning block and an answer, neither holding the tags nor the other's text."""
    assert reasoning and content, (reasoning, content)
    for tag in ("<think>", "</think>"):
        assert tag not in reasoning and tag not in content, (reasoning, content)
    assert reasoning == reasoning.strip() and content == content.lstrip()
    assert "10" in content  # the model's answer, copied from the pattern


def streamed(server, **kw) -> tuple[str, str, int]:
    """The SDK's stream: (reasoning, content, chunks that carried reasoning)."""
    reasoning, content, n = "", "", 0
    with server.client() as client:
        chunks = list(ask(server, client, stream=True, **kw))
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)  # an extra field the SDK keeps
        if piece:
            reasoning, n = reasoning + piece, n + 1
        content += delta.content or ""
    return reasoning, content, n


# ---------------------------------------------------------------- Qwen3-style: the model opens it


def test_qwen3_style_openai_sdk_plain_reply_is_split(qwen3):
    reply = ask(qwen3)
    message = reply.choices[0].message
    assert_split(message.reasoning_content, message.content)
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0


def test_qwen3_style_openai_sdk_stream_is_split_as_the_plain_reply(qwen3):
    message = ask(qwen3).choices[0].message
    reasoning, content, chunks = streamed(qwen3)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert chunks > 3  # token by token, not held to the end


def test_qwen3_style_enable_thinking_false_in_chat_template_kwargs(qwen3):
    """How Qwen3 users turn thinking off: the template writes the empty block itself, the model
    answers at once, and the reply has no reasoning."""
    message = ask(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                  ).choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content and "</think>" not in message.content


def test_qwen3_style_a_bad_chat_template_kwargs_is_a_400(qwen3):
    with qwen3.client() as client, pytest.raises(Exception) as e:
        client.chat.completions.create(model=qwen3.model_id, messages=few_shot(), max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.status_code == 400 and e.value.body["param"] == "chat_template_kwargs"


def test_qwen3_style_responses_api_reasoning_item_then_message(qwen3):
    message = ask(qwen3).choices[0].message
    with qwen3.client() as client:
        response = client.responses.create(model=qwen3.model_id, input=few_shot()[1:],
                                           instructions=SYSTEM, temperature=0, max_output_tokens=MAX_TOKENS)
        with client.responses.stream(model=qwen3.model_id, input=few_shot()[1:], instructions=SYSTEM,
                                     temperature=0, max_output_tokens=MAX_TOKENS) as stream:
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
            final = stream.get_final_response()
    for r in (response, final):
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == message.reasoning_content
        assert r.output_text == message.content
        assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert "".join(deltas) == message.reasoning_content and len(deltas) > 3


def langchain(server, **kw) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=server.model_id,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120, **kw)


def test_qwen3_style_langchain_chat_completions_reads_the_answer_alone(qwen3):
    """``ChatOpenAI`` keeps only OpenAI's own fields: ``reasoning_content`` is dropped (its docs
    say so: a provider's package reads it), so ``content`` is the answer, without the block, plain
    and streamed; the reasoning's token count reaches ``usage_metadata``."""
    message = ask(qwen3).choices[0].message
    reply = langchain(qwen3).invoke(few_shot())
    assert reply.content == message.content
    assert "reasoning_content" not in reply.additional_kwargs
    assert reply.usage_metadata["output_token_details"]["reasoning"] > 0
    chunks = list(langchain(qwen3).stream(few_shot()))
    assert "".join(c.content for c in chunks) == message.content


def test_qwen3_style_langchain_responses_api_reads_the_reasoning(qwen3):
    """``ChatOpenAI(use_responses_api=True)``: the reasoning item becomes a ``reasoning`` content
    block holding its text, before the answer's text block."""
    message = ask(qwen3).choices[0].message
    reply = langchain(qwen3, use_responses_api=True).invoke(few_shot())
    blocks = [b for b in reply.content if isinstance(b, dict)]
    assert [b["type"] for b in blocks] == ["reasoning", "text"], blocks
    assert blocks[0]["content"] == [{"type": "reasoning_text", "text": message.reasoning_content}]
    assert blocks[1]["text"] == message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_shots() -> list[dict]:
    """Three earlier turns that reason, then call the tool, then answer from its result (with two,
    the model repeats its reasoning instead of calling)."""
    turns: list[dict] = []
    for n, (city, sky) in enumerate((("Paris", "sunny"), ("Oslo", "rainy"), ("Lima", "cloudy"))):
        call = {"id": f"call_{n}", "type": "function",
                "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        turns += [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "tool_calls": [call],
             "content": "<think>\nThe user wants the weather. I call the tool.\n</think>\n\n"},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": sky},
            {"role": "assistant", "content": f"<think>\nThe tool says {sky}.\n</think>\n\nIt is {sky}."},
        ]
    return [*turns, {"role": "user", "content": "Weather in Rome?"}]


def test_qwen3_style_tool_call_after_reasoning(qwen3):
    """The template's own tools (``auto``: free output, the markers parsed back): the reasoning
    goes to ``reasoning_content``, the ``<tool_call>`` after it becomes ``tool_calls``, plain and
    streamed (the SDK's chunks, the calls in one delta at the end)."""
    request = {"model": qwen3.model_id, "messages": tool_shots(), "tools": [WEATHER], "temperature": 0,
               "max_tokens": 60}
    with qwen3.client() as client:
        reply = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    assert message.reasoning_content and "<tool_call>" not in message.reasoning_content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Rome"})]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]


# ---------------------------------------------------------------- R1-style: the prompt opens it


def test_r1_style_reply_starts_inside_the_block(r1):
    message = ask(r1).choices[0].message
    assert_split(message.reasoning_content, message.content)
    reasoning, content, chunks = streamed(r1)
    assert (reasoning, content) == (message.reasoning_content, message.content) and chunks > 3


def test_r1_style_reply_cut_before_its_answer_is_all_reasoning(r1):
    reply = ask(r1, max_tokens=4)
    message = reply.choices[0].message
    assert message.reasoning_content and message.content == ""
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4
