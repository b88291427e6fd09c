"""``response_format`` -> a grammar for the engine (structured outputs), without I/O.

The grammar contract (the engine's ``colibri/model/grammar.py``): a ``str`` that
``llguidance.gbnf_to_lark.any_to_lark`` turns into Lark and ``LLMatcher.grammar_from_lark``
compiles. Ours is llguidance's Lark with an embedded JSON schema, ``start: %json {...}``, whose
``x-guidance`` options fix the whitespace (one ``", "`` between items, ``": "`` after a key, none
elsewhere): left free, a small model sampled at temperature 1 rambles in newlines until
``max_tokens``. ``lenient`` ignores keywords llguidance does not implement rather than failing a
schema a client wrote for OpenAI. An object schema that lists ``properties`` and says nothing
of ``additionalProperties`` gets no other keys (``closed``), as llama.cpp's converter has it: left
open, the default model invents a ``"description"`` key and rambles in it until ``max_tokens``; the
output stays valid for the client's schema, which allowed those keys but did not ask for them. A
schema llguidance cannot compile is the client's 400 here, never the engine's error later.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from colibri.api.openai_errors import bad, shown

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# How much of llguidance's message a 400 quotes: its first line names the fault; the rest echoes
# the whole grammar back.
MAX_ERROR_CHARS = 300


# The keywords whose value is a schema, a list of schemas or a map of name -> schema: where
# ``closed`` looks for object schemas (a property *named* "properties" is a name, not a keyword).
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "additionalItems", "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """``schema`` with every object schema that lists ``properties`` but not
    ``additionalProperties`` (nor ``patternProperties``) closed to other keys (module docstring)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _SCHEMA_LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                         "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar of one JSON value valid for ``schema``, with our whitespace options."""
    options = schema.get("x-guidance")
    options = {**options, **JSON_OPTIONS} if isinstance(options, dict) else JSON_OPTIONS
    return "start: %json " + json.dumps({**closed(schema), "x-guidance": options}, ensure_ascii=False)


def grammar_error(grammar: str) -> str:
    """llguidance's complaint about ``grammar`` ("" when it compiles), cut to its first line."""
    try:
        lark = any_to_lark(grammar)
        message = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
    except Exception as e:  # noqa: BLE001 - a foreign library's failure on a client's schema
        message = str(e) or type(e).__name__
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first[:MAX_ERROR_CHARS]


def checked(grammar: str, field: str) -> str:
    """``grammar`` if llguidance compiles it, else a 400 naming ``field``."""
    error = grammar_error(grammar)
    if error:
        raise bad(field, f"'{field}' cannot be used as a grammar: {error}")
    return grammar


def _schema_of(spec: Any) -> dict[str, Any]:
    """OpenAI's ``json_schema`` object: ``name`` (required there; optional here), ``schema``
    (absent: any JSON object), ``strict``, ``description``."""
    if not isinstance(spec, dict):
        raise bad("response_format", "'response_format.json_schema' must be an object")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad("response_format", f"'response_format.json_schema' has unknown key {shown(min(unknown))}")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise bad("response_format", f"'response_format.json_schema.{key}' must be a {kind.__name__}")
    schema = spec.get("schema")
    if schema is None:
        return ANY_OBJECT
    if not isinstance(schema, dict):
        raise bad("response_format", "'response_format.json_schema.schema' must be a JSON schema object")
    return schema


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar for ``response_format``: None for text (absent, null, ``{"type": "text"}``), any
    JSON object for ``json_object``, the client's schema for ``json_schema``; strict or not, the
    output is held to the schema (OpenAI's strict mode; non-strict may only be looser)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise bad("response_format", "'response_format' must be an object")
    kind = response_format.get("type")
    if kind == "text" and set(response_format) == {"type"}:
        return None
    if kind == "json_object" and set(response_format) == {"type"}:
        return checked(json_grammar(ANY_OBJECT), "response_format")
    if kind == "json_schema" and set(response_format) <= {"type", "json_schema"}:
        if "json_schema" not in response_format:
            raise bad("response_format", "'response_format' of type 'json_schema' needs 'json_schema'")
        return checked(json_grammar(_schema_of(response_format["json_schema"])), "response_format")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad("response_format", f"'response_format.type' must be 'text', 'json_object' or "
                                     f"'json_schema', not {shown(kind)}")
    extra = sorted(set(response_format) - {"type", "json_schema"} if kind == "json_schema" else
                   set(response_format) - {"type"})
    raise bad("response_format", f"'response_format' of type {kind!r} has unknown key {shown(extra[0])}")
