"""Write a synthetic mixtral-style MoE GGUF (random Q4_0 experts) of any size, streaming.

For the expert-store benchmark (``bench/bench_moe.py``) and the store's tests: a complete
"llama"-architecture file with expert tensors, as llama.cpp writes Mixtral, whose experts can be
made several times larger than a RAM budget. The weights are random but the routing is not
uniform: every token embedding shares a common direction ``c``, and each router row leans towards
``c`` by a Zipf-distributed amount, so a few experts per layer are hot, as in real MoE models.
Experts are random Q4_0 blocks written tensor by tensor (one layer's experts at a time in RAM).
The vocabulary is a placeholder SentencePiece one (``<unk> <s> </s>``, the 256 byte tokens, then
``▁t<i>`` pieces; none below 259 tokens): no text means anything to a random model, so drive it
with ``--prompt-ids``; it is there because llama.cpp will not load a file without one
(``bench/bench_moe_peer.py`` runs both engines on this same file).

    python tools/make_synthetic_moe.py OUT.gguf [--layers 24] [--experts 64] [--used 4]
        [--embd 1024] [--ff 1024] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from colibri.store.formats import GGMLType, quantize

Q4_0_BLOCK_BYTES = 18  # f16 scale + 16 bytes of nibbles, per 32 weights
# The experts' scale: nibbles are uniform in 1..15 (value d*(q-8)), so d sets the output's size;
# small, so the residual stream stays led by the token and each layer's routing varies with it
# (larger outputs drive every token towards the same experts after a few layers).
EXPERT_SCALE = 0.03
ZIPF_EXPONENT = 1.1  # routing skew: expert rank r gets lean ~ 1/r^s
ROUTER_LEAN = 1.0  # how strongly the hottest expert's router row leans towards c
COMMON_SHARE = 0.2  # share of each token embedding that is the common direction c


def _random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 rows (uint8, [rows, cols/32*18]) with the scale EXPERT_SCALE/sqrt(cols)."""
    blocks = np.empty((rows, cols // 32, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    # nibbles 1..15 (values d*(q-8) in -7d..7d): zero mean, so that layer after layer of random
    # experts does not push every token's hidden state towards one direction (and one routing)
    nibbles = rng.integers(1, 16, (2, rows, cols // 32, 16), dtype=np.uint8)
    blocks[:, :, 2:] = nibbles[0] | (nibbles[1] << 4)
    d = np.float16(EXPERT_SCALE / np.sqrt(cols))
    blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


Make = Callable[[], np.ndarray]
Q4 = gguf.GGMLQuantizationType.Q4_0
F32 = gguf.GGMLQuantizationType.F32


class _Weights:
    """The tensors' random values, all from one generator: drawn in the order they are written,
    so that the file is a function of the seed."""

    def __init__(self, rng: np.random.Generator, n_vocab: int, n_embd: int, n_experts: int,
                 router_lean: float, common_share: float):
        self.rng, self.n_vocab, self.n_embd, self.n_experts = rng, n_vocab, n_embd, n_experts
        self.common_share = common_share
        self.common = rng.standard_normal(n_embd).astype(np.float32)
        self.common /= np.linalg.norm(self.common)
        self.lean = router_lean / np.arange(1, n_experts + 1) ** ZIPF_EXPONENT

    def q4(self, rows: int, cols: int) -> Make:
        return lambda: _random_q4_0(self.rng, rows, cols)

    def experts(self, rows: int, cols: int) -> Make:
        """[n_expert, rows, cols] as n_expert*rows raw rows; gguf-py derives the 3-D shape."""
        return lambda: _random_q4_0(self.rng, self.n_experts * rows, cols).reshape(self.n_experts, rows, -1)

    def embedding(self) -> np.ndarray:
        n_vocab, n_embd = self.n_vocab, self.n_embd
        table = self.rng.standard_normal((n_vocab, n_embd)).astype(np.float32) / np.sqrt(n_embd)
        table *= 1.0 - self.common_share
        table += self.common_share * self.common
        return quantize(table, GGMLType.Q4_0).reshape(n_vocab, -1)

    def router(self) -> np.ndarray:
        n_experts, n_embd = self.n_experts, self.n_embd
        rows = self.rng.standard_normal((n_experts, n_embd)).astype(np.float32) / np.sqrt(n_embd)
        order = self.rng.permutation(n_experts)  # which experts are hot differs per layer
        return (rows + self.lean[order][:, None] * self.common[None, :]).astype(np.float32)

    def ones_ish(self) -> np.ndarray:
        return (1.0 + 0.05 * self.rng.standard_normal(self.n_embd)).astype(np.float32)


class _Plan:
    """Every tensor's name, shape, type and maker, in file order: the header needs every shape
    before the first tensor's data is made."""

    def __init__(self, weights: _Weights):
        self.weights = weights
        self.entries: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, Make]] = []

    def q4_matrix(self, name: str, rows: int, cols: int) -> None:
        self.entries.append((name, (rows, cols // 32 * Q4_0_BLOCK_BYTES), Q4, self.weights.q4(rows, cols)))

    def f32_tensor(self, name: str, shape: tuple[int, ...], make: Make) -> None:
        self.entries.append((name, shape, F32, make))

    def layer(self, i: int, n_embd: int, n_ff: int, q_dim: int, kv_dim: int) -> None:
        p, w = f"blk.{i}.", self.weights
        self.f32_tensor(p + "attn_norm.weight", (n_embd,), w.ones_ish)
        self.q4_matrix(p + "attn_q.weight", q_dim, n_embd)
        self.q4_matrix(p + "attn_k.weight", kv_dim, n_embd)
        self.q4_matrix(p + "attn_v.weight", kv_dim, n_embd)
        self.q4_matrix(p + "attn_output.weight", n_embd, q_dim)
        self.f32_tensor(p + "ffn_norm.weight", (n_embd,), w.ones_ish)
        self.f32_tensor(p + "ffn_gate_inp.weight", (w.n_experts, n_embd), w.router)
        for part, rows, cols in (("gate", n_ff, n_embd), ("up", n_ff, n_embd), ("down", n_embd, n_ff)):
            shape = (w.n_experts, rows, cols // 32 * Q4_0_BLOCK_BYTES)
            self.entries.append((f"{p}ffn_{part}_exps.weight", shape, Q4, w.experts(rows, cols)))


def _add_metadata(w: gguf.GGUFWriter, *, n_layers: int, n_experts: int, n_used: int, n_embd: int,
                  n_ff: int, n_vocab: int, n_heads: int, n_kv_heads: int) -> None:
    w.add_name("synthetic-moe")
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(n_embd // n_heads)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(n_used)
    w.add_vocab_size(n_vocab)
    w.add_file_type(2)  # MOSTLY_Q4_0
    _add_placeholder_vocab(w, n_vocab)


# llama.cpp's token types (llama-vocab.h): a placeholder vocabulary's control, byte and plain pieces.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6
SPECIALS = ("<unk>", "<s>", "</s>")  # SentencePiece's ids 0, 1, 2


def _add_placeholder_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A SentencePiece vocabulary of ``n_vocab`` pieces: the specials, the byte fallbacks, fillers;
    none in a file too small to hold them (colibri needs none, llama.cpp does)."""
    if n_vocab < len(SPECIALS) + 256:
        return
    pieces = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    pieces += [f"\u2581t{i}" for i in range(n_vocab - len(pieces))]
    types += [TOKEN_NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * len(SPECIALS) + [0.0] * 256 + [-float(i) for i in range(n_vocab - 259)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _write_plan(w: gguf.GGUFWriter, plan: _Plan) -> None:
    """Tensor infos first, data after, one tensor at a time."""
    for name, shape, qtype, _ in plan.entries:
        dtype = np.uint8 if qtype == Q4 else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=qtype if qtype == Q4 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in plan.entries:
        w.write_tensor_data(np.ascontiguousarray(make()))
    w.close()


def write_synthetic_moe(
    path: str | Path, *, n_layers: int = 24, n_experts: int = 64, n_used: int = 4, n_embd: int = 1024,
    n_ff: int = 1024, n_vocab: int = 4096, n_heads: int = 8, n_kv_heads: int = 4, seed: int = 0,
    router_lean: float = ROUTER_LEAN, common_share: float = COMMON_SHARE,
) -> Path:
    path = Path(path)
    if n_embd % 32 or n_ff % 32:
        raise ValueError("n_embd and n_ff must be multiples of 32 (whole Q4_0 blocks)")
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_heads
    w = gguf.GGUFWriter(path, "llama")
    _add_metadata(w, n_layers=n_layers, n_experts=n_experts, n_used=n_used, n_embd=n_embd, n_ff=n_ff,
                  n_vocab=n_vocab, n_heads=n_heads, n_kv_heads=n_kv_heads)
    weights = _Weights(rng, n_vocab, n_embd, n_experts, router_lean, common_share)
    plan = _Plan(weights)
    plan.entries.append(
        ("token_embd.weight", (n_vocab, n_embd // 32 * Q4_0_BLOCK_BYTES), Q4, weights.embedding))
    for i in range(n_layers):
        plan.layer(i, n_embd, n_ff, n_heads * head_dim, n_kv_heads * head_dim)
    plan.f32_tensor("output_norm.weight", (n_embd,), weights.ones_ish)
    plan.q4_matrix("output.weight", n_vocab, n_embd)
    _write_plan(w, plan)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, metavar="OUT.gguf")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--used", type=int, default=4)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--ff", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lean", type=float, default=ROUTER_LEAN, help="routing skew (0: uniform)")
    a = p.parse_args(argv)
    try:
        out = write_synthetic_moe(a.out, n_layers=a.layers, n_experts=a.experts, n_used=a.used,
                                  n_embd=a.embd, n_ff=a.ff, n_vocab=a.vocab, seed=a.seed,
                                  router_lean=a.lean)
    except ValueError as e:
        print(f"make_synthetic_moe: error: {e}", file=sys.stderr)
        return 1
    print(f"{out} ({out.stat().st_size / (1 << 30):.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
