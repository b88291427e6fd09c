"""One tool-call format for both front ends (``colibri.model.tool_format``), and a grammar compiled
once per request (``colibri.model.grammar``'s caches): the HTTP server's tools and the Channel
session's read, word and constrain calls the same way."""

from __future__ import annotations

import json

import pytest

from colibri.api.tools import parse_tools, split_output
from colibri.model.grammar import GrammarError, GrammarVocab, compile_grammar
from colibri.model.text import ModelText
from colibri.model.tool_format import CALL_CLOSE, CALL_OPEN, ToolSet, envelope, tool_response
from colibri.sched.channel_tools import Tools

WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time"}  # no parameters: {} only


def marked(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {arguments}}}{CALL_CLOSE}'


CALL = marked("get_weather", '{"city": "Paris"}')


@pytest.fixture(scope="module")
def vocab(model_path) -> tuple[GrammarVocab, object]:
    tok = ModelText.open(model_path).tokenizer
    return GrammarVocab(tok.to_json(), tok.n_vocab, tok.stop_ids), tok


def accepts(vocab: tuple[GrammarVocab, object], grammar: str, text: str) -> bool:
    v, tok = vocab
    c = v.constraint(grammar)
    for token in tok.encode(text):
        if not c.allowed()[token] or not c.advance(token):
            return False
    return c.finished


def test_both_front_ends_word_and_read_tools_alike():
    channel = Tools({"instructions": "Be brief.", "tools": [WEATHER, TIME]})
    plan = parse_tools({"tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)]},
                       template=True)
    assert plan is not None and plan.format.listing() == channel.format.listing()
    assert channel.format.listing() in channel.system_text()
    content, calls = split_output(f"Let me look. {CALL}", plan)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert channel.parse(CALL) == ("get_weather", calls[0]["function"]["arguments"])


@pytest.mark.parametrize(("call", "read"), [
    ({"name": "get_weather", "arguments": {"city": "Oslo"}}, ("get_weather", '{"city": "Oslo"}')),
    ({"name": "get_weather", "arguments": '{"city": "Oslo"}'}, ("get_weather", '{"city": "Oslo"}')),
    ({"name": "get_weather", "parameters": {"city": "Oslo"}}, ("get_weather", '{"city": "Oslo"}')),
    ({"name": "get_weather", "arguments": "Oslo"}, None),  # a string that holds no object
    ({"name": "get_weather", "arguments": [1]}, None),
    ({"name": "rm_rf", "arguments": {}}, None),
    (["get_weather"], None),
])
def test_a_call_reads_back_only_with_object_arguments(call, read):
    assert ToolSet((WEATHER, TIME)).read_call(call) == read


def test_history_in_the_envelope():
    assert json.loads(envelope([("get_time", {})], single=True)) == {"tool_call": {"name": "get_time",
                                                                                   "arguments": {}}}
    assert "tool_calls" in json.loads(envelope([("get_time", {})], single=False))
    assert json.loads(tool_response(None, "c1", "sunny")) == {"tool_response": {"tool_call_id": "c1",
                                                                                "content": "sunny"}}


def test_channel_grammar_holds_one_call_of_a_declared_tool(vocab):
    grammar = Tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).grammar()
    assert accepts(vocab, grammar, CALL)
    assert accepts(vocab, grammar, marked("get_time", "{}"))
    assert not accepts(vocab, grammar, "It is sunny.")
    assert not accepts(vocab, grammar, marked("get_time", '{"x": 1}'))
    assert not accepts(vocab, grammar, marked("rm_rf", "{}"))


def test_a_grammar_is_checked_once_per_text():
    grammar = ToolSet((WEATHER,), required=True).envelope_grammar()
    compile_grammar(grammar)
    before = compile_grammar.cache_info()
    for _ in range(3):
        compile_grammar(grammar)
    after = compile_grammar.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)
    with pytest.raises(GrammarError, match="does not compile"):
        compile_grammar('start: %json {"type": "strin"}')


def test_the_engine_compiles_a_grammar_once_and_each_request_gets_its_own_state(vocab):
    v, tok = vocab
    grammar = 'start: "yes" | "no"'
    first, second = v.constraint(grammar), v.constraint(grammar)
    assert first.matcher is not second.matcher and v._compiled[grammar] not in (first.matcher, second.matcher)
    [yes], [no] = tok.encode("yes"), tok.encode("no")
    assert first.advance(yes) and first.finished and not first.allowed()[no]
    assert second.allowed()[no] and second.allowed()[yes]  # untouched by the first request
    with pytest.raises(GrammarError):
        v.constraint('start: %json {"type": "strin"}')
    assert 'start: %json {"type": "strin"}' not in v._compiled
