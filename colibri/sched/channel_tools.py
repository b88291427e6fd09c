"""The Channel session's tools (SET_SYSTEM's ``tools``): how they are offered, forced and read back.

Tools are described in the system message and called with Hermes markers,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as plain text: that works with any
chat template, the default model's included (whose template knows no tools). ``tool_choice`` (a
key of ours in SET_SYSTEM's object: ``"auto"``, the default, or ``"required"``) decides whether the
answer may be text: with ``"required"`` it is held by a grammar (llguidance's Lark, the same
machinery as the HTTP server's structured outputs) to one call of a declared tool, its arguments
valid for the tool's schema. A call is read back only at the start of the answer.
"""

from __future__ import annotations

import json
from typing import Any

from colibri.model.json_grammar import json_item

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MODES = ("auto", "required")


class Tools:
    """SET_SYSTEM's object (None: no SET_SYSTEM yet) as the session uses it."""

    def __init__(self, system: dict[str, Any] | None) -> None:
        self.system = system
        raw = (system or {}).get("tools") or []
        self.tools: list[dict[str, Any]] = [t for t in raw if isinstance(t, dict)]
        choice = (system or {}).get("tool_choice", "auto")
        self.mode = "none" if not self.tools else choice if choice in MODES else "auto"

    @property
    def names(self) -> set[str]:
        return {str(t.get("name")) for t in self.tools}

    def system_text(self) -> str | None:
        """The system message: the instructions, then the tools and how to call them."""
        if self.system is None:
            return None
        text = str(self.system.get("instructions") or "")
        if self.tools:
            listed = json.dumps([{k: t[k] for k in ("name", "description", "parameters") if k in t}
                                 for t in self.tools], ensure_ascii=False)
            text += ("\n\n" if text else "") + (
                "You can call these tools (each with the JSON schema of its arguments):\n" + listed +
                f'\nTo call one, answer with {CALL_OPEN}{{"name": "<tool name>", "arguments": {{...}}}}'
                f"{CALL_CLOSE} and nothing else. Its result comes back in a tool message.")
        return text or None

    def grammar(self) -> str:
        """A call of one of the tools, its arguments held to the tool's schema."""
        calls = [{"type": "object",
                  "properties": {"name": {"const": t["name"]},
                                 "arguments": t.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in self.tools]
        schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
        return f"start: {json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}\ncall: {json_item(schema)}\n"

    def parse(self, content: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of the call ``content`` starts with, or None if it is not one."""
        body = content.strip()[len(CALL_OPEN):]
        body = body[: body.find(CALL_CLOSE)] if CALL_CLOSE in body else body
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names:
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)
