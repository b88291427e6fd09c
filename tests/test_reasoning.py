"""The reasoning parser (``colibri/api/reasoning.py``) on chosen text, and a thinking model's answer in
each endpoint's shapes with a scripted engine (``test_api_generation``'s): which tokens the engine
streams is chosen here, so every split of the tags is certain. The real engine and server, with a
real model under thinking templates: tests/test_serve_reasoning.py."""

from __future__ import annotations

import json
from itertools import combinations

import pytest
from test_api_generation import ScriptedEngine, done, state_for, token

from colibri.api.openai_requests import parse_chat
from colibri.api.reasoning import ReasoningSplit, opens_reasoning, split_reply, template_thinks
from colibri.api.responses_api import parse as parse_responses
from colibri.api.serving import admit, answer_json, answer_sse

USER = [{"role": "user", "content": "x"}]
QWEN_REPLY = "<think>\nThe user says x.\nI answer y.\n</think>\n\ny, as asked <think> stays"


def streamed(pieces: list[str], inside: bool) -> tuple[str, str, bool, int]:
    """(reasoning, answer, opened, reasoning tokens) of ``pieces`` fed one token each."""
    split, reasoning, answer = ReasoningSplit(inside), "", ""
    for piece in pieces:
        r, c = split.feed(piece, 1)
        reasoning, answer = reasoning + r, answer + c
    r, c = split.flush()
    return reasoning + r, answer + c, split.opened, split.reasoning_tokens


# ------------------------------------------------------------------------------ the parser


@pytest.mark.parametrize(("text", "inside", "reasoning", "answer"), [
    # Qwen3, thinking: the block opens the reply
    (QWEN_REPLY, False, "The user says x.\nI answer y.", "y, as asked <think> stays"),
    # R1: the prompt ends with "<think>\n", the reply starts inside the block
    ("Okay, x.\n</think>\n\nThe answer.", True, "Okay, x.", "The answer."),
    # a model that writes the open tag again after the prompt's
    ("<think>\nOkay.\n</think>\nDone", True, "Okay.", "Done"),
    # cut by max_tokens before </think>: all reasoning, no answer
    ("Okay, let me", True, "Okay, let me", ""),
    ("<think>\nOkay, let me\n", False, "Okay, let me", ""),
    # Qwen3 with enable_thinking false (the prompt holds the empty block): the reply is the answer
    ("\nThe answer.", False, None, "\nThe answer."),
    # a <think> that does not open the reply is text; so is a second </think>
    ("Sure: <think>x</think> is markup", False, None, "Sure: <think>x</think> is markup"),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    # an empty block
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("", True, "", ""),
    ("", False, None, ""),
])
def test_split_reply(text, inside, reasoning, answer):
    assert split_reply(text, inside) == (reasoning, answer)


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("text", [QWEN_REPLY, "Okay.\n</think>\n\nAnswer.", " <thinking> is not it",
                                  "<think>cut at </thi", "  \n<thi"])
def test_every_cut_into_three_pieces_splits_as_the_whole(text, inside):
    """However the tokenizer cuts the text (``</think>`` across tokens, whitespace held back before
    it), the streamed split is the whole one."""
    whole = split_reply(text, inside)
    for i, j in combinations(range(len(text) + 1), 2):
        reasoning, answer, opened, _ = streamed([text[:i], text[i:j], text[j:]], inside)
        assert ((reasoning if opened else None), answer) == whole, (text[:i], text[i:j], text[j:])


def test_close_tag_split_across_tokens_is_held_not_sent():
    """``</`` + ``think`` + ``>``: nothing of the tag reaches either side while it is arriving."""
    split = ReasoningSplit(inside=True)
    assert split.feed("I am done.", 1) == ("I am done.", "")
    assert split.feed("\n</", 1) == ("", "")
    assert split.feed("think", 1) == ("", "")
    assert split.feed(">", 1) == ("", "")
    assert split.feed("\n\n", 1) == ("", "")
    assert split.feed("Yes", 1) == ("", "Yes")
    assert split.flush() == ("", "")
    assert split.reasoning_tokens == 4  # up to the token that closed the block


