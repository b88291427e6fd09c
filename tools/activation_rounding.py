"""What rounding the activations costs a K-quant file's logits, by place and block size.

The engine takes the experts' inputs at one 8-bit level per 32 values and the attention's
projections at two (``kernels/int8_matmul.py``); one level on the projections would halve their
dot products, which bound a MoE prompt's attention half. This runs the float64 reference
(``colibri.model.reference``) on a file's dequantized weights with its activations rounded in each
of several ways and prints each way's mean |logits - the exact reference's|, the measure
``tests/test_kquants_wide.py`` bounds at 0.3x llama.cpp's own (llama.cpp on the same file against
the same weights in F32: 0.071-0.080 on the wide test model's mixes). Random prompts, as that test's.

    python tools/activation_rounding.py FILE.gguf [--prompts 3] [--length 44]

FILE: a quantized file the reference runs (the wide test model's, in pytest's cache under
``kquants-wide/``, is a qwen2moe).
"""

from __future__ import annotations

import argparse

import numpy as np

from colibri.model.reference import Weights, forward

# (label, the experts' levels and values per block, the projections' levels and values per block)
WAYS = (
    ("the engine's: experts 1/32, projections exact", 1, 32, 0, 32),
    ("experts 1/32, projections 2/32", 1, 32, 2, 32),
    ("experts 1/32, projections 1/32", 1, 32, 1, 32),
    ("experts 1/32, projections 1/16", 1, 32, 1, 16),
    ("experts 1/16, projections 1/16", 1, 16, 1, 16),
    ("experts 1/16, projections exact", 1, 16, 0, 32),
    ("experts exact, projections 1/32", 0, 32, 1, 32),
)


def error(path: str, prompts: list[np.ndarray], exact: list[np.ndarray], way: tuple) -> float:
    _, experts, expert_block, projections, projection_block = way
    w = Weights(path, expert_levels=experts, projection_levels=projections, expert_block=expert_block,
                projection_block=projection_block)
    return float(np.mean([np.abs(forward(w, p) - e).mean() for p, e in zip(prompts, exact, strict=True)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--length", type=int, default=44)
    args = ap.parse_args()
    exact_w = Weights(args.file)
    rng = np.random.default_rng(7)
    n_vocab = int(exact_w.tensors["token_embd.weight"].shape[-1])  # ne order: (row length, rows)
    prompts = [rng.integers(0, n_vocab, args.length) for _ in range(args.prompts)]
    exact = [forward(exact_w, p) for p in prompts]
    for way in WAYS:
        print(f"{way[0]:48s} {error(args.file, prompts, exact, way):.5f}", flush=True)


if __name__ == "__main__":
    main()
