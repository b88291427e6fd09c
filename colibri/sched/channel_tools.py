"""The Channel session's tools (SET_SYSTEM's ``tools``): how they are offered, forced and read back.

Tools are described in the system message and called with ``tool_format``'s markers,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as plain text: that works with any
chat template, the default model's included (whose template knows no tools). ``tool_choice`` (a
key of ours in SET_SYSTEM's object: ``"auto"``, the default, or ``"required"``) decides whether the
answer may be text: with ``"required"`` it is held by ``tool_format``'s grammar to one call of a
declared tool, its arguments valid for the tool's schema. A call is read back only at the start of
the answer. The wording, grammar and parser are the HTTP server's own (``colibri.model.tool_format``).
"""

from __future__ import annotations

from typing import Any

from colibri.model.tool_format import CALL_CLOSE, CALL_OPEN, ToolSet

__all__ = ["CALL_CLOSE", "CALL_OPEN", "MODES", "Tools"]

MODES = ("auto", "required")


class Tools:
    """SET_SYSTEM's object (None: no SET_SYSTEM yet) as the session uses it."""

    def __init__(self, system: dict[str, Any] | None) -> None:
        self.system = system
        raw = (system or {}).get("tools") or []
        self.tools: list[dict[str, Any]] = [t for t in raw if isinstance(t, dict)]
        choice = (system or {}).get("tool_choice", "auto")
        self.mode = "none" if not self.tools else choice if choice in MODES else "auto"
        self.format = ToolSet(tuple(self.tools), required=self.mode == "required")

    @property
    def names(self) -> set[str]:
        return set(self.format.names)

    def system_text(self) -> str | None:
        """The system message: the instructions, then the tools and how to call them."""
        if self.system is None:
            return None
        text = str(self.system.get("instructions") or "")
        if self.tools:
            text += ("\n\n" if text else "") + self.format.marker_instructions()
        return text or None

    def grammar(self) -> str:
        """A call of one of the tools, its arguments held to the tool's schema."""
        return self.format.marker_grammar()

    def parse(self, content: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of the call ``content`` starts with, or None if it is not one."""
        _, calls = self.format.read_markers(content)
        return (calls[0].name, calls[0].arguments) if calls else None
