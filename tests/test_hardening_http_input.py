"""Client input that was a 500 (issue 38, item 7) is a 400 in OpenAI's shape, named.

Unit tests on the parsers (``json_body.parse_json``, ``parse_chat``, ``responses_api.parse``): a
grammar over the engine's limit (``io/mux.py`` MAX_GRAMMAR), a tool call's ``arguments`` past the
body's JSON limits (depth, integer digits, lone surrogates), a lone surrogate in any string of the
body (tool call ids and names, a tool message's name, a tool's description, Responses items and
``metadata``), the caps on messages, input items, tools and tool calls, and a Responses tool's
unknown key; reading a model's tool calls never raises on deep or huge JSON. End to end on a real
``coli serve``: the big enum schema, deep arguments, a surrogate in a tool call's name, and a
streamed Responses request with a surrogate in ``metadata`` are 400s, with no traceback logged.
"""

from __future__ import annotations

import json
import time

import pytest
from serve_harness import error_body

from colibri.api import responses_api
from colibri.api.json_body import MAX_INT_DIGITS, MAX_JSON_DEPTH, parse_json
from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import MAX_MESSAGES, parse_chat
from colibri.api.tools import MAX_TOOL_CALLS, MAX_TOOLS
from colibri.io.mux import MAX_GRAMMAR
from colibri.model.tool_format import ToolSet

N_CTX, N_SLOTS = 1024, 4
CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# An enum of 41,000 values (issue 38's case): a grammar of ~1.6 MB, which llguidance compiles
# (in seconds) but the engine's SUBMIT refuses.
BIG_ENUM = {"type": "object", "properties": {"v": {"enum": [f"value-{i:030d}" for i in range(41_000)]}},
            "required": ["v"]}
DEEP = "[" * 5000 + "]" * 5000
DIGITS = '{"n": 1' + "0" * 4999 + "}"


def render(messages: list, thinking: bool, tools: list | None = None) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def wire(body: dict) -> bytes:
    """``body`` as a client sends it: lone surrogates as ``\\udXXX`` escapes (json's ensure_ascii)."""
    return json.dumps(body).encode()


def chat(body: dict):
    return parse_chat(parse_json(wire(body)), render, N_CTX, N_SLOTS)


def responses(body: dict):
    return responses_api.parse(parse_json(wire(body)), render, N_CTX, N_SLOTS)


def refused(fn, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error", err.message
    assert set(json.loads(err.json_bytes())["error"]) == {"message", "type", "param", "code"}
    return err


def history(call_id: str = "c1", name: str = "f", arguments: str = "{}",
            tool_name: str | None = None) -> list:
    """A user turn, an assistant's tool call, the tool's result."""
    result = {"role": "tool", "tool_call_id": call_id, "content": "ok"}
    if tool_name is not None:
        result["name"] = tool_name
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}, result]


def items(call_id: str = "c1", name: str = "f", arguments: str = "{}") -> list:
    """The same in Responses input items."""
    return [*USER, {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments},
            {"type": "function_call_output", "call_id": call_id, "output": "ok"}]


# ------------------------------------------------------------------------------------ the grammar


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": USER, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": BIG_ENUM}}},
     "response_format"),
    ({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": BIG_ENUM, "strict": True}}], "tool_choice": "required"}, "tools"),
])
def test_a_grammar_over_the_engines_limit_is_a_400_naming_it(body, param):
    err = refused(chat, body)
    assert err.param == param and err.code == "grammar_too_large", err.message
    assert str(MAX_GRAMMAR) in err.message


def test_a_responses_schema_over_the_grammar_limit_names_text_format():
    fmt = {"type": "json_schema", "name": "x", "schema": BIG_ENUM}
    err = refused(responses, {"input": "Hi", "text": {"format": fmt}})
    assert err.param == "text.format" and err.code == "grammar_too_large"


# ------------------------------------------------------------------------------- tool call arguments


AT_LIMITS = ("{\"a\": " + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}",
             '{"n": ' + "9" * MAX_INT_DIGITS + "}", "not json {")


