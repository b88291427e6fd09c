"""Tool calls as text, for every front end: the markers, the prompt's wording, the grammar, the parser.

A model calls a tool by writing text, in one of two shapes:

- **markers** (Hermes/Qwen): ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``. What the
  chat templates that render tools themselves teach their models, and what the Channel session
  asks any model for (it describes the tools in the system message).
- **envelope** (after llama.cpp's server, for templates that know no tools): the whole answer is
  one JSON object, a call ``{"tool_call": {"name": N, "arguments": {...}}}`` (one call), or
  ``{"tool_calls": [...]}`` (``parallel``: one or more; left free, a small model repeats the same
  call until its budget cuts it, so one call is the default), or a reply ``{"response": "..."}``
  unless a call is ``required``. The history is written in it too (``envelope``,
  ``tool_response``), so the model sees its own earlier calls in the shape it is asked for.

``ToolSet`` holds the offered functions (flat: ``name``, ``description``, ``parameters``) and
what the answer may be; the HTTP server (``colibri.api.tools``: OpenAI's validation and history)
and the Channel session (``colibri.sched.channel_tools``) both build their prompts, grammars and
parsers from it. A call reads back as ``Call(name, arguments)``, the arguments always a JSON object's
text: a call whose arguments are not an object is not a call, and the text stays content. Plain
Python (json, re) and ``json_grammar``: both processes import it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from colibri.model.json_grammar import json_grammar, json_item

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# A function that declares no parameters takes none: ``{}`` is its only arguments object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
LISTED_KEYS = ("name", "description", "parameters")  # what the prompt tells of a function
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + "|$)", re.DOTALL)
# What reading a model's JSON may raise: no JSON (a ValueError, as are Python's 4300-digit guard on
# an integer and json's JSONDecodeError), or nesting deeper than the parser's recursion (an
# unconstrained answer, or a schema that allows any object, can hold either): the text is no call.
_UNREADABLE = (ValueError, RecursionError)
_CALL_SHAPE = '{"name": "<tool name>", "arguments": {<its arguments>}}'


class Call(NamedTuple):
    name: str
    arguments: str  # a JSON object's text


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/...``) pointing into ``base``, where it now lives."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebased(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


@dataclass(frozen=True)
class ToolSet:
    """The functions offered, and what the answer may be."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description"?, "parameters"?}
    required: bool = False  # the answer must be a call (no reply in words)
    forced: str | None = None  # the one function it must call
    parallel: bool = False  # an envelope may hold more than one call

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(str(fn.get("name")) for fn in self.functions)

    def listing(self) -> str:
        """The functions for the system message, with the JSON schema of their arguments."""
        listed = [{k: fn[k] for k in LISTED_KEYS if fn.get(k) is not None} for fn in self.functions]
        return ("You can call these tools (each with the JSON schema of its arguments):\n"
                + json.dumps(listed, ensure_ascii=False))

    def call_schema(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the schema of one call of a callable function, the ``$defs`` it refers to): each
        function's parameters in ``$defs`` (their own local ``$ref``s rebased there), so the
        document that embeds the call must hold the defs at its root."""
        defs, calls = {}, []
        for i, fn in enumerate(self.functions):
            if self.forced is not None and fn.get("name") != self.forced:
                continue
            defs[f"tool_{i}"] = _rebased(fn.get("parameters") or NO_PARAMETERS, f"#/$defs/tool_{i}")
            calls.append({
                "type": "object",
                "properties": {"name": {"const": fn.get("name")}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
        return (calls[0] if len(calls) == 1 else {"anyOf": calls}), defs

    def read_call(self, obj: Any) -> Call | None:
        """A parsed call of one of the functions, or None if ``obj`` is not one. ``parameters`` is
        taken for ``arguments`` (some models write it); arguments as a string must hold an object."""
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except _UNREADABLE:
                return None
        if not isinstance(arguments, dict):
            return None
        return Call(obj["name"], json.dumps(arguments, ensure_ascii=False))

    # ------------------------------------------------------------------------- markers

    def marker_instructions(self) -> str:
        return (f"{self.listing()}\nTo call one, answer with {CALL_OPEN}{_CALL_SHAPE}{CALL_CLOSE} "
                "and nothing else. Its result comes back in a tool message.")

    def marker_grammar(self) -> str:
        """One call in markers, its arguments held to the function's schema."""
        call, defs = self.call_schema()
        return (f"start: {json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}\n"
                f"call: {json_item({**call, '$defs': defs})}\n")

    def read_markers(self, text: str) -> tuple[str | None, list[Call]]:
        """(the text around the calls, None if nothing; the calls): a block that is not a call of
        one of the functions stays in the text; an unclosed last block (a cut answer) counts."""
        calls, kept, at = [], [], 0
        for match in _CALL_BLOCK.finditer(text):
            try:
                call = self.read_call(json.loads(match.group(1)))
            except _UNREADABLE:
                call = None
            if call is not None:
                calls.append(call)
                kept.append(text[at : match.start()])
                at = match.end()
        if not calls:
            return text, []
        return ("".join(kept) + text[at:]).strip() or None, calls

    # ------------------------------------------------------------------------- the envelope

    def envelope_schema(self) -> dict[str, Any]:
        call, defs = self.call_schema()
        key, value = ("tool_calls", {"type": "array", "items": call, "minItems": 1}) if self.parallel \
            else ("tool_call", call)
        envelope = {"type": "object", "properties": {key: value}, "required": [key],
                    "additionalProperties": False}
        if not self.required:
            reply = {"type": "object", "properties": {"response": {"type": "string"}},
                     "required": ["response"], "additionalProperties": False}
            envelope = {"anyOf": [envelope, reply]}
        return {**envelope, "$defs": defs}

    def envelope_grammar(self) -> str:
        return json_grammar(self.envelope_schema())

    def envelope_instructions(self) -> str:
        one = f'{{"tool_call": {_CALL_SHAPE}}}'
        calls = f'{{"tool_calls": [{_CALL_SHAPE}, ...]}}' if self.parallel else one
        lines = [self.listing(), "", "Answer with one JSON object and nothing else."]
        if not self.required:
            lines += [f"To call tools: {calls}", 'To answer the user directly: {"response": "<your answer>"}']
        elif self.forced is not None:
            lines += [f"You must call the tool {self.forced!r}: {calls}"]
        else:
            lines += [f"You must call one of the tools: {calls}"]
        lines += ['Tool results come back as {"tool_response": {"name": ..., "tool_call_id": ..., '
                  '"content": ...}}.']
        if not self.required:
            lines += ["Once the tool results answer the question, use them in your answer to the user "
                      "instead of calling the tool again."]
        return "\n".join(lines)

    def read_envelope(self, text: str) -> tuple[str | None, list[Call]]:
        """(the reply, None for calls; the calls); text that is no envelope of these functions
        is the reply, whole."""
        try:
            answer = json.loads(text)
        except _UNREADABLE:
            return text, []
        if not isinstance(answer, dict) or len(answer) != 1:
            return text, []
        if isinstance(answer.get("response"), str):
            return answer["response"], []
        items = answer.get("tool_calls") if "tool_calls" in answer else [answer.get("tool_call")]
        calls = [self.read_call(c) for c in items] if isinstance(items, list) and items else [None]
        if any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]


def envelope(calls: Sequence[tuple[str, Any]], single: bool) -> str:
    """An earlier answer's calls ((name, arguments), the arguments as sent) in the envelope."""
    items = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return json.dumps({"tool_call": items[0]} if single and len(items) == 1 else {"tool_calls": items},
                      ensure_ascii=False)


def tool_response(name: str | None, call_id: str, content: str) -> str:
    """A tool's result as the envelope's user message (``name`` None: unknown)."""
    response = {"tool_call_id": call_id, "content": content}
    return json.dumps({"tool_response": {"name": name, **response} if name else response}, ensure_ascii=False)
