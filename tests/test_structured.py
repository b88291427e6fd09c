"""response_format -> a grammar: each compiles with llguidance, holds the output to the schema over
the default model's vocabulary, and a client's bad shape or uncompilable schema is a 400 by name."""

from __future__ import annotations

import json

import llguidance
import pytest
from llguidance.gbnf_to_lark import any_to_lark

from colibri.api.openai_errors import ApiError
from colibri.api.openai_requests import parse_chat, parse_completion
from colibri.api.structured import json_grammar, response_format_grammar
from colibri.model.text import ModelText

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def text(model_path) -> ModelText:
    return ModelText.open(model_path)


@pytest.fixture(scope="module")
def accepts(text):
    """``accepts(grammar, output)``: whether the grammar allows the output, token by token."""
    tok = text.tokenizer
    lltok = llguidance.LLTokenizer(tok._tok.to_str(), eos_token=sorted(tok.stop_ids))

    def check(grammar: str, output: str) -> bool:
        compiled = llguidance.LLMatcher.grammar_from_lark(any_to_lark(grammar))
        assert llguidance.LLMatcher.validate_grammar(compiled, lltok) == ""
        matcher = llguidance.LLMatcher(lltok, compiled, log_level=0)
        return matcher.consume_tokens(tok.encode(output)) and matcher.is_accepting()

    return check


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("value", [None, {"type": "text"}])
def test_text_is_no_grammar(value):
    assert response_format_grammar(value) is None


def test_json_object_any_object_without_rambling_whitespace(accepts):
    grammar = response_format_grammar({"type": "json_object"})
    assert accepts(grammar, '{"a": [1, 2], "b": {"c": null}}')
    assert not accepts(grammar, "[1, 2]")
    assert not accepts(grammar, '{"a":1}')  # the separators are fixed
    assert not accepts(grammar, '{\n  "a": 1}')


def test_json_schema_holds_the_output_to_it(accepts):
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    )
    assert accepts(grammar, '{"name": "Ada", "age": 36}')
    assert not accepts(grammar, '{"name": "Ada", "age": "36"}')
    assert not accepts(grammar, '{"name": "Ada"}')
    assert not accepts(grammar, '{"name": "Ada", "age": 36, "x": 1}')


def test_listed_properties_close_an_object_unless_it_says_otherwise(accepts):
    """No ``additionalProperties``: only the listed keys (``structured.closed``), at every depth,
    through ``$defs`` and ``anyOf``; ``true``, a schema or ``patternProperties`` keep it open; a
    property named ``properties`` is a name, and ``{"type": "object"}`` alone stays any object."""
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/inner"},
                                               "properties": {"anyOf": [inner, {"type": "null"}]}},
              "$defs": {"inner": inner}}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    assert accepts(grammar, '{"a": {"x": 1}, "properties": {"x": 2}}')
    assert not accepts(grammar, '{"a": {"x": 1}, "b": 2}')
    assert not accepts(grammar, '{"a": {"x": 1, "y": 2}}')
    assert not accepts(grammar, '{"properties": {"x": 1, "y": 2}}')
    for open_ in ({"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                  {"patternProperties": {"^y": {"type": "integer"}}}):
        grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": {
            "type": "object", "properties": {"x": {"type": "integer"}}, **open_}}})
        assert accepts(grammar, '{"x": 1, "y": 2}'), open_
    assert accepts(response_format_grammar({"type": "json_schema", "json_schema": {"schema": {
        "type": "object"}}}), '{"y": 2}')


def test_json_schema_without_schema_is_any_object(accepts):
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x"}})
    assert accepts(grammar, '{"k": "v"}') and not accepts(grammar, '"v"')


def test_the_clients_x_guidance_cannot_loosen_the_whitespace():
    schema = {**PERSON, "x-guidance": {"whitespace_flexible": True, "coerce_one_of": True}}
    embedded = json.loads(json_grammar(schema).removeprefix("start: %json "))
    assert embedded["x-guidance"]["whitespace_flexible"] is False
    assert embedded["x-guidance"]["coerce_one_of"] is True


@pytest.mark.parametrize("value", [
    "json_object",
    {"type": "yaml"},
    {"type": "json_object", "schema": {}},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": "person"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": 7, "schema": PERSON}},
    {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"name": "x", "schemas": PERSON}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}},
])
def test_bad_shapes_and_uncompilable_schemas_are_400_naming_response_format(value):
    err = refused(response_format_grammar, value)
    assert err.param == "response_format", err.message
    assert len(err.message) < 500  # llguidance's first line, not the grammar echoed back


def test_chat_and_completion_carry_the_grammar():
    body = {"messages": [{"role": "user", "content": "Who?"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    gen = parse_chat(body, lambda m, t: "p", 64, 1)
    assert gen.grammar is not None and '"age"' in gen.grammar and gen.tools is None
    gen = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}, 64, 1)
    assert gen.grammar is not None
    assert parse_chat({"messages": body["messages"]}, lambda m, t: "p", 64, 1).grammar is None


def test_tools_and_a_json_response_format_at_once_is_400_naming_response_format():
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool],
            "response_format": {"type": "json_object"}}
    err = refused(parse_chat, body, lambda m, t: "p", 64, 1)
    assert err.param == "response_format" and "tools" in err.message
    # tools not offered (tool_choice "none"): the format is served
    gen = parse_chat({**body, "tool_choice": "none"}, lambda m, t: "p", 64, 1)
    assert gen.grammar is not None and gen.tools is None
    # text with tools: the tools' grammar
    gen = parse_chat({**body, "response_format": {"type": "text"}}, lambda m, t: "p", 64, 1)
    assert gen.tools is not None and gen.grammar is not None and '"tool_call"' in gen.grammar
