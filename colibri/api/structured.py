"""``response_format`` -> a grammar for the engine (structured outputs), without I/O.

The grammar contract (the engine's ``colibri/model/grammar.py``): a ``str`` that
``llguidance.gbnf_to_lark.any_to_lark`` turns into Lark and ``LLMatcher.grammar_from_lark``
compiles. Ours is llguidance's Lark with an embedded JSON schema, ``start: %json {...}``, built by
``colibri/model/json_grammar.py`` (fixed whitespace, ``lenient``, objects closed to keys they do
not list). A schema llguidance cannot compile is the client's 400 here, never the engine's error
later (``colibri/model/grammar.py``: how often a grammar is compiled), and so is one over the
engine's grammar limit (``colibri/io/mux.py`` MAX_GRAMMAR, 1 MiB), which llguidance would compile.
"""

from __future__ import annotations

from typing import Any

from colibri.api.openai_errors import bad, grammar_too_large, shown
from colibri.io.mux import MAX_GRAMMAR
from colibri.model.grammar import GrammarError, compile_grammar
from colibri.model.json_grammar import json_grammar

__all__ = ["checked", "grammar_bytes", "json_grammar", "response_format_grammar"]

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_bytes(grammar: str) -> int:
    """The grammar's length as the SUBMIT counts it (UTF-8 bytes); never raises."""
    return len(grammar) if grammar.isascii() else len(grammar.encode("utf-8", "surrogatepass"))


def checked(grammar: str, field: str) -> str:
    """``grammar`` if the engine takes it (at most MAX_GRAMMAR bytes, the SUBMIT's limit: checked
    first, before the compile it bounds) and llguidance compiles it, else a 400 naming ``field``.
    Compiled once per distinct text (``compile_grammar``'s cache): the same schema or tools each
    turn cost nothing again."""
    size = grammar_bytes(grammar)
    if size > MAX_GRAMMAR:
        raise grammar_too_large(field, size, MAX_GRAMMAR)
    try:
        compile_grammar(grammar)
    except GrammarError as e:
        raise bad(field, f"'{field}' cannot be used as a grammar: {e}") from None
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
