"""``tools`` and ``tool_choice`` -> what the prompt offers, the grammar, and the answer's tool calls.

Two styles, chosen per request (``ToolPlan.style``):

- **template**: the model's chat template takes ``tools`` (as transformers passes them) and writes
  Hermes/Qwen markers, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The tools go
  to the template, the history goes through as HF templates expect it (``tool_calls`` with the
  arguments as objects, ``tool`` messages), the output is not constrained and the markers are
  parsed back. This is for ``tool_choice: "auto"`` only. With ``"required"`` or a named function
  the answer must be a call, which only a grammar can promise, and in those vocabularies the
  markers are added tokens (kept whole, not text a literal in a grammar can match): such a request
  falls back to the generic style, tools and history alike, so the prompt and the grammar agree.
- **generic** (any other template, e.g. the default model's), after llama.cpp's server: a system
  message lists the tools (name, description, JSON schema of the arguments) and the answer is
  constrained to one JSON object, the *envelope*, either a call, ``{"tool_calls": [{"name": N,
  "arguments": {...}}, ...]}`` (``parallel_tool_calls: true``; one or more) or ``{"tool_call":
  {"name": N, "arguments": {...}}}`` (exactly one: the default, as in llama.cpp's server, whose
  default follows the template's own parallel support, which a template without tools lacks; left
  free, a small model repeats the same call until ``max_tokens`` cuts it), or a plain answer,
  ``{"response": "..."}``. ``"auto"`` allows both, ``"required"`` only calls, a named function
  only calls of it. History is re-expressed in it: an assistant's calls become its envelope, a
  ``tool`` message a user message ``{"tool_response": {"name", "tool_call_id", "content"}}``.

``tool_choice: "none"`` offers no tools (the request is then a plain chat).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from colibri.api.openai_errors import bad, shown
from colibri.api.structured import checked, json_grammar

# OpenAI's rule for a function's name: also keeps a name from holding markup.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """A request's validated tools and how they are offered and read back."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, description?, ...}}
    choice: str  # "auto" | "required" | "function" (one named function)
    forced: str | None  # the named function's name
    parallel: bool  # more than one call in an answer: parallel_tool_calls true (module docstring)
    style: str  # "template" | "generic" (module docstring)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template's ``tools`` gets: the tools in template style, else None."""
        return list(self.tools) if self.style == "template" else None


