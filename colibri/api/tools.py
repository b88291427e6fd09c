"""``tools`` and ``tool_choice`` -> what the prompt offers, the grammar, and the answer's tool calls.

OpenAI's side of tool calls: the validation, the history, the calls' ids. How a call is written
(markers or the envelope), worded in the prompt, held by a grammar and read back is
``colibri.model.tool_format``'s, shared with the Channel session. Two styles, chosen per request
(``ToolPlan.style``):

- **template**: the model's chat template takes ``tools`` (as transformers passes them) and writes
  the markers. The tools go to the template, the history goes through as HF templates expect it
  (``tool_calls`` with the arguments as objects, ``tool`` messages), the output is not constrained
  and the markers are parsed back. This is for ``tool_choice: "auto"`` only. With ``"required"``
  or a named function the answer must be a call, which only a grammar can promise, and in those
  vocabularies the markers are added tokens (kept whole, not text a literal in a grammar can
  match): such a request falls back to the generic style, tools and history alike, so the prompt
  and the grammar agree.
- **generic** (any other template, e.g. the default model's): a system message lists the tools and
  the answer is constrained to the envelope: ``"auto"`` allows calls and a reply, ``"required"``
  only calls, a named function only calls of it; ``parallel_tool_calls: true`` allows several
  calls in one answer (the default is one, as in llama.cpp's server for a template without tool
  support). History is re-expressed in it: an assistant's calls become its envelope, a ``tool``
  message a user message ``{"tool_response": {"name", "tool_call_id", "content"}}``.

``tool_choice: "none"`` offers no tools (the request is then a plain chat).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from colibri.api.ids import new_id
from colibri.api.json_body import parse_json
from colibri.api.openai_errors import bad, shown, too_many
from colibri.api.structured import checked
from colibri.model.tool_format import CALL_CLOSE, CALL_OPEN, Call, ToolSet, envelope, tool_response

# OpenAI's rule for a function's name: also keeps a name from holding markup.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# OpenAI's own maximum of functions in one request; each is listed in the prompt and the grammar.
MAX_TOOLS = 128
# Tool calls in a request's history, all messages together: each is checked, its arguments parsed
# and re-written on the event loop; an agent's long loop makes about one a turn (MAX_MESSAGES).
MAX_TOOL_CALLS = 2048
# A generic-style reply cut by its budget: the envelope's opening, then the reply's JSON string.
_REPLY_OPEN = re.compile(r'\s*\{\s*"response"\s*:\s*"')
# The longest escape a cut JSON string can end inside (``\uXXXX``): dropped to decode the rest.
_LONGEST_ESCAPE = 6
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


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

    @cached_property
    def format(self) -> ToolSet:
        """The tools in ``tool_format``'s terms: how they are worded, held and read back."""
        return ToolSet(tuple(t["function"] for t in self.tools), self.choice != "auto", self.forced,
                       self.parallel)

    @cached_property
    def grammar(self) -> str | None:
        """The answer's grammar: the envelope in generic style; None in template style (the model
        writes its own markers, unconstrained)."""
        return self.format.envelope_grammar() if self.style == "generic" else None

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
    if raw is not None and len(raw) > MAX_TOOLS:
        raise too_many("tools", len(raw), MAX_TOOLS)
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
    if plan.grammar is not None:
        checked(plan.grammar, "tools")
    return plan


# ----------------------------------------------------------------------------- the grammar


def tool_grammar(plan: ToolPlan | None) -> str | None:
    """The grammar of the answer (``structured.py``'s contract): the generic envelope; None in
    template style (the model writes its own markers) or without tools."""
    return None if plan is None else plan.grammar


# ----------------------------------------------------------------------------- the prompt


