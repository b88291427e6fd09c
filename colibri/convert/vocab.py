"""The vocabulary a converted model carries: a checkpoint's byte-level BPE, or a placeholder.

A ``tokenizer.json`` whose model is byte-level BPE (GPT-2 style, as Qwen, GLM, Llama 3 and most
recent models ship) becomes ``tokenizer.ggml.model = "gpt2"`` with the tokens, token types,
merges, pre-tokenizer name, special ids and chat template, which both colibri's tokenizer and
llama.cpp read. Anything else (no tokenizer.json, a SentencePiece-style or other model) gets a
placeholder: ``tokenizer.ggml.model = "none"`` and ``<tok_N>`` names, which llama.cpp loads as
dummy tokens and colibri runs with ``--prompt-ids``; converting says so in one warning line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from colibri.convert.architectures import ConvertError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PLACEHOLDER_MODEL = "none"

# Pre-tokenizer regexes of tokenizer.json -> llama.cpp's tokenizer.ggml.pre name (llama-vocab.cpp
# applies the matching split). A byte-level BPE whose regex is none of these is written as GPT-2's
# ("gpt-2") with a warning: its text splits may differ from the checkpoint's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
PRE_BY_REGEX: dict[str, str] = {_LLAMA3_SPLIT: "llama3", _QWEN2_SPLIT: "qwen2"}
GPT2_PRE = "gpt-2"  # llama.cpp's name for GPT-2's split (colibri's tokenizer defaults to the same)


@dataclass
class Vocab:
    model: str
    tokens: list[str]
    types: list[int] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool | None = None
    chat_template: str | None = None
    warning: str | None = None  # what the user should know, one line

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.types:
            w.add_token_types(self.types)
        if self.merges:
            w.add_token_merges(self.merges)
        if self.bos_id is not None:
            w.add_bos_token_id(self.bos_id)
        if self.eos_id is not None:
            w.add_eos_token_id(self.eos_id)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def placeholder(n_vocab: int, why: str, config: dict[str, Any]) -> Vocab:
    """``<tok_N>`` names: no text runs through them, ids do (``--prompt-ids``)."""
    return Vocab(
        PLACEHOLDER_MODEL, [f"<tok_{i}>" for i in range(n_vocab)],
        bos_id=_config_id(config, "bos_token_id"), eos_id=_config_id(config, "eos_token_id"),
        warning=f"{why}; writing a placeholder vocabulary of {n_vocab} tokens (run it with --prompt-ids)",
    )


def _config_id(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read ({e})") from None


def _is_byte_level(tok: dict[str, Any]) -> bool:
    def has(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(child) for key in ("pretokenizers", "decoders") for child in node.get(key) or [])

    return has(tok.get("pre_tokenizer")) or has(tok.get("decoder"))


def _pre_name(tok: dict[str, Any]) -> str | None:
    """llama.cpp's name for the pre-tokenizer; None when it is not one we know."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    steps = [s for s in steps or [] if isinstance(s, dict)]
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not regexes and byte_level and byte_level[0].get("use_regex", True):
        return GPT2_PRE  # ByteLevel's own regex is GPT-2's word split
    if len(regexes) == 1 and regexes[0] in PRE_BY_REGEX:
        return PRE_BY_REGEX[regexes[0]]
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(hf_dir: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}], "default" first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not template and (hf_dir / CHAT_TEMPLATE_FILE).is_file():
        template = (hf_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return template if isinstance(template, str) and template else None


def load_vocab(hf_dir: Path, config: dict[str, Any], n_vocab: int) -> Vocab:
    """The vocabulary for a model of ``n_vocab`` embedding rows, from ``hf_dir``."""
    try:
        return _load_vocab(hf_dir, config, n_vocab)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConvertError(f"{hf_dir / TOKENIZER_JSON}: malformed tokenizer ({e!r})") from None


def _load_vocab(hf_dir: Path, config: dict[str, Any], n_vocab: int) -> Vocab:
    path = hf_dir / TOKENIZER_JSON
    if not path.is_file():
        return placeholder(n_vocab, f"{hf_dir} has no {TOKENIZER_JSON}", config)
    tok = _read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(tok) or not isinstance(model.get("vocab"), dict):
        return placeholder(n_vocab, f"{path} is not a byte-level BPE tokenizer, which is all convert writes",
                           config)
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    special: set[int] = set()
    user: set[int] = set()
    for added in tok.get("added_tokens") or []:
        by_id[added["id"]] = added["content"]
        (special if added.get("special") else user).add(added["id"])
    if by_id and max(by_id) >= n_vocab:
        raise ConvertError(f"{path}: token id {max(by_id)} is outside the model's {n_vocab} embedding rows")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:  # embedding rows past the tokenizer: padding, as llama.cpp names them
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        tokens.append(by_id[i])
        kind = gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED if i in user \
            else gguf.TokenType.NORMAL
        types.append(int(kind))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    tok_config = _read_json(hf_dir / TOKENIZER_CONFIG) if (hf_dir / TOKENIZER_CONFIG).is_file() else {}
    ids = {t: i for i, t in enumerate(tokens)}

    def special_id(name: str) -> int | None:
        text = _token_text(tok_config.get(f"{name}_token"))
        return ids.get(text) if text is not None else _config_id(config, f"{name}_token_id")

    pre = _pre_name(tok)
    vocab = Vocab(
        "gpt2", tokens, types, merges, pre or GPT2_PRE, special_id("bos"), special_id("eos"),
        bool(tok_config["add_bos_token"]) if "add_bos_token" in tok_config else None,
        _chat_template(hf_dir, tok_config),
    )
    if pre is None:
        vocab.warning = f"{path}: unknown pre-tokenizer, written as {GPT2_PRE!r} (text may split differently)"
    return vocab
