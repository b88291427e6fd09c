"""Write a tiny, random, llama-architecture GGUF file for fast engine tests.

The file is a complete model, with the metadata keys llama.cpp's converter writes: llama
hyperparameters, a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``) with ChatML
special tokens and a ChatML chat template, and random weights, deterministic from the seed. With
the defaults it is 68 KB (q4_1; f32: 386 KB) and loads in about a millisecond once the kernels are
warm, so a test can start and stop an engine many times.

The vocabulary: ``<|endoftext|>`` (0), ``<|im_start|>`` (1, bos), ``<|im_end|>`` (2, eos), all
control tokens; then GPT-2's 256 byte stand-ins; then the tokens of a few merges; then unused
``<|padN|>`` tokens up to a multiple of 32, so that the output matrix is whole row groups.

    python tools/make_tiny_llama.py OUT.gguf [--type q4_1] [--layers 2] [--embd 64] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from colibri.store.formats import GGMLType, quantize

TYPES: dict[str, GGMLType] = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "bf16": GGMLType.BF16,
    "q8_0": GGMLType.Q8_0,
    "q4_0": GGMLType.Q4_0,
    "q4_1": GGMLType.Q4_1,
}
# general.file_type (llama.cpp's LlamaFileType) of a file whose matrices are all of that type.
FILE_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
VOCAB_MULTIPLE = 32
# Merges in priority order, as GGUF stores them ("left right"); each side is a token that exists
# when the merge is reached. "Ġ" is GPT-2's stand-in for a space.
MERGES = [
    "Ġ t", "Ġ a", "i n", "h e", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o",
    "e n", "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b", "e d", "Ġ f", "in g", "Ġ p",
    "o u", "Ġa n", "a r", "Ġt o", "Ġ m", "Ġo f", "Ġ in", "Ġ d", "Ġ h", "Ġan d", "l l",
    "e l", "he ll", "hell o", "Ġ hello", "Ġw or", "Ġwor l", "Ġworl d", "Ġ l", "l e",
    "Ġ n", "Ġ 1", "Ġ y", "Ġy ou", "i on",
]
# ChatML, as SmolLM2 writes it, with a shorter default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Weight scales, tuned so that greedy decoding wanders instead of locking onto one token:
# matrices N(0, MATRIX_GAIN^2 / fan_in) (a gain of 1 or less gives a near-linear network whose
# greedy output repeats one id, 2 a mildly chaotic one: 24-31 distinct ids in 32 steps); the
# embedding (tied to the output) N(0, EMBD_STD^2), which puts the logits' spread at about 2.
MATRIX_GAIN = 2.0
EMBD_STD = 0.3
NORM_JITTER = 0.1  # norm weights are 1 + N(0, NORM_JITTER^2): not ones, so a test sees them used


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (its byte-level BPE alphabet)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level BPE vocabulary."""
    tokens = list(SPECIAL_TOKENS)
    types = [int(gguf.TokenType.CONTROL)] * len(tokens)
    b2u = bytes_to_unicode()
    printable = [b for b in range(256) if b2u[b] == chr(b)]
    for b in printable + [b for b in range(256) if b2u[b] != chr(b)]:  # GPT-2's order
        tokens.append(b2u[b])
        types.append(int(gguf.TokenType.NORMAL))
    known, merges = set(tokens), []
    for merge in MERGES:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right not in known, merge
        merges.append(merge)
        known.add(left + right)
        tokens.append(left + right)
        types.append(int(gguf.TokenType.NORMAL))
    pad = -len(tokens) % VOCAB_MULTIPLE
    tokens += [f"<|pad{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    return tokens, types, merges


def _check(gtype: str, n_embd: int, n_ff: int, n_heads: int, n_kv_heads: int) -> None:
    """Raise ValueError for a type or shape the file cannot have."""
    if gtype not in TYPES:
        raise ValueError(f"type {gtype!r}: one of {', '.join(TYPES)}")
    if n_embd % n_heads or n_heads % n_kv_heads:
        raise ValueError("n_embd must divide by n_heads, and n_heads by n_kv_heads")
    if (n_embd // n_heads) % 2:
        raise ValueError("the head dimension must be even (RoPE rotates pairs)")
    if TYPES[gtype] not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) and (n_embd % 32 or n_ff % 32):
        raise ValueError(f"{gtype}: n_embd and n_ff must be multiples of 32 (whole blocks)")


def _add_hyperparameters(w: gguf.GGUFWriter, *, gtype: str, n_layers: int, n_embd: int, n_ff: int,
                         n_heads: int, n_kv_heads: int, context_length: int, n_vocab: int) -> None:
    w.add_name("tiny-llama")
    w.add_file_type(FILE_TYPES[gtype])
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(n_embd // n_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)


def _add_tokenizer(w: gguf.GGUFWriter, tokens: list[str], types: list[int], merges: list[str]) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(0)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


class _Tensors:
    """Adds random tensors to a writer, drawn from one generator in the order they are added."""

    def __init__(self, w: gguf.GGUFWriter, rng: np.random.Generator, qtype: GGMLType, n_embd: int):
        self.w, self.rng, self.qtype, self.n_embd = w, rng, qtype, n_embd

    def matrix(self, name: str, rows: int, cols: int, std: float | None = None) -> None:
        """A (rows, cols) matrix (ggml shape [cols, rows]): each row is one output's weights."""
        scale = MATRIX_GAIN / np.sqrt(cols) if std is None else std
        values = (self.rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        # gguf-py takes raw blocks as uint8 (rows, row bytes) and derives the logical shape itself.
        raw = quantize(values, self.qtype).reshape(rows, -1)
        self.w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(int(self.qtype)))

    def norm(self, name: str) -> None:
        values = 1.0 + NORM_JITTER * self.rng.standard_normal(self.n_embd)
        self.w.add_tensor(name, values.astype(np.float32))

    def layer(self, i: int, n_ff: int, q_dim: int, kv_dim: int) -> None:
        n_embd = self.n_embd
        self.norm(f"blk.{i}.attn_norm.weight")
        self.matrix(f"blk.{i}.attn_q.weight", q_dim, n_embd)
        self.matrix(f"blk.{i}.attn_k.weight", kv_dim, n_embd)
        self.matrix(f"blk.{i}.attn_v.weight", kv_dim, n_embd)
        self.matrix(f"blk.{i}.attn_output.weight", n_embd, q_dim)
        self.norm(f"blk.{i}.ffn_norm.weight")
        self.matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        self.matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        self.matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff)


def write_tiny_llama(
    path: str | Path,
    *,
    n_layers: int = 2,
    n_embd: int = 64,
    n_ff: int = 128,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    context_length: int = 512,
    gtype: str = "q4_1",
    seed: int = 0,
    tied: bool = True,
) -> Path:
    """Write the model to ``path`` and return it. Matrices (embedding included) are stored as
    ``gtype``, norm weights as F32. Without ``tied`` the file has its own ``output.weight``."""
    path = Path(path)
    _check(gtype, n_embd, n_ff, n_heads, n_kv_heads)
    head_dim = n_embd // n_heads
    tokens, types, merges = build_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(path, "llama")
    _add_hyperparameters(w, gtype=gtype, n_layers=n_layers, n_embd=n_embd, n_ff=n_ff, n_heads=n_heads,
                         n_kv_heads=n_kv_heads, context_length=context_length, n_vocab=n_vocab)
    _add_tokenizer(w, tokens, types, merges)

    tensors = _Tensors(w, rng, TYPES[gtype], n_embd)
    tensors.matrix("token_embd.weight", n_vocab, n_embd, EMBD_STD)
    for i in range(n_layers):
        tensors.layer(i, n_ff, n_heads * head_dim, n_kv_heads * head_dim)
    tensors.norm("output_norm.weight")
    if not tied:
        tensors.matrix("output.weight", n_vocab, n_embd, EMBD_STD)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, metavar="OUT.gguf")
    p.add_argument("--type", dest="gtype", choices=sorted(TYPES), default="q4_1",
                   help="block type of the matrices (norms are always f32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--ff", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--untied", action="store_true", help="write a separate output.weight")
    a = p.parse_args(argv)
    try:
        out = write_tiny_llama(
            a.out, n_layers=a.layers, n_embd=a.embd, n_ff=a.ff, n_heads=a.heads,
            n_kv_heads=a.kv_heads, context_length=a.ctx, gtype=a.gtype, seed=a.seed, tied=not a.untied,
        )
    except ValueError as e:
        print(f"make_tiny_llama: error: {e}", file=sys.stderr)
        return 1
    print(f"{out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
