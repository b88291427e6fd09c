"""The text side of a model file: vocabulary, chat template and context length, without weights.

The HTTP server renders prompts and counts tokens with it in its own process, where loading the
weights (and numba) would cost memory and start-up for nothing; the engine's ``Model`` uses it too.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from colibri.model.chat import ChatTemplate
from colibri.model.tokenizer import GGUFTokenizer
from colibri.store.gguf import GGUFFile


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
        return ChatTemplate(self.gguf.get("tokenizer.chat_template"), bos, eos)

    def render(self, messages: list[dict[str, Any]], enable_thinking: bool = False) -> str:
        """The prompt for ``messages``, ending with the assistant's turn opened."""
        return self.chat_template.render(messages, enable_thinking=enable_thinking)

    def count_tokens(self, prompt: str) -> int:
        """Tokens of a rendered prompt, as the engine will count them (special tokens parsed)."""
        return len(self.tokenizer.encode(prompt, special=True))
