"""OpenAI's Responses API (``POST /v1/responses``) over the chat path, for its text and tool subset.

A Responses body is translated into a chat-completions body (``input`` items -> ``messages``,
flat function tools -> chat tools, ``text.format`` -> ``response_format``, ``max_output_tokens`` ->
``max_tokens``) and parsed by ``parse_chat``, so both endpoints share one validation, one
template and one serving path (``serving``); an error ``parse_chat`` raises is renamed to the
Responses field the client sent. The answer is shaped by ``responses_shapes``. The server stores
nothing: what needs a stored response (``previous_response_id``, ``conversation``,
``background``) is a 400 saying so, as is every field colibri does not serve.

What the coding agents send and real servers accept is accepted where it changes nothing in the
answer (docs/api.md, "What is accepted and what is refused"): metadata (``client_metadata``),
``include`` of what colibri never produces (``reasoning.encrypted_content``: the reasoning comes
whole), ``reasoning.summary`` (colibri writes none), tools the model cannot call (hosted tools such
as ``web_search``, ``custom`` tools; a ``namespace``'s function tools are offered) which are dropped
and listed in the answer's ``colibri`` block, and a tool result echoed without a ``call_id``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from colibri.api.json_body import parse_json
from colibri.api.openai_errors import ApiError, bad, shown, too_many
from colibri.api.openai_requests import MAX_MESSAGES, Generation, Render, parse_chat
from colibri.api.tools import MAX_TOOLS

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # a message's text, as sent or as replayed
# Copied to the chat body as they are: the same name and meaning on both endpoints (``seed`` and
# ``cache_slot`` and ``colibri`` are colibri's extensions, as on chat completions).
_SAME = ("temperature", "top_p", "stream", "parallel_tool_calls", "seed", "cache_slot", "colibri")
# Accepted with any value and no effect on the output.
# ``client_metadata``: Codex CLI's identifiers (installation, session, thread, turn, window ids).
_HARMLESS = {"model", "metadata", "user", "store", "service_tier", "prompt_cache_key",
             "prompt_cache_retention", "safety_identifier", "stream_options", "client_metadata"}
_SERVED = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning",
           "include", *_SAME}
_STORED = "colibri does not store responses"
# Refused unless null or at their default (as if absent); why, for the error message.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), f"{_STORED}: send the whole conversation in 'input'"),
    "conversation": ((), f"{_STORED} or conversations: send the whole conversation in 'input'"),
    "background": ((False,), f"background responses are not supported ({_STORED})"),
    "prompt": ((), "stored prompt templates are not supported: send 'instructions' and 'input'"),
    "truncation": (("disabled",), "only truncation 'disabled' is supported: an input over the "
                                  "context is a 400"),
    "max_tool_calls": ((), "'max_tool_calls' is not supported"),
    "top_logprobs": ((0,), "logprobs are not supported on /v1/responses (use /v1/chat/completions)"),
}
# parse_chat's names for what the client called otherwise here.
_RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format",
            "reasoning_effort": "reasoning.effort"}
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_TOOL_INDEX = re.compile(r"'tools\[(\d+)\]")  # a chat tool named in an error message
# ``include`` values that ask for output colibri never makes, so there is nothing to include: the
# reasoning's encrypted copy (it comes whole, as reasoning text), hosted tools' results, images.
# ``message.output_text.logprobs`` is refused: logprobs are served on chat completions only.
_NOTHING_TO_INCLUDE = frozenset({
    "reasoning.encrypted_content", "web_search_call.results", "web_search_call.action.sources",
    "file_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url",
})
# OpenAI's values of ``reasoning.summary`` (and the older ``generate_summary``): accepted, as colibri
# writes no summary; the reasoning item carries the whole reasoning instead.
_SUMMARIES = ("auto", "concise", "detailed", "none")
# A function tool's keys (OpenAI's FunctionToolParam); another is refused, as chat refuses it.
_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
# FunctionToolParam's keys for features colibri lacks (tool search, programmatic callers): as if
# absent at null or their default, else refused (they would change what the model is offered).
_TOOL_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "defer_loading": (False,), "allowed_callers": (["direct"],), "async": (False,), "output_schema": (),
}


@dataclass
class ResponsesRequest:
    """A valid Responses request: the chat generation, and what the response object repeats."""

    gen: Generation
    echo: dict[str, Any]
    namespaces: dict[str, str] = field(default_factory=dict)  # a function's namespace, for its calls

    @property
    def parse_tools(self) -> bool:
        """Tools are offered (not ``tool_choice: "none"``): the answer may hold calls, so it is
        parsed whole, after generation, and only then streamed."""
        return self.gen.tools is not None


# ----------------------------------------------------------------------------- the request


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    return value is None or any(
        value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults
    )


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in _SERVED or name in _HARMLESS:
            continue
        if name in _REFUSED:
            defaults, why = _REFUSED[name]
            if _is_default(value, defaults):
                continue
            raise bad(name, why)
        raise bad(name, f"{shown(name)} is not supported on /v1/responses")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text parts (``input_text`` / ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "content must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}]", f"only text content is supported, not {shown(kind)}")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", f"'{key}' must be a string")
    return value


def _item_message(item: Any, where: str, messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One input item as a chat message; None when it joined the previous one (a function call
    after an assistant message, or after another call: one assistant turn with its calls) or is
    left out (a reasoning item)."""
    if not isinstance(item, dict):
        raise bad(where, "each input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise bad(f"{where}.role", f"unknown role {shown(role)}")
        return {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        arguments = _string(item, "arguments", where)
        # Checked here against the body's JSON limits, to name this item's field (chat parses the
        # text again, as it does its own calls'); text that is no JSON passes, as on chat.
        parse_json(arguments, f"{where}.arguments", not_json=None)
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "reasoning":  # a reasoning item replayed from an output: the templates drop past
        return None          # reasoning themselves, and chat's history keeps none either
    if kind == "function_call_output":
        # Codex echoes tool results that answer no call of the model's (its goals): no call_id, or
        # an empty one. The result still goes to the model, as a tool message answering no call.
        call_id = "" if item.get("call_id") is None else _string(item, "call_id", where)
        message = {"role": "tool", "tool_call_id": call_id,
                   "content": _text(item.get("output"), f"{where}.output")}
        if isinstance(item.get("name"), str):
            message["name"] = item["name"]
        return message
    if kind == "item_reference":
        raise bad(where, f"{_STORED}: an item_reference cannot be resolved; send the item itself")
    raise bad(f"{where}.type", f"input items of type {shown(kind)} are not supported")


def input_messages(instructions: Any, input_: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages, and for each the Responses field it came from (to name it in errors)."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if isinstance(input_, str):
        return [*messages, {"role": "user", "content": input_}], [*origins, "input"]
    if not isinstance(input_, list) or not input_:
        raise bad("input", "'input' must be a string or a non-empty list of items")
    if len(input_) > MAX_MESSAGES:  # chat's cap, before each item is looked at
        raise too_many("input", len(input_), MAX_MESSAGES)
    for i, item in enumerate(input_):
        message = _item_message(item, f"input[{i}]", messages)
        if message is not None:
            messages.append(message)
            origins.append(f"input[{i}]")
    return messages, origins


@dataclass
class OfferedTools:
    """A Responses ``tools`` list as chat tools, with what was left out and where functions live."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # chat-shaped function tools
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {"param", "type", "name"?}
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace
    origins: list[str] = field(default_factory=list)  # where each chat tool is in the body

    def add(self, tool: dict[str, Any], where: str) -> None:
        self.tools.append(_function_tool(tool, where))
        self.origins.append(where)


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A flat function tool as a chat tool; a key colibri cannot honour is a 400 naming it."""
    for key in sorted(set(tool) - set(_TOOL_KEYS)):  # sorted: the same key named every time
        if key not in _TOOL_NEUTRAL:
            raise bad(where, f"'{where}' has unknown key {shown(key)}")
        if not _is_default(tool[key], _TOOL_NEUTRAL[key]):
            raise bad(f"{where}.{key}", f"'{where}.{key}' is not supported (tool search and "
                                        "programmatic tool calls are not served)")
    return {"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS[1:] if tool.get(k) is not None}}


def _dropped(tool: dict[str, Any], kind: Any, where: str) -> dict[str, Any]:
    """What the ``colibri`` block says of a tool the model is not offered."""
    out = {"param": where, "type": kind}
    if isinstance(tool.get("name"), str):
        out["name"] = tool["name"]
    return out


def _namespace(tool: dict[str, Any], where: str, offered: OfferedTools) -> None:
    """A ``namespace`` group (Codex's): its function tools are offered under their own names, and
    each call the model makes of one names its namespace; its other tools are dropped."""
    name, members = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not isinstance(members, list):
        raise bad(where, f"'{where}' (a namespace) needs a string 'name' and a list 'tools'")
    for j, member in enumerate(members):
        kind = member.get("type") if isinstance(member, dict) else type(member).__name__
        if kind != "function":
            offered.dropped.append(_dropped(member if isinstance(member, dict) else {}, kind,
                                            f"{where}.tools[{j}]"))
            continue
        offered.add(member, f"{where}.tools[{j}]")
        if isinstance(member.get("name"), str):
            offered.namespaces[member["name"]] = name


def chat_tools(tools: Any) -> OfferedTools:
    """Function tools (flat, or in a ``namespace``) -> chat tools. A tool of another type is one the
    model cannot call here (a hosted tool such as ``web_search``, a ``custom`` tool): it is not
    offered, and the answer lists it. With tools left out the answer is not silently another one:
    the model is told only of what it can call, and the client is told what was dropped."""
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list")
    if len(tools) > MAX_TOOLS:
        raise too_many("tools", len(tools), MAX_TOOLS)
    offered = OfferedTools()
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise bad(f"tools[{i}]", f"'tools[{i}]' must be an object with a string 'type'")
        if kind == "function":
            offered.add(tool, f"tools[{i}]")
        elif kind == "namespace":
            _namespace(tool, f"tools[{i}]", offered)
        else:
            offered.dropped.append(_dropped(tool, kind, f"tools[{i}]"))
    return offered


def chat_tool_choice(choice: Any) -> Any:
    """"auto" / "none" / "required" as they are; ``{"type": "function", "name"}`` in chat's shape."""
    if isinstance(choice, str) or choice is None:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                             "{'type': 'function', 'name': ...}")


def response_format(text: Any) -> tuple[dict[str, Any] | None, Any]:
    """``text.format`` as chat's ``response_format`` (None: plain text), and ``text.verbosity``."""
    if text is None:
        return None, None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad("text", "'text' may only hold 'format' and 'verbosity'")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None, text.get("verbosity")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}, text.get("verbosity")
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}, text.get("verbosity")
    raise bad("text.format", "'text.format' must be of type 'text', 'json_object' or 'json_schema'")


def reasoning_effort(reasoning: Any) -> str | None:
    """``reasoning.effort`` (the template's thinking switch). ``summary`` (and the older
    ``generate_summary``) is accepted at OpenAI's values: colibri writes no summary, the reasoning
    item carries the whole reasoning (its ``summary`` is ``[]``), which is what a summary stands for."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad("reasoning", "'reasoning' must be an object")
    for name in sorted(set(reasoning) - {"effort"}):
        value = reasoning[name]
        if value is None:
            continue
        if name not in ("summary", "generate_summary"):
            raise bad(f"reasoning.{name}", f"'reasoning.{name}' is not supported")
        if value not in _SUMMARIES:
            raise bad(f"reasoning.{name}", f"'reasoning.{name}' must be one of {', '.join(_SUMMARIES)}")
    return reasoning.get("effort")


def check_include(include: Any) -> None:
    """``include``: a list of what to add to the output. Accepted when there is nothing to add
    (``_NOTHING_TO_INCLUDE``); asking for logprobs, which this endpoint does not give, is a 400."""
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("include", "'include' must be a list of strings")
    for i, value in enumerate(include):
        if value not in _NOTHING_TO_INCLUDE:
            why = ("logprobs are not supported on /v1/responses (use /v1/chat/completions)"
                   if value == "message.output_text.logprobs" else f"{shown(value)} is not supported")
            raise bad(f"include[{i}]", f"'include[{i}]': {why}")


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[str], OfferedTools]:
    """The chat-completions body of a Responses body, each message's origin (for errors), and the
    tools as offered (what was dropped, the namespaces of the functions)."""
    messages, origins = input_messages(body.get("instructions"), body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    chat.update({k: body[k] for k in _SAME if body.get(k) is not None})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    offered = chat_tools(body["tools"]) if body.get("tools") else OfferedTools()
    if offered.tools:
        chat["tools"] = offered.tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt, verbosity = response_format(body.get("text"))
    chat.update({k: v for k, v in (("response_format", fmt), ("verbosity", verbosity)) if v is not None})
    effort = reasoning_effort(body.get("reasoning"))
    check_include(body.get("include"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat, origins, offered


def renamed(err: ApiError, origins: list[str], tool_origins: list[str] | None = None) -> ApiError:
    """``parse_chat``'s error, naming the Responses field: ``messages[k]`` -> where message k
    came from, ``max_tokens`` -> ``max_output_tokens``... (in the message's quotes too);
    ``tool_origins``: where each chat tool came from (``tools[2].tools[0]`` in a namespace)."""
    param = err.param or ""
    m = _MESSAGE_PARAM.match(param)
    if m and int(m[1]) < len(origins):
        new = origins[int(m[1])] + param[m.end():]
    elif param == "messages":
        new = "input"
    else:
        new = _RENAMED.get(param, param)
    message = err.message.replace(f"'{param}'", f"'{new}'") if param else err.message
    if new.startswith("tools"):  # chat nests a tool's fields in "function"; here they are flat
        message = message.replace(".function.", ".").replace(".function'", "'")
        if tool_origins:
            message = _TOOL_INDEX.sub(lambda t: _tool_origin(t, tool_origins), message)
    return ApiError(err.status, message, new if param else err.param, err.type, err.code)


def _tool_origin(match: re.Match[str], tool_origins: list[str]) -> str:
    k = int(match[1])
    return f"'{tool_origins[k]}" if k < len(tool_origins) else match[0]


def echo(body: dict[str, Any], gen: Generation) -> dict[str, Any]:
    """The request fields the response object repeats, with their defaults filled in."""
    text, reasoning = body.get("text") or {}, body.get("reasoning") or {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is True,  # tools.py's default
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "temperature": gen.temperature,
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": gen.top_p,
        "user": body.get("user"),
    }


def parse(body: Any, render: Render, n_ctx: int, n_slots: int) -> ResponsesRequest:
    """A Responses body -> a ``ResponsesRequest``, or an ``ApiError`` naming the Responses field."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    _check_fields(body)
    chat, origins, offered = to_chat(body)
    try:
        gen = parse_chat(chat, render, n_ctx, n_slots)
    except ApiError as e:
        raise renamed(e, origins, offered.origins) from None
    gen.prompt_field = "input"
    if offered.dropped:
        gen.notes["dropped_tools"] = offered.dropped
    return ResponsesRequest(gen, echo(body, gen), offered.namespaces)
