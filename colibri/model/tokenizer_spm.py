"""SentencePiece vocabularies (``tokenizer.ggml.model = "llama"``): llama.cpp's ``llm_tokenizer_spm``.

Llama 2, Mistral, Mixtral and their fine-tunes. Spaces become ``▁`` (and a ``▁`` goes in front when
``add_space_prefix`` is set, at the start and after every special token, as llama.cpp does), then
adjacent pieces merge, best-scoring pair first (ties: the leftmost), for as long as the merged text
is a token; a piece left that is no token falls back to its bytes' ``<0xXX>`` tokens. Added tokens
are cut out whole first, longest first (llama.cpp's ``tokenizer_st_partition``): user-defined ones
always, control and unknown ones only when special tokens are parsed.

One deliberate difference: llama.cpp lets a merge produce any token, a control token included, so
client text spelling ``<s>`` could become the BOS id if the vocabulary held ``<s`` or ``s>``; here
control and unknown tokens are never the result of a merge (text from a client is data). With
special tokens parsed nothing changes, their text is already cut out whole.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Sequence

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

SPACE = "\u2581"  # ▁, SentencePiece's space
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPECIAL = (TOKEN_CONTROL, TOKEN_UNKNOWN)  # never made by a merge, cut out only when parsing specials


def piece_bytes(token: str, ty: int) -> bytes:
    """What a token renders as (llama.cpp's token_to_piece without special tokens): ``▁`` as a
    space, a byte token as its byte, a user-defined token verbatim, control/unknown/unused as nothing."""
    if ty == TOKEN_NORMAL:
        return token.replace(SPACE, " ").encode()
    if ty == TOKEN_USER_DEFINED:
        return token.encode()
    if ty == TOKEN_BYTE and (m := BYTE_TOKEN.fullmatch(token)):
        return bytes([int(m[1], 16)])
    return b""


class SPMEncoder:
    """Text to ids the way llama.cpp tokenizes a "llama" vocabulary."""

    def __init__(self, tokens: Sequence[str], types: Sequence[int], scores: Sequence[float],
                 add_space_prefix: bool, unk_id: int | None) -> None:
        self.add_space_prefix = add_space_prefix
        self._scores = [float(s) for s in scores]
        self._pieces: dict[str, int] = {}  # what a merge may produce: all but control/unknown tokens
        for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
            if tok and ty not in _SPECIAL:
                self._pieces.setdefault(tok, i)
        self._bytes = [_byte_token(b, self._pieces, unk_id) for b in range(256)]
        # Cut out whole, longest (in bytes) first; llama.cpp's cache_special_tokens.
        cut_types = (*_SPECIAL, TOKEN_USER_DEFINED)
        whole = sorted((i for i, ty in enumerate(types) if ty in cut_types and tokens[i]),
                       key=lambda i: -len(tokens[i].encode()))
        self._whole_special = [(tokens[i], i) for i in whole]
        self._whole_plain = [(tokens[i], i) for i in whole if types[i] == TOKEN_USER_DEFINED]

    def encode(self, text: str, special: bool, prev_special: bool = True) -> tuple[list[int], bool]:
        """The ids of ``text``, and whether it ended with a token cut out whole. ``prev_special``:
        the text starts a prompt or follows such a token (it then gets the space prefix)."""
        out: list[int] = []
        for part in self._partition(text, special):
            if isinstance(part, int):
                out.append(part)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                part = " " + part
            self._merge(part.replace(" ", SPACE), out)
            prev_special = False
        return out, prev_special

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """``text`` as raw spans and the ids of the tokens cut out of it, in order."""
        parts: list[str | int] = [text] if text else []
        for tok, tid in self._whole_special if special else self._whole_plain:
            if not any(isinstance(p, str) and tok in p for p in parts):
                continue
            cut: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or tok not in p:
                    cut.append(p)
                    continue
                for k, span in enumerate(p.split(tok)):
                    if k:
                        cut.append(tid)
                    if span:
                        cut.append(span)
            parts = cut
        return parts

    def _merge(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm_session: symbols are characters (a symbol starts where
        its index is), a merge folds the right symbol into the left one."""
        n = len(text)
        size = [1] * n
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        pieces, scores = self._pieces, self._scores
        heap: list[tuple[float, int, int, int]] = []

        def bigram(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                tid = pieces.get(text[left : right + size[right]])
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, right, size[left] + size[right]))

        for i in range(1, n):
            bigram(i - 1, i)
        while heap:
            _, left, right, total = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
                continue  # one of the two was merged since
            size[left], size[right] = total, 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            bigram(prev[left], left)
            bigram(left, nxt[left])
        i = 0
        while i != -1:
            piece = text[i : i + size[i]]
            tid = pieces.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._bytes[b] for b in piece.encode())
            i = nxt[i]


def _byte_token(b: int, pieces: dict[str, int], unk_id: int | None) -> int:
    """llama.cpp's byte_to_token: ``<0xXX>``, else the byte as a one-character token; a vocabulary
    with neither (where llama.cpp throws) gets the unknown token."""
    tid = pieces.get(f"<0x{b:02X}>")
    if tid is None and b < 0x80:
        tid = pieces.get(chr(b))
    if tid is None:
        tid = unk_id if unk_id is not None else 0
    return tid


def spm_tokenizer_json(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float],
                       add_space_prefix: bool, unk_id: int | None) -> str:
    """The vocabulary as a Hugging Face tokenizer.json (what llguidance reads): a byte-fallback BPE
    whose merges are every split of a token into two tokens, by the token's score (what
    transformers' SentencePiece converter writes), and a decoder turning ``▁`` into spaces."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges = []
    for tok, i in vocab.items():
        if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED):
            splits = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
            merges += [(-scores[i], vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort()
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] != TOKEN_USER_DEFINED}
             for i, tok in enumerate(tokens) if types[i] in (*_SPECIAL, TOKEN_USER_DEFINED)]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    normalizers = [{"type": "Prepend", "prepend": SPACE}, replace] if add_space_prefix else [replace]
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers}, "pre_tokenizer": None,
        "post_processor": None, "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": [[a, b] for *_, a, b in merges]},
    }, ensure_ascii=False)
