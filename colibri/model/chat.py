"""The model's chat template (``tokenizer.chat_template``), rendered in jinja2's sandbox.

Templates come from model files, i.e. from strangers: the immutable sandbox keeps them from
reaching Python internals or mutating what they are given.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibri.errors import ColibriError

# ChatML, for models whose file carries no template.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's turns, for Gemma files that carry no template (GGUF-my-repo's Gemma 3 270M has none):
# ``<start_of_turn>user|model``, no system role: system text joins the next user turn after a blank
# line, as llama.cpp's built-in "gemma" template and Google's own template put it.
GEMMA_TEMPLATE = (
    "{{- bos_token -}}{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system ~ (message['content'] | trim) -%}"
    "{%- else -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' ~ role ~ '\n' -}}"
    "{%- if ns.system and role != 'model' -%}"
    "{{- ns.system ~ '\n\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
    "{{- (message['content'] or '') | trim -}}{{- '<end_of_turn>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
# general.architecture -> the template of a file without one (others: ChatML).
BUILTIN_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}


class ChatTemplateError(ColibriError):
    pass


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: the tools' JSON as the model was trained on it (jinja's own sorts
    the keys and escapes ``<`` as ``\\u003c``, for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or DEFAULT_TEMPLATE
        try:
            self._template = env.from_string(self.source)
            # Whether the template reads ``tools`` (as transformers passes them): its own tool format.
            self.takes_tools = "tools" in meta.find_undeclared_variables(env.parse(self.source))
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not parse: {e}") from None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._tokens, **extra
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is foreign code: any failure is the template's
            raise ChatTemplateError(f"chat template failed: {e}") from None
