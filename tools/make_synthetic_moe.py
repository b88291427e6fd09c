"""Write a synthetic mixtral-style MoE GGUF (random Q4_0 experts) of any size, streaming.

For the expert-store benchmark (``bench/bench_moe.py``) and the store's tests: a complete
"llama"-architecture file with expert tensors, as llama.cpp writes Mixtral, whose experts can be
made several times larger than a RAM budget. The weights are random but the routing is not
uniform: every token embedding shares a common direction ``c``, and each router row leans towards
``c`` by a Zipf-distributed amount, so a few experts per layer are hot, as in real MoE models.
Experts are random Q4_0 blocks written tensor by tensor (one layer's experts at a time in RAM).
No vocabulary: drive it with ``--prompt-ids``.

    python tools/make_synthetic_moe.py OUT.gguf [--layers 24] [--experts 64] [--used 4]
        [--embd 1024] [--ff 1024] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from colibri.store.quant import GGMLType, quantize

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
    w.add_name("synthetic-moe")
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(n_used)
    w.add_vocab_size(n_vocab)
    w.add_file_type(2)  # MOSTLY_Q4_0

    q4 = gguf.GGMLQuantizationType.Q4_0
    f32 = gguf.GGMLQuantizationType.F32
    common = rng.standard_normal(n_embd).astype(np.float32)
    common /= np.linalg.norm(common)
    lean = router_lean / np.arange(1, n_experts + 1) ** ZIPF_EXPONENT

    # Tensor infos first (the header needs every shape), data after, one tensor at a time.
    plan: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, object]] = []

    def q4_matrix(name: str, rows: int, cols: int) -> None:
        plan.append((name, (rows, cols // 32 * Q4_0_BLOCK_BYTES), q4, lambda: _random_q4_0(rng, rows, cols)))

    def f32_tensor(name: str, shape: tuple[int, ...], make) -> None:
        plan.append((name, shape, f32, make))

    def embedding() -> np.ndarray:
        table = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) / np.sqrt(n_embd)
        table *= 1.0 - common_share
        table += common_share * common
        return quantize(table, GGMLType.Q4_0).reshape(n_vocab, -1)

    def router() -> np.ndarray:
        rows = rng.standard_normal((n_experts, n_embd)).astype(np.float32) / np.sqrt(n_embd)
        order = rng.permutation(n_experts)  # which experts are hot differs per layer
        return (rows + lean[order][:, None] * common[None, :]).astype(np.float32)

    def ones_ish() -> np.ndarray:
        return (1.0 + 0.05 * rng.standard_normal(n_embd)).astype(np.float32)

    plan.append(("token_embd.weight", (n_vocab, n_embd // 32 * Q4_0_BLOCK_BYTES), q4, embedding))
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        f32_tensor(p + "attn_norm.weight", (n_embd,), ones_ish)
        q4_matrix(p + "attn_q.weight", q_dim, n_embd)
        q4_matrix(p + "attn_k.weight", kv_dim, n_embd)
        q4_matrix(p + "attn_v.weight", kv_dim, n_embd)
        q4_matrix(p + "attn_output.weight", n_embd, q_dim)
        f32_tensor(p + "ffn_norm.weight", (n_embd,), ones_ish)
        f32_tensor(p + "ffn_gate_inp.weight", (n_experts, n_embd), router)
        for part, rows, cols in (("gate", n_ff, n_embd), ("up", n_ff, n_embd), ("down", n_embd, n_ff)):
            # [n_expert, rows, cols] as n_expert*rows raw rows; gguf-py derives the 3-D shape
            plan.append((f"{p}ffn_{part}_exps.weight", (n_experts, rows, cols // 32 * Q4_0_BLOCK_BYTES), q4,
                         lambda rows=rows, cols=cols: _random_q4_0(rng, n_experts * rows, cols)
                         .reshape(n_experts, rows, -1)))
    f32_tensor("output_norm.weight", (n_embd,), ones_ish)
    q4_matrix("output.weight", n_vocab, n_embd)

    for name, shape, qtype, _ in plan:
        dtype = np.uint8 if qtype == q4 else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=qtype if qtype == q4 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in plan:
        w.write_tensor_data(np.ascontiguousarray(make()))
    w.close()
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