def test_a_partial_tag_that_does_not_close_is_reasoning():
    split = ReasoningSplit(inside=True)
    assert split.feed("a </th", 1) == ("a", "")
    assert split.feed("ere", 1) == (" </there", "")


def test_reasoning_tokens_count_the_open_tag_at_the_start():
    assert streamed(["<", "think", ">", "\n", "Hm", "</think>", "\n\n", "A", "B"], False)[3] == 6
    assert streamed(["Hello", " there"], False)[3] == 0  # no block: none


@pytest.mark.parametrize(("tail", "opens"), [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<｜Assistant｜><think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking false
    ("<｜Assistant｜><think>\n</think>", False),
    ("<|im_start|>assistant\n", False),
])
def test_opens_reasoning(tail, opens):
    assert opens_reasoning(tail) is opens


def test_template_thinks():
    assert template_thinks("{{ '<|im_start|>assistant\\n<think>\\n' }}")
    assert not template_thinks("{{ '<|im_start|>assistant\\n' }}")


# ------------------------------------------------------------------------------ the shapes


def tokens(*texts: str) -> list:
    return [event for text in texts for event in token(text)]


R1_TOKENS = tokens("Let", " me", " see", ".\n</", "think", ">\n\n", "It", " is", " y", ".")


def thinking_chat(body: dict, inside: bool = True):
    """A chat request to a thinking template; ``inside``: its prompt ends in an open block."""
    prompt = "<|im_start|>assistant\n<think>\n" if inside else "<|im_start|>assistant\n"
    return parse_chat({"messages": USER, **body}, lambda m, t, *a, **k: prompt, 64, 2, template_thinks=True)


def sse_json(frames: list[bytes]) -> list[dict]:
    return [json.loads(f[6:]) for f in frames if f.startswith(b"data: {")]


async def test_chat_whole_answer_has_reasoning_content_and_usage_details():
    state = state_for(ScriptedEngine([*R1_TOKENS, done(10, length_limited=False)]))
    gen = thinking_chat({})
    assert gen.reasoning and gen.reasoning_open
    body = await answer_json(state, gen, await admit(state, gen))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me see."
    assert message["content"] == "It is y."
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}


async def test_chat_stream_sends_reasoning_deltas_then_content_deltas():
    state = state_for(ScriptedEngine([*R1_TOKENS, done(10, length_limited=False)]))
    gen = thinking_chat({"stream": True})
    chunks = sse_json([f async for f in answer_sse(state, gen, await admit(state, gen))])
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("Let me see.", "It is y.")
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    # a delta of reasoning alone has no content key (clients concatenate content strings)
    assert all("content" not in d for d in deltas if d.get("reasoning_content") and d is not deltas[0])


async def test_a_reply_cut_inside_its_reasoning_is_all_reasoning():
    state = state_for(ScriptedEngine([*tokens("Let", " me", " think"), done(3)]))
    gen = thinking_chat({})
    body = await answer_json(state, gen, await admit(state, gen))
    message, choice = body["choices"][0]["message"], body["choices"][0]
    assert (message["reasoning_content"], message["content"]) == ("Let me think", "")
    assert choice["finish_reason"] == "length"


async def test_a_model_without_a_thinking_template_is_unchanged():
    """SmolLM2's template has no ``<think>``: the text is the content, ``<think>`` and all; no
    ``reasoning_content`` key, no ``completion_tokens_details``."""
    state = state_for(ScriptedEngine([*tokens("<think>", "a", "</think>", "b"), done(4, False)]))
    gen = parse_chat({"messages": USER}, lambda m, t: "p", 64, 2, template_thinks=False)
    body = await answer_json(state, gen, await admit(state, gen))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<think>a</think>b",
                                             "refusal": None}
    assert "completion_tokens_details" not in body["usage"]


async def test_stop_strings_apply_to_the_whole_reply_then_it_is_split():
    state = state_for(ScriptedEngine([*R1_TOKENS, done(10, length_limited=False)]))
    gen = thinking_chat({"stop": [" is"]})
    body = await answer_json(state, gen, await admit(state, gen))
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "It")