def _call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise bad(where, f"'{where}' must be {{'id', 'type': 'function', "
                         "'function': {'name', 'arguments'}}")
    name, arguments, call_id = fn.get("name"), fn.get("arguments", "{}"), call.get("id", "")
    if not isinstance(name, str) or not isinstance(arguments, str | dict) or not isinstance(call_id, str):
        raise bad(where, f"'{where}' needs a string 'id', 'function.name' and 'function.arguments'")
    if isinstance(arguments, str):  # HF templates expect the arguments as an object; text that is
        # no JSON is kept as the client wrote it, but JSON past the body's limits is a 400
        arguments = parse_json(arguments, f"{where}.function.arguments", where, not_json=arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def count_calls(messages: list[Any]) -> int:
    """The tool calls in a chat's history, all messages together; a 400 past MAX_TOOL_CALLS (counted
    before any is checked)."""
    count = sum(len(m["tool_calls"]) for m in messages
                if isinstance(m, dict) and isinstance(m.get("tool_calls"), list))
    if count > MAX_TOOL_CALLS:
        raise too_many("messages[].tool_calls", count, MAX_TOOL_CALLS)
    return count


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
        call_id = message["tool_call_id"]
        name = message.get("name") or names.get(call_id)
        return {"role": "user", "content": tool_response(name, call_id, message["content"])}
    calls = message.get("tool_calls")
    if not calls:
        return message
    names.update((c["id"], c["function"]["name"]) for c in calls)
    single = plan is not None and not plan.parallel
    return {"role": "assistant", "content": envelope(
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls], single)}


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
    instructions = plan.format.envelope_instructions()
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{instructions}"}, *out[1:]]
    return [{"role": "system", "content": instructions}, *out]


# ----------------------------------------------------------------------------- the answer


def _openai_call(call: Call) -> dict[str, Any]:
    return {"id": new_id("call_"), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def split_output(text: str, plan: ToolPlan | None) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's text -> (content, OpenAI ``tool_calls``). Text that does not parse as calls of
    the offered tools is content, whole."""
    if plan is None:
        return text, []
    fmt = plan.format
    content, calls = fmt.read_markers(text) if plan.style == "template" else fmt.read_envelope(text)
    return content, [_openai_call(c) for c in calls]


def _cut_string(body: str) -> str:
    """The text of a JSON string whose opening quote came before ``body`` and whose end may be cut
    (an escape cut halfway is dropped)."""
    decoder = json.JSONDecoder()
    try:
        return decoder.raw_decode('"' + body)[0]  # whole: the string ended before the cut
    except ValueError:
        pass
    for trim in range(min(_LONGEST_ESCAPE, len(body)) + 1):
        try:
            return json.loads('"' + body[: len(body) - trim] + '"')
        except ValueError:
            continue
    return ""


def cut_call(text: str, content: str | None, calls: list[dict[str, Any]],
             plan: ToolPlan) -> tuple[str | None, str | None]:
    """An answer cut by its budget (``finish_reason: "length"``) with tools offered: (the content a
    client may see, the dropped partial call's text or None). A half-written call is never shown as
    text (a client would print or parse the raw envelope): it is dropped, and its text goes to the
    answer's ``colibri`` block. ``text`` is the whole answer, ``content`` and ``calls`` what
    ``split_output`` read of it. Generic style: the grammar held the whole answer to the envelope, so
    unparsed text is a cut envelope: a cut reply (``{"response": "...``) is its reply so far, a cut
    call leaves no content (""). Template style: an unclosed last ``<tool_call>`` block is dropped,
    the text before it kept."""
    if content is None:
        return None, None
    if plan.style == "generic":
        if calls or content != text or not text.strip():  # read whole: not cut inside the envelope
            return content, None
        reply = _REPLY_OPEN.match(content)
        return (_cut_string(content[reply.end():]), None) if reply else ("", content)
    at = content.rfind(CALL_OPEN)
    if at < 0 or CALL_CLOSE in content[at:]:
        return content, None
    kept = content[:at].strip()
    return (kept or (None if calls else "")), content[at:]