@pytest.mark.parametrize(("arguments", "words"), [(DEEP, "deep"), (DIGITS, "digits")])
@pytest.mark.parametrize("tools", [None, [TOOL]])
def test_chat_arguments_past_the_json_limits_are_a_400(arguments, words, tools):
    offered = {"tools": tools} if tools else {}
    err = refused(chat, {"messages": history(arguments=arguments), **offered})
    assert err.param == "messages[1].tool_calls[0]", err.param
    assert words in err.message and "arguments" in err.message, err.message
    # At the limits they are served; text that is no JSON is kept as the client wrote it.
    for ok in AT_LIMITS:
        assert chat({"messages": history(arguments=ok), **offered}).prompt
    assert "not json {" in chat({"messages": history(arguments="not json {")}).prompt


@pytest.mark.parametrize(("arguments", "words"), [(DEEP, "deep"), (DIGITS, "digits")])
def test_responses_arguments_past_the_json_limits_are_a_400(arguments, words):
    err = refused(responses, {"input": items(arguments=arguments)})
    assert err.param == "input[1].arguments" and words in err.message, (err.param, err.message)
    for ok in AT_LIMITS:
        assert responses({"input": items(arguments=ok)}).gen.prompt


# ----------------------------------------------------------------------------- lone surrogates


@pytest.mark.parametrize(("body", "param", "where"), [
    ({"messages": history(call_id="c\ud800")}, "messages[1].tool_calls", "messages[1].tool_calls[0].id"),
    ({"messages": history(name="f\ud800")}, "messages[1].tool_calls",
     "messages[1].tool_calls[0].function.name"),
    ({"messages": history(arguments='{"a": "\udc00"}')}, "messages[1].tool_calls",
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": history(tool_name="n\udc00")}, "messages[2].name", "messages[2].name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "description": "d\ud800"}}]},
     "tools[0].function", "tools[0].function.description"),
    ({"messages": USER, "metadata": {"k": "v\ud83d"}}, "metadata", "metadata.k"),
    ({"messages": USER, "user": "\udfff"}, "user", "user"),
])
def test_a_lone_surrogate_anywhere_in_a_chat_body_is_a_400(body, param, where):
    err = refused(chat, body)
    assert err.param == param and f"'{where}'" in err.message and "surrogate" in err.message, err.message


def test_a_lone_surrogate_in_a_key_is_a_400_and_pairs_are_text():
    err = refused(chat, {"messages": USER, "metadata": {"k\ud800": "v"}})
    assert err.param == "metadata" and "a key of 'metadata'" in err.message
    # An escaped pair is one character, an escaped backslash before "ud800" is text: both served.
    raw = (b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}], '
           b'"metadata": {"\\ud83d\\ude00": "\\\\udc00"}}')
    body = parse_json(raw)
    assert body["messages"][0]["content"] == "\U0001f600 \\ud800"
    assert body["metadata"] == {"\U0001f600": "\\udc00"}
    assert parse_chat(body, render, N_CTX, N_SLOTS).prompt


def test_a_lone_surrogate_escaped_inside_the_arguments_is_a_400():
    """``\\\\ud800`` in the body is text; parsed again as the arguments, it is a lone surrogate."""
    err = refused(chat, {"messages": history(arguments='{"a": "\\ud800"}')})
    assert err.param == "messages[1].tool_calls[0]" and "surrogate" in err.message
    assert "'messages[1].tool_calls[0].function.arguments.a'" in err.message
    err = refused(responses, {"input": items(arguments='{"a": ["\\udfff"]}')})
    assert err.param == "input[1].arguments" and "'input[1].arguments.a[0]'" in err.message


@pytest.mark.parametrize(("body", "param"), [
    ({"input": items(name="f\ud800")}, "input[1].name"),
    ({"input": items(call_id="\ud800")}, "input[1].call_id"),
    ({"input": "Hi", "metadata": {"k": "v\ud800"}, "stream": True}, "metadata"),
    ({"input": "Hi", "instructions": "\udc00"}, "instructions"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "description": "\ud800"}]},
     "tools[0].description"),
])
def test_a_lone_surrogate_anywhere_in_a_responses_body_is_a_400(body, param):
    err = refused(responses, body)
    assert err.param == param and "surrogate" in err.message, (err.param, err.message)


