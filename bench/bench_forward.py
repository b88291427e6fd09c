"""Decode and prefill speed on the default model, colibri beside llama.cpp in the same process.

    python bench/bench_forward.py [--model PATH] [--runs 5] [--decode 64] [--prefill 512]

Prints tokens per second (median of --runs runs) for both engines and the ratio. llama.cpp comes
from llama-cpp-python (`make peer`); without it only colibri's figures are printed. Both use every
core of the machine (llama.cpp: n_threads = os.cpu_count(); colibri: numba's default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.settings import default_model_path

PROMPT_SEED = 1234


def random_prompt(n: int, n_vocab: int) -> list[int]:
    return np.random.default_rng(PROMPT_SEED).integers(100, n_vocab - 100, n).tolist()


def colibri_prefill(model: Model, prompt: list[int]) -> float:
    seq = SingleSequence(model, len(prompt) + 8, len(prompt))
    start = time.perf_counter()
    seq.prefill(prompt)
    return len(prompt) / (time.perf_counter() - start)


def colibri_decode(model: Model, n: int) -> float:
    seq = SingleSequence(model, n + 64, 512)
    logits = seq.prefill(random_prompt(16, model.hp.n_vocab))[-1]
    start = time.perf_counter()
    for _ in range(n):
        logits = seq.step(np.array([int(np.argmax(logits))]), False)[-1]
    return n / (time.perf_counter() - start)


def llama_engine(path: Path, n_ctx: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=os.cpu_count(), verbose=False)


def llama_prefill(llm, prompt: list[int]) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


def llama_decode(llm, n: int, n_vocab: int) -> float:
    llm.reset()
    llm.eval(random_prompt(16, n_vocab))
    start = time.perf_counter()
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return n / (time.perf_counter() - start)


def median_of(runs: int, fn, *args) -> float:
    fn(*args)  # warm-up: numba compilation, page cache, llama.cpp graph allocation
    return statistics.median(fn(*args) for _ in range(runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode", type=int, default=64, help="tokens generated per decode run")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens per prefill run")
    args = ap.parse_args()
    path = args.model or default_model_path()
    model = Model(path)
    prompt = random_prompt(args.prefill, model.hp.n_vocab)

    rows = [
        ("decode", median_of(args.runs, colibri_decode, model, args.decode)),
        (f"prefill {args.prefill}", median_of(args.runs, colibri_prefill, model, prompt)),
    ]
    llm = llama_engine(path, args.prefill + args.decode + 64)
    peer = []
    if llm is not None:
        peer = [
            median_of(args.runs, llama_decode, llm, args.decode, model.hp.n_vocab),
            median_of(args.runs, llama_prefill, llm, prompt),
        ]
    print(f"model {path.name}, {os.cpu_count()} cores, median of {args.runs} runs")
    print(f"{'':14}{'colibri tok/s':>15}{'llama.cpp tok/s':>17}{'ratio':>8}")
    for i, (name, ours) in enumerate(rows):
        if peer:
            print(f"{name:14}{ours:15.1f}{peer[i]:17.1f}{ours / peer[i]:8.2f}")
        else:
            print(f"{name:14}{ours:15.1f}{'(not installed)':>17}")


if __name__ == "__main__":
    main()
