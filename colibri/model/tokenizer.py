"""A GGUF's ``tokenizer.ggml.*`` vocabulary: byte-level BPE or SentencePiece; a streaming detokenizer.

Byte-level BPE (``"gpt2"``) encodes with the ``tokenizers`` library's BPE, built from the vocabulary
and merges in the file with the pre-tokenizer llama.cpp uses for the file's ``tokenizer.ggml.pre``.
SentencePiece (``"llama"``) encodes with ``tokenizer_spm``'s port of llama.cpp's score-driven merges.
Decoding is ours: each id maps to its bytes, and a ``StreamDecoder`` holds back an incomplete UTF-8
sequence until the token that completes it arrives.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Iterable
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from colibri.model import harmony
from colibri.model.tokenizer_spm import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    SPMEncoder,
    piece_bytes,
    spm_tokenizer_json,
)
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


class TooManyTokens(ValueError):
    """A text longer than a limit allows, known from its length before it was tokenized."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"at least {at_least} tokens, over the limit of {limit}")
        self.at_least, self.limit = at_least, limit


class GGUFTokenizer:
    """The file's vocabulary: ``encode`` text to ids, ids back to bytes, the ids that end a turn."""

    def __init__(self, gguf: GGUFFile) -> None:
        model = gguf.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise GGUFError(f"{gguf.path}: tokenizer model {model!r} is not supported "
                            "(only byte-level BPE, 'gpt2', and SentencePiece, 'llama')")
        tokens: list[str] = gguf.get("tokenizer.ggml.tokens") or []
        types: list[int] = gguf.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        if not tokens:
            raise GGUFError(f"{gguf.path}: no tokenizer.ggml.tokens in the metadata")
        self.model: str = model
        self.tokens, self.types = tokens, types
        spm = model == "llama"
        # llama.cpp's defaults where the file says nothing: SentencePiece has <unk> <s> </s> = 0 1 2
        # and adds BOS; ids outside the vocabulary are none.
        self.bos_id = self._special_id(gguf, "bos", 1 if spm else None)
        self.eos_id = self._special_id(gguf, "eos", 2 if spm else None)
        self.unk_id = self._special_id(gguf, "unknown", 0 if spm else None)
        self.eot_id = self._special_id(gguf, "eot", None)
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", spm))
        self.add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = spm and bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
        self._spm: SPMEncoder | None = None
        self._tok: Tokenizer | None = None
        # encode_special_tokens is the ``tokenizers`` object's own state, set per segment: requests
        # encode in worker threads, and one's setting must not leak into another's (client text
        # read as control tokens), so an encode holds the object alone.
        self._tok_lock = threading.Lock()
        self.scores: list[float] = []  # SentencePiece's merge priorities
        if spm:
            self.scores = [float(x) for x in gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
            self._spm = SPMEncoder(tokens, types, self.scores, self.add_space_prefix, self.unk_id)
            self._bytes = [piece_bytes(tok, ty) for tok, ty in zip(tokens, types, strict=True)]
        else:
            self._tok = _byte_level_bpe(gguf, tokens, types)
            self._bytes = _byte_level_pieces(tokens, types)
        kept_whole = (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        # The types whose text becomes the token with special tokens parsed.
        self.parsed_types = (*kept_whole, TOKEN_UNKNOWN) if spm else kept_whole
        controls = {tok: i for i, (tok, ty) in enumerate(zip(tokens, types, strict=True))
                    if ty in kept_whole}
        # A harmony vocabulary renders its markup as text, so that the server can split a reply
        # into its channels (``harmony.py``), and ``<|end|>`` ends a message, not the reply.
        self.harmony = harmony.speaks_harmony(controls)
        if self.harmony:
            for text in set(harmony.MARKUP) & controls.keys():
                self._bytes[controls[text]] = text.encode()
        ends = END_OF_GENERATION_TEXTS | TURN_START_TEXTS
        marked = (i for tok, i in controls.items() if tok in ends)
        stops = {*(i for i in (self.eos_id, self.eot_id) if i is not None), *marked}
        if self.harmony:  # <|end|> ends one message of several, whether the file marks it an end
            stops.discard(controls.get(harmony.END))  # of text or names it its eot
        self.stop_ids = frozenset(stops)
        # The most bytes of text one token stands for (a control token: its own text): a text of
        # B bytes is at least B / max_token_bytes tokens, which bounds what a prompt can weigh. A
        # SentencePiece token may be typed as its own text (a "▁" for each space, "<0x41>"), longer
        # than what it renders.
        self.max_token_bytes = max(
            len(tok.encode()) if spm or ty in kept_whole else len(b)
            for tok, ty, b in zip(tokens, types, self._bytes, strict=True)
        )

    def _special_id(self, gguf: GGUFFile, name: str, default: int | None) -> int | None:
        value = gguf.get(f"tokenizer.ggml.{name}_token_id", default)
        return int(value) if value is not None and 0 <= int(value) < len(self.tokens) else default

    def least_tokens(self, chars: int) -> int:
        """The fewest tokens a text of ``chars`` characters can be: no token stands for more than
        ``max_token_bytes`` bytes, and a character is at least one byte."""
        return -(-chars // self.max_token_bytes)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, special: bool = False, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``special``, text such as ``<|im_start|>`` becomes its id;
        with ``add_special``, BOS and EOS as the file's add_bos/add_eos flags say (llama.cpp's)."""
        return self.encode_segments([(text, special)], add_special)

    def encode_segments(self, segments: Iterable[tuple[str, bool]], add_special: bool = False,
                        limit: int | None = None) -> list[int]:
        """Token ids of texts that follow each other, each with its own ``special`` flag: a
        segment boundary is a token boundary. One prompt: SentencePiece's space prefix goes at
        its start and after special tokens, not in front of every segment. ``limit``: the most
        tokens wanted; a text that cannot fit, by its length alone, raises ``TooManyTokens``
        before any of it is tokenized (megabytes of text would hold a core for seconds)."""
        segments = list(segments)
        if limit is not None:
            least = self.least_tokens(sum(len(text) for text, _ in segments))
            if least > limit:
                raise TooManyTokens(least, limit)
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        prev_special = True
        for text, special in segments:
            if self._spm is not None:
                part, prev_special = self._spm.encode(text, special, prev_special)
                ids += part
            else:
                assert self._tok is not None
                with self._tok_lock:
                    self._tok.encode_special_tokens = not special
                    # encode_batch lets go of the GIL while it works (encode does not): a long
                    # prompt tokenized on a worker thread leaves the event loop running.
                    ids += self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def to_json(self) -> str:
        """The tokenizer in Hugging Face's tokenizer.json form (what llguidance reads)."""
        if self._tok is not None:
            return self._tok.to_str()
        return spm_tokenizer_json(self.tokens, self.types, self.scores, self.add_space_prefix, self.unk_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (llama.cpp's detokenize, special tokens as nothing): with the space
        prefix, the first token's leading space is dropped, the one encoding put there."""
        data = b"".join(self.token_bytes(i) for i in ids)
        if self.add_space_prefix and ids and self.token_bytes(ids[0]).startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Tokenizer:
    """The ``tokenizers`` BPE of a "gpt2" vocabulary, with llama.cpp's pre-tokenizer splits."""
    merges: list[str] = gguf.get("tokenizer.ggml.merges") or []
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=False))
    pre = gguf.get("tokenizer.ggml.pre", "default")
    splits = _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    kept_whole = (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    special = [t for t, ty in zip(tokens, types, strict=True) if ty in kept_whole]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _byte_level_pieces(tokens: list[str], types: list[int]) -> list[bytes]:
    u2b = _unicode_to_byte()
    out: list[bytes] = []
    for tok, ty in zip(tokens, types, strict=True):
        if ty in (TOKEN_CONTROL, TOKEN_UNUSED):
            out.append(b"")  # as llama.cpp: control and unused tokens render as nothing
        elif ty == TOKEN_USER_DEFINED:
            out.append(tok.encode())
        else:
            out.append(bytes(u2b.get(c, 0x3F) for c in tok))
    return out


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
