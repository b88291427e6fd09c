"""A JSON schema as llguidance's Lark grammar (``%json {...}``), the way every front end wants it.

The ``x-guidance`` options fix the whitespace (one ``", "`` between items, ``": "`` after a key,
none elsewhere): left free, a small model sampled at temperature 1 rambles in newlines until
``max_tokens``. ``lenient`` ignores keywords llguidance does not implement rather than failing a
schema a client wrote for OpenAI. An object schema that lists ``properties`` and says nothing of
``additionalProperties`` gets no other keys (``closed``), as llama.cpp's converter has it: left
open, the default model invents a ``"description"`` key and rambles in it; the output stays valid
for the schema as sent. The HTTP server's structured outputs (``colibri.api``) and the tool calls
of both front ends (``tool_format``) build their grammars here.
"""

from __future__ import annotations

import json
from typing import Any

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


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
    """The grammar of one JSON value valid for ``schema``: ``start: %json {...}``."""
    return "start: " + json_item(schema)


def json_item(schema: dict[str, Any]) -> str:
    """``%json {...}``: a grammar item for one JSON value valid for ``schema`` (closed), with our
    whitespace options over any the schema's own ``x-guidance`` gives."""
    options = schema.get("x-guidance")
    options = {**options, **JSON_OPTIONS} if isinstance(options, dict) else JSON_OPTIONS
    return "%json " + json.dumps({**closed(schema), "x-guidance": options}, ensure_ascii=False)
