"""MTP (NextN) drafting's cost where its drafts are wrong: a synthetic GLM-4.5-Air-shaped file
with a NextN layer, random like the rest of it.

    python bench/bench_mtp.py [--runs 3] [--tokens 96] [--json PATH]

The file: ``tools/make_synthetic_moe.py --arch glm4moe --nextn`` (Q4_K_M mix, 16 layers, 32
experts of 512 rows, top 4, written once into .bench-cache/). Its NextN layer is
random, so its drafts are rejected: what is measured is what running the layer costs (one more
MoE layer over the verified rows each step, and its head for a draft), and that the pause stops
the drafts (10% over 24 proposed: 256 tokens without). The acceptance a trained layer has (GLM-4.5's)
cannot be measured without its weights, which nothing here downloads; tests/test_nextn.py shows
the drafts exact and accepted where the layer predicts. One stream, greedy, one prompt of random
ids; ``coli engine`` with ``--speculative off``, ``ngram``, ``mtp`` and ``auto``, each mode's
decode tok/s (DONE's: first token to last) and drafts, 2 threads, medians of --runs, the modes
alternating run by run. The answers must be the same tokens in every mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from bench_speculative import Engine  # noqa: E402
from make_synthetic_moe import write_synthetic_moe  # noqa: E402

CACHE = Path(__file__).resolve().parent.parent / ".bench-cache"
SHAPE = dict(arch="glm4moe", n_layers=16, n_experts=32, n_used=4, n_embd=1024, n_ff=512, n_vocab=4096,
             nextn=True)
MODES = ("off", "ngram", "mtp", "auto")
PROMPT = " ".join(f"w{i * 37 % 101}" for i in range(60))  # bytes of the placeholder vocabulary


def model_file() -> Path:
    path = CACHE / "synthetic-glm4moe-nextn.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        write_synthetic_moe(path.with_suffix(".part"), **SHAPE).rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    path = model_file()
    engines = {mode: Engine(path, mode, 16) for mode in MODES}
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for _ in range(a.runs):
            for mode in MODES:
                rate, (out,) = engines[mode].run([PROMPT], a.tokens)
                results[mode].append({**out, "rate": rate})
    finally:
        for engine in engines.values():
            engine.close()
    texts = {mode: {r["text"] for r in runs} for mode, runs in results.items()}
    if any(t != texts["off"] for t in texts.values()) or len(texts["off"]) != 1:
        raise SystemExit("the modes' answers differ: speculative decoding is not exact here")
    off = statistics.median(r["rate"] for r in results["off"])
    print(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB, {a.tokens} tokens, medians of {a.runs}")
    print(f"{'mode':<6} {'tok/s':>7} {'x off':>6} {'drafts accepted':>16} {'tok/step':>9}")
    table = {}
    for mode, runs in results.items():
        rate = statistics.median(r["rate"] for r in runs)
        last = runs[-1]
        table[mode] = {"tok_s": rate, "ratio": rate / off, "drafted": last["drafted"],
                       "accepted": last["accepted"], "tok_per_step": last["emitted"] / max(last["steps"], 1)}
        row = table[mode]
        print(f"{mode:<6} {rate:>7.1f} {row['ratio']:>5.2f}x {row['accepted']:>7}/{row['drafted']:<8} "
              f"{row['tok_per_step']:>9.2f}")
    if a.json:
        a.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