async def test_template_tool_calls_after_reasoning_are_parsed_from_the_answer():
    """A Qwen3 reply: reasoning, then a Hermes call; the tool-call parser sees the answer only, and
    a call written inside the reasoning is not a call."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events = tokens("<think>\nMaybe ", '<tool_call>\n{"name": "x"}\n</tool_call>', "\n</think>\n\n", call)
    state = state_for(ScriptedEngine([*events, done(4, length_limited=False)]))
    gen = parse_chat({"messages": USER, "tools": [weather], "stream": True},
                     lambda m, t, *a, **k: "<|im_start|>assistant\n", 64, 2,
                     template_tools=True, template_thinks=True)
    chunks = sse_json([f async for f in answer_sse(state, gen, await admit(state, gen))])
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas).startswith("Maybe <tool_call>")
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_grammar_leaves_no_room_for_reasoning():
    """Structured output (and the generic tool envelope) hold the whole reply: it is the answer."""
    gen = thinking_chat({"response_format": {"type": "json_object"}})
    assert gen.grammar is not None and not gen.reasoning


def responses_request(body: dict, inside: bool = True):
    prompt = "<|im_start|>assistant\n<think>\n" if inside else "<|im_start|>assistant\n"
    request = parse_responses({"input": "x", **body}, lambda m, t, *a, **k: prompt, 64, 2)
    request.gen.reasoning, request.gen.reasoning_open = True, inside  # a thinking template's
    return request


async def test_responses_output_has_the_reasoning_item_before_the_message():
    state = state_for(ScriptedEngine([*R1_TOKENS, done(10, length_limited=False)]))
    request = responses_request({})
    body = await answer_json(state, request, await admit(state, request.gen))
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "message"]
    reasoning = body["output"][0]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert reasoning["summary"] == [] and reasoning["id"].startswith("rs_")
    assert body["output"][1]["content"][0]["text"] == "It is y."
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 6}


async def test_responses_stream_events_for_reasoning_then_text():
    state = state_for(ScriptedEngine([*R1_TOKENS, done(10, length_limited=False)]))
    request = responses_request({"stream": True})
    frames = [f async for f in answer_sse(state, request, await admit(state, request.gen))]
    events = [json.loads(f.split(b"data: ", 1)[1]) for f in frames]
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[2]["output_index"] == 0
    r_done = kinds.index("response.reasoning_text.done")
    assert kinds[r_done:r_done + 4] == ["response.reasoning_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.output_item.added"]
    assert events[r_done]["text"] == "Let me see."
    assert events[r_done + 3]["item"]["type"] == "message" and events[r_done + 3]["output_index"] == 1
    def joined(kind: str) -> str:
        return "".join(e["delta"] for e in events if e["type"] == kind)

    assert joined("response.reasoning_text.delta") == "Let me see."
    assert joined("response.output_text.delta") == "It is y."
    assert all(e["output_index"] == 1 for e in events if e["type"] == "response.output_text.delta")
    assert kinds[-1] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


async def test_responses_cut_inside_reasoning_is_an_incomplete_reasoning_item_alone():
    state = state_for(ScriptedEngine([*tokens("Let", " me"), done(2)]))
    request = responses_request({"stream": True})
    frames = [f async for f in answer_sse(state, request, await admit(state, request.gen))]
    last = json.loads(frames[-1].split(b"data: ", 1)[1])
    assert last["type"] == "response.incomplete"
    assert [(i["type"], i["status"]) for i in last["response"]["output"]] == [("reasoning", "incomplete")]


def test_responses_accepts_reasoning_items_replayed_as_input():
    """``input += response.output``: the reasoning item is left out of the prompt (as templates drop
    past reasoning); the message and the next turn are kept."""
    seen = []
    request = parse_responses({"input": [
        {"role": "user", "content": "x"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "y"}]},
        {"role": "user", "content": "z"},
    ]}, lambda m, t, *a, **k: seen.append(m) or "p", 64, 2)
    assert [(m["role"], m["content"]) for m in request.gen.messages] == [
        ("user", "x"), ("assistant", "y"), ("user", "z")]
