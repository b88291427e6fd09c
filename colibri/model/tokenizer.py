"""Byte-level BPE from a GGUF's ``tokenizer.ggml.*`` metadata, and a streaming detokenizer.

Encoding is the ``tokenizers`` library's BPE, built from the vocabulary and merges in the file with
the pre-tokenizer llama.cpp uses for the file's ``tokenizer.ggml.pre``. Decoding is ours: each id
maps to its bytes, and a ``StreamDecoder`` holds back an incomplete UTF-8 sequence until the
token that completes it arrives.
"""

from __future__ import annotations

import codecs
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from colibri.store.gguf import GGUFError, GGUFFile

# Control tokens that end a generation besides the file's eos/eot ids, by their text: the ends of
# text and of turns llama.cpp's vocabulary loader also treats as end-of-generation, and the markers
# that open a turn (a model that starts a new turn has ended its own; without these, a reply ran on
# into "\nuser\n…", the markers themselves rendering as nothing).
END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>",
})
TURN_START_TEXTS = frozenset({
    "<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|user|>", "<|assistant|>", "<|system|>",
})

# llama.cpp token types.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

# GPT-2's word split, which llama.cpp applies after its per-model splits.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's pre-tokenizer regexes per ``tokenizer.ggml.pre`` (llama-vocab.cpp); each is applied
# in turn, isolating its matches.
_PRE_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    # SmolLM, StarCoder and friends first isolate every digit.
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "qwen2": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
}


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins back to raw bytes."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class GGUFTokenizer:
    def __init__(self, gguf: GGUFFile) -> None:
        model = gguf.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise GGUFError(
                f"{gguf.path}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = gguf.get("tokenizer.ggml.tokens") or []
        merges: list[str] = gguf.get("tokenizer.ggml.merges") or []
        types: list[int] = gguf.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        if not tokens:
            raise GGUFError(f"{gguf.path}: no tokenizer.ggml.tokens in the metadata")
        self.tokens, self.types = tokens, types
        self.bos_id: int | None = gguf.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = gguf.get("tokenizer.ggml.eos_token_id")
        self.eot_id: int | None = gguf.get("tokenizer.ggml.eot_token_id")
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))

        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab, pairs, ignore_merges=False)
        self._tok = Tokenizer(bpe)
        pre = gguf.get("tokenizer.ggml.pre", "default")
        splits = _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
        self._tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._tok.decoder = decoders.ByteLevel()
        kept_whole = (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        special = [tok for tok, ty in zip(tokens, types, strict=True) if ty in kept_whole]
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

        u2b = _unicode_to_byte()
        self._bytes: list[bytes] = []
        for tok, ty in zip(tokens, types, strict=True):
            if ty in (TOKEN_CONTROL, TOKEN_UNUSED):
                self._bytes.append(b"")  # as llama.cpp: control and unused tokens render as nothing
            elif ty == TOKEN_USER_DEFINED:
                self._bytes.append(tok.encode())
            else:
                self._bytes.append(bytes(u2b.get(c, 0x3F) for c in tok))
        ends = END_OF_GENERATION_TEXTS | TURN_START_TEXTS
        marked = (i for i, (tok, ty) in enumerate(zip(tokens, types, strict=True))
                  if ty in kept_whole and tok in ends)
        self.stop_ids = frozenset([*(i for i in (self.eos_id, self.eot_id) if i is not None), *marked])
        # The most bytes of text one token stands for (a control token: its own text): a text of
        # B bytes is at least B / max_token_bytes tokens, which bounds what a prompt can weigh.
        self.max_token_bytes = max(
            len(tok.encode()) if ty in kept_whole else len(b)
            for tok, ty, b in zip(tokens, types, self._bytes, strict=True)
        )

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``special``, text such as ``<|im_start|>`` becomes its id."""
        self._tok.encode_special_tokens = not special
        return self._tok.encode(text, add_special_tokens=False).ids

    def to_json(self) -> str:
        """The tokenizer in Hugging Face's tokenizer.json form (what llguidance reads)."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Feeds ids, returns text that is complete: a character split across tokens comes out whole."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The end of a stream: an unfinished UTF-8 sequence held back (a generation cut by its
        token limit mid-character) is dropped, not shown as U+FFFD. Invalid bytes were already
        replaced as they came; only a valid but incomplete tail is ever held."""
        self._utf8.reset()
        return ""