def _function(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad("tools", f"'{where}' must be an object of type 'function'")
    if set(tool) - _TOOL_KEYS:
        raise bad("tools", f"'{where}' has unknown key {shown(min(set(tool) - _TOOL_KEYS))}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad("tools", f"'{where}.function' must be an object")
    if set(fn) - _FUNCTION_KEYS:
        raise bad("tools", f"'{where}.function' has unknown key {shown(min(set(fn) - _FUNCTION_KEYS))}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad("tools", f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', "
                           f"not {shown(name)}")
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise bad("tools", f"'{where}.function.{key}' must be a {kind.__name__}")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _choice(body: dict, names: list[str]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "required", "none"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "function"}:
        name = choice["function"].get("name") if isinstance(choice["function"], dict) else None
        if name in names:
            return "function", name
        raise bad("tool_choice", f"'tool_choice' names the function {shown(name)}, which 'tools' lacks")
    raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")


def parse_tools(body: dict, template: bool = False) -> ToolPlan | None:
    """The request's tools, or None when none are offered (no tools, or ``tool_choice: "none"``).
    ``template``: the model's chat template renders tools itself (``ModelText.template_uses_tools``)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad("tools", "'tools' must be a list")
    tools = [_function(i, t) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad("tools", f"'tools' holds two functions named {shown(dup)}")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    choice, forced = _choice(body, names)
    if not tools:
        if choice in ("required", "function"):
            raise bad("tool_choice", f"'tool_choice' {shown(body['tool_choice'])} needs 'tools'")
        return None
    if choice == "none":
        return None
    style = "template" if template and choice == "auto" else "generic"
    plan = ToolPlan(tuple(tools), choice, forced, parallel is True, style)
    grammar = tool_grammar(plan)
    if grammar is not None:
        checked(grammar, "tools")
    return plan


# ----------------------------------------------------------------------------- the grammar


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/...``) pointing into ``base``, where it now lives."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebased(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def envelope_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema of the generic style's answer (module docstring)."""
    defs, calls = {}, []
    for i, tool in enumerate(plan.tools):
        fn = tool["function"]
        if plan.forced is not None and fn["name"] != plan.forced:
            continue
        defs[f"tool_{i}"] = _rebased(fn.get("parameters") or NO_PARAMETERS, f"#/$defs/tool_{i}")
        calls.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    key, value = ("tool_calls", {"type": "array", "items": call, "minItems": 1}) if plan.parallel \
        else ("tool_call", call)
    envelope = {"type": "object", "properties": {key: value}, "required": [key],
                "additionalProperties": False}
    if plan.choice == "auto":
        response = {"type": "object", "properties": {"response": {"type": "string"}},
                    "required": ["response"], "additionalProperties": False}
        envelope = {"anyOf": [envelope, response]}
    return {**envelope, "$defs": defs}


def tool_grammar(plan: ToolPlan | None) -> str | None:
    """The grammar of the answer (``structured.py``'s contract): the generic envelope; None in
    template style (the model writes its own markers) or without tools."""
    if plan is None or plan.style == "template":
        return None
    return json_grammar(envelope_schema(plan))


# ----------------------------------------------------------------------------- the prompt


def system_prompt(plan: ToolPlan) -> str:
    """The generic style's instructions: the tools and the envelope, in words and examples."""
    listed = [{k: v for k, v in t["function"].items() if k != "strict"} for t in plan.tools]
    call = '{"name": "<tool name>", "arguments": {<its arguments>}}'
    calls = f'{{"tool_calls": [{call}, ...]}}' if plan.parallel else f'{{"tool_call": {call}}}'
    lines = ["You can call these tools (each with the JSON schema of its arguments):",
             json.dumps(listed, ensure_ascii=False), "",
             "Answer with one JSON object and nothing else."]
    if plan.choice == "auto":
        lines += [f"To call tools: {calls}", 'To answer the user directly: {"response": "<your answer>"}']
    elif plan.forced is not None:
        lines += [f"You must call the tool {plan.forced!r}: {calls}"]
    else:
        lines += [f"You must call one of the tools: {calls}"]
    lines += ['Tool results come back as {"tool_response": {"name": ..., "tool_call_id": ..., '
              '"content": ...}}.']
    if plan.choice == "auto":
        lines += ["Once the tool results answer the question, use them in your answer to the user "
                  "instead of calling the tool again."]
    return "\n".join(lines)


def _call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise bad(where, f"'{where}' must be {{'id', 'type': 'function', "
                         "'function': {'name', 'arguments'}}")
    name, arguments, call_id = fn.get("name"), fn.get("arguments", "{}"), call.get("id", "")
    if not isinstance(name, str) or not isinstance(arguments, str | dict) or not isinstance(call_id, str):
        raise bad(where, f"'{where}' needs a string 'id', 'function.name' and 'function.arguments'")
    if isinstance(arguments, str):
        try:  # HF templates expect the arguments as an object
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the client wrote it
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def history_message(i: int, message: dict, role: str, content: str) -> dict[str, Any]:
    """A client's message (role checked, content made text) as the template takes it: an
    assistant's ``tool_calls`` with the arguments as objects, a tool result's ``tool_call_id``."""
    clean: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise bad(f"messages[{i}]", "only an assistant message holds 'tool_calls'")
    if calls:
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls", "'tool_calls' must be a list")
        clean["tool_calls"] = [_call(i, j, c) for j, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id", "a tool message needs a string 'tool_call_id'")
        clean["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            clean["name"] = message["name"]
    return clean


def _as_generic(message: dict[str, Any], plan: ToolPlan | None, names: dict[str, str]) -> dict[str, str]:
    if message["role"] == "tool":
        response = {"tool_call_id": message["tool_call_id"], "content": message["content"]}
        name = message.get("name") or names.get(message["tool_call_id"])
        response = {"name": name, **response} if name else response
        return {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
    calls = message.get("tool_calls")
    if not calls:
        return message
    items = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    for c in calls:
        names[c["id"]] = c["function"]["name"]
    single = plan is not None and not plan.parallel and len(items) == 1
    envelope = {"tool_call": items[0]} if single else {"tool_calls": items}
    return {"role": "assistant", "content": json.dumps(envelope, ensure_ascii=False)}


def prompt_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, style: str
) -> list[dict[str, Any]]:
    """The messages the template renders: as they are in template style; in generic style the
    history re-expressed in the envelope and, with tools, their system message first (joined to
    the client's own system message, if any)."""
    if style == "template":
        return messages
    names: dict[str, str] = {}
    out = [_as_generic(m, plan, names) for m in messages]
    if plan is None:
        return out
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{system_prompt(plan)}"}, *out[1:]]
    return [{"role": "system", "content": system_prompt(plan)}, *out]


# ----------------------------------------------------------------------------- the answer


def _openai_call(call: Any, plan: ToolPlan) -> dict[str, Any] | None:
    """An OpenAI ``tool_calls`` item from a parsed call, or None if it is not one of the tools."""
    if not isinstance(call, dict) or call.get("name") not in plan.names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments}}


def _split_envelope(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if not isinstance(answer, dict) or len(answer) != 1:
        return text, []
    if isinstance(answer.get("response"), str):
        return answer["response"], []
    items = answer.get("tool_calls") if "tool_calls" in answer else [answer.get("tool_call")]
    calls = [_openai_call(c, plan) for c in items] if isinstance(items, list) and items else [None]
    if any(c is None for c in calls):
        return text, []
    return None, calls  # type: ignore[return-value]


def _split_markers(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    calls, kept, at = [], [], 0
    for match in _CALL_BLOCK.finditer(text):
        try:
            call = _openai_call(json.loads(match.group(1)), plan)
        except json.JSONDecodeError:
            call = None
        if call is not None:  # a block that is not a call stays in the content
            calls.append(call)
            kept.append(text[at : match.start()])
            at = match.end()
    if not calls:
        return text, []
    return ("".join(kept) + text[at:]).strip() or None, calls


def split_output(text: str, plan: ToolPlan | None) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's text -> (content, OpenAI ``tool_calls``). Text that does not parse as calls of
    the offered tools is content, whole."""
    if plan is None:
        return text, []
    if plan.style == "template":
        return _split_markers(text, plan)
    return _split_envelope(text, plan)
