"""The vocabulary a converted model carries: a checkpoint's byte-level BPE or SentencePiece, or a
placeholder.

A ``tokenizer.json`` whose model is byte-level BPE (GPT-2 style, as Qwen, GLM, Llama 3 and most
recent models ship) becomes ``tokenizer.ggml.model = "gpt2"`` with the tokens, token types,
merges, pre-tokenizer name, special ids and chat template, which both colibri's tokenizer and
llama.cpp read. A SentencePiece-style one (BPE with ``byte_fallback`` and ``▁`` for spaces: Llama 2,
Mistral, Mixtral), or a ``tokenizer.model`` without a tokenizer.json, becomes ``"llama"``: tokens,
scores, token types, special ids, add_bos/add_eos and add_space_prefix. Anything
else gets a placeholder: ``tokenizer.ggml.model = "none"`` and ``<tok_N>`` names, which llama.cpp
loads as dummy tokens and colibri runs with ``--prompt-ids``; converting says so in one warning line.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from colibri.convert.checkpoint_config import ConvertError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_MODEL = "tokenizer.model"  # SentencePiece's protobuf
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
    scores: list[float] = field(default_factory=list)
    unk_id: int | None = None
    pad_id: int | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.types:
            w.add_token_types(self.types)
        if self.scores:
            w.add_token_scores(self.scores)
        if self.merges:
            w.add_token_merges(self.merges)
        for ident, add in ((self.bos_id, w.add_bos_token_id), (self.eos_id, w.add_eos_token_id),
                           (self.unk_id, w.add_unk_token_id), (self.pad_id, w.add_pad_token_id)):
            if ident is not None:
                add(ident)
        for flag, add_flag in ((self.add_bos, w.add_add_bos_token), (self.add_eos, w.add_add_eos_token),
                               (self.add_space_prefix, w.add_add_space_prefix)):
            if flag is not None:
                add_flag(flag)
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
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, struct.error) as e:
        name = TOKENIZER_JSON if (hf_dir / TOKENIZER_JSON).is_file() else TOKENIZER_MODEL
        raise ConvertError(f"{hf_dir / name}: malformed tokenizer ({e!r})") from None


def _load_vocab(hf_dir: Path, config: dict[str, Any], n_vocab: int) -> Vocab:
    path = hf_dir / TOKENIZER_JSON
    tok_config = _read_json(hf_dir / TOKENIZER_CONFIG) if (hf_dir / TOKENIZER_CONFIG).is_file() else {}
    if not path.is_file():
        if (hf_dir / TOKENIZER_MODEL).is_file():
            return _sentencepiece_model(hf_dir, config, tok_config, n_vocab)
        return placeholder(n_vocab, f"{hf_dir} has no {TOKENIZER_JSON}", config)
    tok = _read_json(path)
    model = tok.get("model") or {}
    if model.get("type") == "BPE" and isinstance(model.get("vocab"), dict):
        if _is_byte_level(tok):
            return _byte_level(hf_dir, tok, config, tok_config, n_vocab)
        prefix = _space_prefix(tok)
        if model.get("byte_fallback") and prefix is not None:
            return _sentencepiece_bpe(hf_dir, tok, config, tok_config, n_vocab, prefix)
    return placeholder(n_vocab, f"{path} is not a byte-level BPE nor a SentencePiece-style one, "
                       "which is all convert writes", config)


def _by_id(tok: dict[str, Any], path: Path, n_vocab: int) -> tuple[dict[int, str], set[int], set[int]]:
    """Token text by id (the model's vocabulary and the added tokens), and the added ids, special
    and not."""
    by_id: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    special: set[int] = set()
    user: set[int] = set()
    for added in tok.get("added_tokens") or []:
        by_id[added["id"]] = added["content"]
        (special if added.get("special") else user).add(added["id"])
    if by_id and max(by_id) >= n_vocab:
        raise ConvertError(f"{path}: token id {max(by_id)} is outside the model's {n_vocab} embedding rows")
    return by_id, special, user


def _special_ids(tokens: list[str], config: dict[str, Any], tok_config: dict[str, Any]):
    """``special_id(name)``: the id of tokenizer_config.json's ``{name}_token``, else config.json's
    ``{name}_token_id``."""
    ids = {t: i for i, t in enumerate(tokens)}

    def special_id(name: str) -> int | None:
        text = _token_text(tok_config.get(f"{name}_token"))
        return ids.get(text) if text is not None else _config_id(config, f"{name}_token_id")

    return special_id


def _byte_level(hf_dir: Path, tok: dict[str, Any], config: dict[str, Any], tok_config: dict[str, Any],
                n_vocab: int) -> Vocab:
    path = hf_dir / TOKENIZER_JSON
    by_id, special, user = _by_id(tok, path, n_vocab)
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
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges") or []]
    special_id = _special_ids(tokens, config, tok_config)
    pre = _pre_name(tok)
    vocab = Vocab(
        "gpt2", tokens, types, merges, pre or GPT2_PRE, special_id("bos"), special_id("eos"),
        bool(tok_config["add_bos_token"]) if "add_bos_token" in tok_config else None,
        _chat_template(hf_dir, tok_config),
    )
    if pre is None:
        vocab.warning = f"{path}: unknown pre-tokenizer, written as {GPT2_PRE!r} (text may split differently)"
    return vocab


# --- SentencePiece ("llama") ----------------------------------------------------------------------

SPM_MODEL = "llama"
SPM_PRE = "default"  # llama.cpp's converter writes it; its SentencePiece tokenizer has no pre-split
SPACE = "\u2581"  # ▁
ADDED_SCORE = -1000.0  # added tokens and padding rows of a tokenizer.model, as llama.cpp's converter
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_T = gguf.TokenType


def _steps(node: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(node, dict):
        return []
    if node.get("type") != "Sequence":
        return [node]
    return [s for s in node.get(key) or [] if isinstance(s, dict)]


def _space_prefix(tok: dict[str, Any]) -> bool | None:
    """Whether a SentencePiece-style tokenizer.json puts ``▁`` in front of the text (a Metaspace
    pre-tokenizer's prepend_scheme, or Llama 2's Prepend normalizer); None if it is not one."""
    for step in _steps(tok.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") == "Metaspace":
            if "prepend_scheme" in step:
                return step["prepend_scheme"] != "never"
            return bool(step.get("add_prefix_space", True))
    norms = _steps(tok.get("normalizer"), "normalizers")
    if any(n.get("type") == "Replace" and n.get("content") == SPACE for n in norms):
        return any(n.get("type") == "Prepend" and n.get("prepend") == SPACE for n in norms)
    return None


def _add_flags(tok: dict[str, Any], tok_config: dict[str, Any], bos: str | None,
               eos: str | None) -> tuple[bool | None, bool | None]:
    """add_bos / add_eos: the post-processor's template, overridden by tokenizer_config.json."""
    add_bos = add_eos = None
    for proc in _steps(tok.get("post_processor"), "processors"):
        single = proc.get("single") if proc.get("type") == "TemplateProcessing" else None
        if not isinstance(single, list):
            continue
        names = [e.get("SpecialToken", {}).get("id") if isinstance(e, dict) else None for e in single]
        seq = next((k for k, e in enumerate(single) if isinstance(e, dict) and "Sequence" in e), len(single))
        add_bos, add_eos = bos is not None and bos in names[:seq], eos is not None and eos in names[seq + 1 :]
    if "add_bos_token" in tok_config:
        add_bos = bool(tok_config["add_bos_token"])
    if "add_eos_token" in tok_config:
        add_eos = bool(tok_config["add_eos_token"])
    return add_bos, add_eos


def _spm_vocab(hf_dir: Path, tok: dict[str, Any], config: dict[str, Any], tok_config: dict[str, Any],
               tokens: list[str], types: list[int], scores: list[float]) -> Vocab:
    """The "llama" vocabulary of ``tokens``: special ids and flags from the configs."""
    special_id = _special_ids(tokens, config, tok_config)
    bos, eos, unk = special_id("bos"), special_id("eos"), special_id("unk")
    if unk is None:
        unk = next((i for i, ty in enumerate(types) if ty == _T.UNKNOWN), None)
    add_bos, add_eos = _add_flags(tok, tok_config, tokens[bos] if bos is not None else None,
                                  tokens[eos] if eos is not None else None)
    return Vocab(SPM_MODEL, tokens, types, [], SPM_PRE, bos, eos, add_bos, _chat_template(hf_dir, tok_config),
                 scores=scores, unk_id=unk, pad_id=special_id("pad"), add_eos=add_eos)


def _sentencepiece_bpe(hf_dir: Path, tok: dict[str, Any], config: dict[str, Any], tok_config: dict[str, Any],
                       n_vocab: int, prefix: bool) -> Vocab:
    """A byte-fallback BPE with ``▁`` for spaces. Scores: minus the rank of the first merge that
    makes a token (what llama.cpp's highest-score-first merging needs to merge in the BPE's order),
    below every merge for tokens no merge makes."""
    path = hf_dir / TOKENIZER_JSON
    by_id, special, user = _by_id(tok, path, n_vocab)
    model = tok["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    rank: dict[str, int] = {}
    for r, (a, b) in enumerate(merges):
        rank.setdefault(a + b, r)
    floor = -float(len(merges))
    tokens, types, scores = [], [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:  # embedding rows past the tokenizer: padding, as llama.cpp names them
            text, kind = f"[PAD{i}]", _T.UNUSED
        elif text == model.get("unk_token"):
            kind = _T.UNKNOWN
        elif i in special:
            kind = _T.CONTROL
        elif _BYTE_PIECE.fullmatch(text):
            kind = _T.BYTE
        else:
            kind = _T.USER_DEFINED if i in user else _T.NORMAL
        tokens.append(text)
        types.append(int(kind))
        scores.append(-float(rank[text]) if text in rank else floor)
    vocab = _spm_vocab(hf_dir, tok, config, tok_config, tokens, types, scores)
    vocab.add_space_prefix = prefix
    unlisted = _unlisted_pairs(tokens, types, set(merges))
    if unlisted:
        vocab.warning = (f"{path}: {len(unlisted)} tokens (such as {unlisted[0]!r}) can be made from two "
                         "tokens the merges never join; llama.cpp's SentencePiece merging may split some "
                         "text differently from the checkpoint's tokenizer")
    return vocab


def _unlisted_pairs(tokens: list[str], types: list[int], merges: set[tuple[str, ...]]) -> list[str]:
    """Normal tokens that two adjacent tokens spell without a merge for them: SentencePiece's merging
    (any pair whose text is a token) may build them where the BPE would not."""
    pieces = {t for t, ty in zip(tokens, types, strict=True) if ty not in (_T.CONTROL, _T.UNKNOWN)}
    out = []
    for t, ty in zip(tokens, types, strict=True):
        if ty == _T.NORMAL and any(t[:k] in pieces and t[k:] in pieces and (t[:k], t[k:]) not in merges
                                   for k in range(1, len(t))):
            out.append(t)
    return out


def _sentencepiece_model(hf_dir: Path, config: dict[str, Any], tok_config: dict[str, Any],
                         n_vocab: int) -> Vocab:
    """A tokenizer.model (SentencePiece's protobuf) without a tokenizer.json: its pieces, scores and
    types as they are, the added tokens of tokenizer_config.json, ``add_dummy_prefix``."""
    path = hf_dir / TOKENIZER_MODEL
    pieces, model_type, add_dummy_prefix = read_sentencepiece(path.read_bytes())
    if model_type != SPM_BPE:
        return placeholder(n_vocab, f"{path} is a SentencePiece model of type {model_type}, not BPE", config)
    if len(pieces) > n_vocab:
        raise ConvertError(f"{path}: {len(pieces)} pieces for the model's {n_vocab} embedding rows")
    tokens = [p for p, _, _ in pieces] + [f"[PAD{i}]" for i in range(len(pieces), n_vocab)]
    scores = [s for _, s, _ in pieces] + [ADDED_SCORE] * (n_vocab - len(pieces))
    types = [ty for _, _, ty in pieces] + [int(_T.UNUSED)] * (n_vocab - len(pieces))
    for key, added in (tok_config.get("added_tokens_decoder") or {}).items():
        i, text = int(key), added["content"]
        if i < n_vocab:
            special = bool(added.get("special"))
            tokens[i] = text if special else text.replace(SPACE, " ")  # user-defined: matched in raw text
            types[i] = int(_T.CONTROL if special else _T.USER_DEFINED)
            scores[i] = ADDED_SCORE
    vocab = _spm_vocab(hf_dir, {}, config, tok_config, tokens, types, scores)
    vocab.add_space_prefix = add_dummy_prefix
    return vocab


# SentencePiece's ModelProto, the fields read: pieces = 1 (SentencePiece: piece = 1, score = 2,
# type = 3), trainer_spec = 2 (model_type = 3), normalizer_spec = 3 (add_dummy_prefix = 3).
SPM_UNIGRAM, SPM_BPE = 1, 2


def read_sentencepiece(data: bytes) -> tuple[list[tuple[str, float, int]], int, bool]:
    """(piece, score, type) per id, the model type and add_dummy_prefix of a tokenizer.model."""
    pieces: list[tuple[str, float, int]] = []
    model_type, add_dummy_prefix = SPM_UNIGRAM, True
    for field_no, value in _proto_fields(data):
        if field_no == 1 and isinstance(value, bytes):
            piece, score, ty = "", 0.0, int(_T.NORMAL)
            for f, v in _proto_fields(value):
                if f == 1 and isinstance(v, bytes):
                    piece = v.decode("utf-8")
                elif f == 2 and isinstance(v, float):
                    score = v
                elif f == 3 and isinstance(v, int):
                    ty = v
            pieces.append((piece, score, ty))
        elif field_no in (2, 3) and isinstance(value, bytes):
            for f, v in _proto_fields(value):
                if field_no == 2 and f == 3 and isinstance(v, int):
                    model_type = v
                elif field_no == 3 and f == 3 and isinstance(v, int):
                    add_dummy_prefix = bool(v)
    return pieces, model_type, add_dummy_prefix


def _proto_fields(data: bytes):
    """(field number, value) of a protobuf message: varints as int, 32-bit as float, bytes as bytes."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        wire = key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at : at + 8], at + 8
        elif wire == 2:
            n, at = _varint(data, at)
            value, at = data[at : at + n], at + n
        elif wire == 5:
            value, at = struct.unpack_from("<f", data, at)[0], at + 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
        if at > len(data):
            raise ValueError("truncated protobuf")
        yield key >> 3, value


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]  # IndexError past the end: truncated
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at