# --------------------------------------------------------------------------------------- counts


def chat_tools(n: int) -> dict:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]
    return {"messages": USER, "tools": tools}


def tool_calls(n: int) -> dict:
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(n)]
    return {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]}


@pytest.mark.parametrize(("fn", "make", "cap", "param"), [
    (chat, lambda n: {"messages": USER * n}, MAX_MESSAGES, "messages"),
    (chat, chat_tools, MAX_TOOLS, "tools"),
    (chat, tool_calls, MAX_TOOL_CALLS, "messages[].tool_calls"),
    (responses, lambda n: {"input": USER * n}, MAX_MESSAGES, "input"),
    (responses, lambda n: {"input": "Hi", "tools": [{"type": "function", "name": f"f{i}"} for i in range(n)]},
     MAX_TOOLS, "tools"),
])
def test_counts_over_their_caps_are_a_400(fn, make, cap, param):
    err = refused(fn, make(cap + 1))
    assert err.param == param and err.code == "array_above_max_length", err.message
    assert f"maximum length {cap}" in err.message
    fn(make(cap))  # at the cap: served


def test_a_responses_tool_with_an_unknown_key_is_a_400():
    err = refused(responses, {"input": "Hi", "tools": [{"type": "function", "name": "f", "bogus": 1}]})
    assert err.param == "tools[0]" and "'bogus'" in err.message
    # The SDK's keys for features colibri lacks: as if absent at their defaults, else refused.
    neutral = {"defer_loading": False, "allowed_callers": ["direct"], "async": False, "output_schema": None}
    assert responses({"input": "Hi", "tools": [{"type": "function", "name": "f", **neutral}]}).parse_tools
    deferred = {"type": "function", "name": "f", "defer_loading": True}
    err = refused(responses, {"input": "Hi", "tools": [deferred]})
    assert err.param == "tools[0].defer_loading"


# ------------------------------------------------------------------------ reading a model's calls


@pytest.mark.parametrize("arguments", [DEEP, DIGITS])
def test_reading_deep_or_huge_json_from_the_model_is_text_not_an_exception(arguments):
    tools = ToolSet(({"name": "f"},))
    envelope = '{"tool_call": {"name": "f", "arguments": ' + arguments + "}}"
    assert tools.read_envelope(envelope) == (envelope, [])
    marked = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    assert tools.read_markers(marked) == (marked, [])
    as_text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(arguments) + "}</tool_call>"
    assert tools.read_markers(as_text) == (as_text, [])


# ------------------------------------------------------------------------------------ end to end


def post(server, path: str, body: dict):
    with server.http() as h:
        return h.post(path, content=wire(body), headers={"content-type": "application/json"})


E2E = {
    "big_enum": (CHAT, {"messages": USER, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": BIG_ENUM}}}, "response_format"),
    "deep_arguments": (CHAT, {"messages": history(arguments=DEEP), "max_tokens": 2},
                       "messages[1].tool_calls[0]"),
    "responses_deep_arguments": (RESPONSES, {"input": items(arguments=DEEP), "max_output_tokens": 2},
                                 "input[1].arguments"),
    "surrogate_tool_name": (CHAT, {"messages": history(name="f\ud800"), "max_tokens": 2},
                            "messages[1].tool_calls"),
    "streamed_metadata_surrogate": (RESPONSES, {"input": "Hi", "max_output_tokens": 2, "stream": True,
                                                "metadata": {"k": "v\ud800"}}, "metadata"),
}


@pytest.mark.parametrize("case", list(E2E))
def test_bad_input_is_a_400_end_to_end_and_logs_no_traceback(server, case):
    path, body, param = E2E[case]
    logged = len(server.lines)
    r = post(server, path, body)
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = error_body(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    time.sleep(0.2)  # what the server logs for this request is written by now
    assert not any("Traceback" in line for line in server.lines[logged:]), server.log
