"""Prefill at the prompt lengths agents send: colibri against llama.cpp on the same file, 2 threads.

    python bench/bench_prefill.py [--model PATH] [--lengths 512,2048,4096,8192] [--runs 3] [--json PATH]

For each length, a prompt of that many random token ids (seeded: the same ids on both sides) is
evaluated from an empty cache, and the figure is prompt tokens over the wall time of the whole
evaluation. Each run is a fresh process per side (colibri: the engine's forward in chunks of the
engine's ``--prefill-chunk``, as ``coli serve`` and ``coli run`` prefill, after a 256-token
warm-up; llama.cpp: ``Llama.eval``, n_batch 512, after a warm-up on the first 512 ids, once
without and once with its flash attention), the sides alternating run by run; each figure is the
median of --runs runs, and llama.cpp's is its better mode's. Attention over the cache grows with
the square of the prompt, so the long rows measure the attention kernels as much as the matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import colibri
from colibri import settings

PEER_ENV = {k: v for k, v in os.environ.items() if k not in colibri.ENV_SET}
ROOT = Path(__file__).resolve().parent.parent
THREADS = "2"
WARMUP = 256
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import random_prompt as prompt_ids  # noqa: E402  (the same seeded ids)


def colibri_worker(model: Path, n: int) -> dict:
    """One prefill of ``n`` ids in this process, after a warm-up (compiled code, page cache)."""
    from colibri.model.generate import SingleSequence
    from colibri.model.loader import Model

    m = Model(model)
    chunk = settings.PREFILL_CHUNK.default
    ids = prompt_ids(n, m.hp.n_vocab)
    SingleSequence(m, WARMUP + 8, chunk).prefill(ids[:WARMUP])
    seq = SingleSequence(m, n + 8, chunk)
    start = time.perf_counter()
    seq.prefill(ids)
    return {"prefill_tps": n / (time.perf_counter() - start), "chunk": chunk}


def child(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def colibri_run(model: Path, n: int) -> float:
    env = {**os.environ, "NUMBA_NUM_THREADS": THREADS}
    cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--lengths", str(n)]
    return child(cmd, env)["prefill_tps"]


def peer_run(model: Path, ids: list[int], flash: bool) -> float:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_peer.py"), "prefill", "--model", str(model),
           "--prompt", ",".join(map(str, ids)), "--runs", "1"] + (["--flash-attn"] if flash else [])
    return child(cmd, PEER_ENV)["prefill_tps"]


def n_vocab_of(model: Path) -> int:
    from colibri.model.loader import Model

    return Model(model).hp.n_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--lengths", default="512,2048,4096,8192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model or settings.default_model_path()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        print(json.dumps(colibri_worker(model, lengths[0])))
        return
    n_vocab = n_vocab_of(model)
    print(f"\n### prefill, {model.name}, 2 threads, median of {args.runs} runs\n")
    print("| prompt tokens | colibri tok/s | llama.cpp tok/s (no FA / FA) | ratio to the better |")
    print("|---:|---:|---:|---:|")
    results = []
    for n in lengths:
        ids = prompt_ids(n, n_vocab)
        ours: list[float] = []
        plain: list[float] = []
        flash: list[float] = []
        for _ in range(args.runs):
            ours.append(colibri_run(model, n))
            plain.append(peer_run(model, ids, False))
            flash.append(peer_run(model, ids, True))
        c, p, f = (statistics.median(x) for x in (ours, plain, flash))
        best = max(p, f)
        print(f"| {n} | {c:.0f} | {p:.0f} / {f:.0f} | {c / best:.2f}× |", flush=True)
        results.append({"tokens": n, "colibri": ours, "llama_cpp": plain, "llama_cpp_flash": flash,
                        "ratio": c / best})
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "runs": args.runs, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
