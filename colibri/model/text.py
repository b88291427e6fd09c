"""The text side of a model file: vocabulary, chat template and context length, without weights.

The HTTP server renders prompts and counts tokens with it in its own process, where loading the
weights (and numba) would cost memory and start-up for nothing; the engine's ``Model`` uses it too.

The trust rule: text from a client is data. ``encode_chat`` renders the template with a sentinel in
place of each message's content, so it knows which spans of the prompt are the template's markup
(tokenized with special tokens recognised) and which are client text (tokenized as plain text:
``<|im_end|>`` typed by a user is ten characters, never the end of a turn). A boundary between
markup and client text is also a token boundary. What a template renders of a client's tools and
tool calls (names, descriptions, schemas, arguments) is markup too, so ``render`` refuses any of it
that holds a control token's text (``ClientMarkupError``, the server's 400).
"""

from __future__ import annotations

import json
import re
import uuid
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from colibri.errors import ColibriError
from colibri.model.chat import BUILTIN_TEMPLATES, ChatTemplate
from colibri.model.harmony import speaks_harmony
from colibri.model.tokenizer import GGUFTokenizer
from colibri.store.gguf import GGUFFile

_PLACEHOLDER = "x"  # the content of the placeholder messages: only their count matters


class Segment(NamedTuple):
    text: str
    markup: bool  # the template's own text (special tokens recognised), else a client's (plain)


class ClientMarkupError(ColibriError):
    """A client's text that the template would render as markup holds a control token's text."""

    def __init__(self, field: str, token: str) -> None:
        super().__init__(f"{field} holds {token!r}, a control token of this model's vocabulary: "
                         "rendered by the chat template it would be markup, not data")
        self.field = field


class ModelText:
    """Tokenizer and template built on first use: ``--prompt-ids`` runs need neither, and test
    models may carry no vocabulary."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf

    @classmethod
    def open(cls, path: Path) -> ModelText:
        return cls(GGUFFile(path))

    @property
    def context_length(self) -> int | None:
        """The model's trained context, or None when the file does not say."""
        arch = self.gguf.get("general.architecture")
        value = self.gguf.get(f"{arch}.context_length")
        return None if value is None else int(value)

    @cached_property
    def tokenizer(self) -> GGUFTokenizer:
        return GGUFTokenizer(self.gguf)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        tok = self.tokenizer
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        builtin = BUILTIN_TEMPLATES.get(str(self.gguf.get("general.architecture")))
        return ChatTemplate(self.gguf.get("tokenizer.chat_template") or builtin, bos, eos)

    @property
    def template_uses_tools(self) -> bool:
        """The template renders ``tools`` itself and writes Hermes/Qwen ``<tool_call>`` markers, or
        harmony's calls (which the server turns into those markers), the ones the server parses
        back; other templates get the server's generic tool format."""
        template = self.chat_template
        return template.takes_tools and ("<tool_call>" in template.source
                                         or speaks_harmony(template.source))

    @cached_property
    def _control_texts(self) -> tuple[str, ...]:
        tok = self.tokenizer
        return tuple(t for t, ty in zip(tok.tokens, tok.types, strict=True) if ty in tok.parsed_types and t)

    def _check_data(self, field: str, value: Any) -> None:
        """The trust rule for what the template renders as markup: no control token's text."""
        text = json.dumps(value, ensure_ascii=False)
        for token in self._control_texts:
            if token in text:
                raise ClientMarkupError(field, token)

    def render(
        self, messages: list[dict[str, Any]], enable_thinking: bool | None = False,
        tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages`` (and ``tools``, for a template that takes them), ending
        with the assistant's turn opened. ``enable_thinking`` None: not passed (the template's
        default); ``template_kwargs``: a client's other variables, markup too (the trust rule)."""
        for i, m in enumerate(messages):
            extra = {k: v for k, v in m.items() if k not in ("role", "content")}
            if extra:
                self._check_data(f"messages[{i}]", extra)
        variables = dict(template_kwargs or {})
        if variables:
            self._check_data("chat_template_kwargs", variables)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        if tools is not None:
            self._check_data("tools", tools)
            variables["tools"] = tools
        return self.chat_template.render(messages, **variables)

    def count_tokens(self, prompt: str) -> int:
        """Tokens of a rendered prompt, as the engine will count them (special tokens parsed)."""
        return len(self.tokenizer.encode(prompt, special=True))

    def render_segments(
        self, messages: list[dict[str, Any]], enable_thinking: bool | None = False,
        tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
    ) -> list[Segment]:
        """The prompt for ``messages`` as markup and client-text spans, in order. A template that
        transforms a message's content (strips part of it, say) sees the sentinel instead: the
        content then goes in whole, as data, where the sentinel came out. Empty content stays
        empty (a template tests it: an assistant turn of tool calls only)."""
        nonce = uuid.uuid4().hex
        sentinel = re.compile(f"\x00{nonce}:([0-9]+)\x00")
        masked = [{**m, "content": f"\x00{nonce}:{i}\x00"} if m.get("content") else m
                  for i, m in enumerate(messages)]
        rendered = self.render(masked, enable_thinking, tools, template_kwargs)
        segments, at = [], 0
        for match in sentinel.finditer(rendered):
            segments.append(Segment(rendered[at : match.start()], True))
            segments.append(Segment(str(messages[int(match.group(1))]["content"]), False))
            at = match.end()
        segments.append(Segment(rendered[at:], True))
        return [seg for seg in segments if seg.text]

    def continuation_segments(
        self, prev_role: str | None, messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[Segment]:
        """``messages`` as they follow a conversation that ends with a ``prev_role`` message (None:
        nothing yet), for a session whose context only grows (Channel): rendered behind placeholder
        messages ending with that role, and cut after the placeholders' content."""
        if prev_role is None:
            placeholders: list[dict[str, Any]] = []
        elif prev_role == "assistant":
            placeholders = [{"role": "user", "content": _PLACEHOLDER},
                            {"role": "assistant", "content": _PLACEHOLDER}]
        else:
            placeholders = [{"role": "user", "content": _PLACEHOLDER},
                            {"role": "assistant", "content": _PLACEHOLDER},
                            {"role": prev_role, "content": _PLACEHOLDER}]
        rendered = self.render_segments(placeholders + messages, tools=tools)
        skip = len(placeholders)
        for i, seg in enumerate(rendered):
            if skip == 0:
                return rendered[i:]
            if not seg.markup:
                skip -= 1
        return []

    def encode_segments(self, segments: list[Segment], limit: int | None = None) -> list[int]:
        """The one way from rendered segments to ids, for every front end: markup with control
        tokens recognised, client text as plain text; one prompt (SentencePiece's space prefix at
        its start only). ``limit``: ``TooManyTokens`` for a text too long to fit, untokenized."""
        return self.tokenizer.encode_segments(((seg.text, seg.markup) for seg in segments), limit=limit)

    def encode_chat(
        self, messages: list[dict[str, Any]], enable_thinking: bool | None = False,
        tools: list[dict[str, Any]] | None = None, limit: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt: the template's markup may hold control tokens, the
        messages' content never does."""
        segments = self.render_segments(messages, enable_thinking, tools, template_kwargs)
        return self.encode_segments(segments, limit)

    def encode_text(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of a client's raw text (``/v1/completions``): data, no control tokens; BOS
        first when the file asks for it (Llama-2, Mistral), as llama.cpp's server adds it."""
        return self.tokenizer.encode_segments([(text, False)], add_special=True, limit=limit)
