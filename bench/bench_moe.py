"""The expert store against plain mmap, on a synthetic MoE several times larger than the budget.

    python bench/bench_moe.py [--gguf PATH] [--budget-gb 0.5] [--tokens 32] [--runs 3]

The model is tools/make_synthetic_moe.py's (default: 24 layers x 64 experts of 1024x1024 Q4_0,
top-4, ~2.6 GiB of experts; written once to ~/.cache/colibri/bench/). Each run starts with the
file's pages dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``) and decodes
``--tokens`` tokens from the same prompt, one stream, sampled at temperature 1 with a fixed seed
(a random model's greedy output loops over a few tokens, and so would its routing), in two ways:

- **store**: a RAM budget of ``--budget-gb``; the hottest experts of a warm-up generation (its heat,
  as ``.coli_usage`` would carry it) pinned at start, the rest of the budget for recent experts,
  the next layer's experts read ahead (``MADV_WILLNEED``) while the current one computes.
- **no-ahead**: the store as above without the read-ahead, to show what the read-ahead adds.
- **mmap**: no resident copies and no read-ahead: every expert use packs from the mmap, through
  page faults (the page cache is all the caching there is), the way a plain mmap engine reads its
  experts. The store's own misses read by ``pread`` instead (``docs/store.md``).

Printed per way (medians over ``--runs``): tokens per second, the store's hit rate, file bytes of
missed experts per token, and the bound ``1 / (resident_bytes / RAM_bw + missed_bytes / disk_bw)``
per token, with both bandwidths measured here first: disk as random expert-sized reads from the
cold file, RAM as a sum over a 512 MiB array. Misses served by the page cache never touch the
disk, so a second bound charges the disk only the bytes it really read (``read_bytes`` of
/proc/self/io) and the other missed bytes at RAM speed. Pinning at start is timed apart (start-up, not
decode). Both ways must give the same tokens; the script checks it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import time
from pathlib import Path

import numpy as np

from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.model.sampling import Sampler, SamplingParams
from colibri.settings import gb_to_bytes
from colibri.store.readahead import Mode, ReadAheadPolicy

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = Path.home() / ".cache" / "colibri" / "bench" / "synthetic-moe.gguf"
PROMPT = [11, 523, 97, 1800, 7, 2999, 64, 310, 42, 1234, 5, 77]
WARMUP_PROMPT = [900, 13, 2048, 8, 377, 61, 1500, 4000, 21, 6]
DISK_PROBES = 256  # random expert-slice reads for the disk bandwidth
RAM_PROBE_BYTES = 512 << 20
SAMPLING_SEED = 7
WARMUP_TOKENS = 128  # the earlier workload whose heat is pinned


def load_tool():
    tool = ROOT / "tools" / "make_synthetic_moe.py"
    spec = importlib.util.spec_from_file_location("make_synthetic_moe", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(path: Path, model: Model) -> float:
    """Bytes/s of random expert-slice reads from the cold file."""
    store = model.decoder.experts
    rng = np.random.default_rng(0)
    spans = []
    for _ in range(DISK_PROBES):
        layer = store.layers[int(rng.integers(len(store.layers)))]
        name = store._tensors[layer][int(rng.integers(3))]
        spans.append(store._slice_span(name, int(rng.integers(store.n_experts))))
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        total = sum(len(os.pread(fd, length, offset)) for offset, length in spans)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    drop_cache(path)
    return total / elapsed


def ram_bandwidth() -> float:
    a = np.ones(RAM_PROBE_BYTES // 4, np.float32)
    a.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - start)
    return a.nbytes / best


def dense_bytes_per_token(model: Model) -> int:
    """File bytes every token reads besides the routed experts (attention, norms, routers, head)."""
    return sum(info.nbytes for name, info in model.gguf.tensors.items()
               if "_exps." not in name and name != "token_embd.weight")


def decode(model: Model, tokens: int) -> tuple[list[int], float]:
    seq = SingleSequence(model, len(PROMPT) + tokens + 8, 64)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=SAMPLING_SEED))
    out: list[int] = []
    logits = seq.prefill(PROMPT)[-1]
    start = time.perf_counter()
    for _ in range(tokens):
        token = sampler(logits, out)
        out.append(token)
        logits = seq.step(np.array([token]), False)[-1]
    return out, time.perf_counter() - start


def disk_read_bytes() -> int:
    """Bytes this process has had read from storage (page-cache misses), from /proc/self/io."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def run_way(path: Path, way: str, budget: int | None, heat: np.ndarray | None, tokens: int) -> dict:
    gc.collect()  # earlier runs' models (reference cycles) would keep their pages mapped, so cached
    model = Model(path, ram_budget=budget)
    store = model.decoder.experts
    # "store" always reads ahead, "no-ahead" never: the difference is what the read-ahead adds
    # (a user's store measures which pays, colibri/store/readahead.py; bench_moe_peer.py compares)
    store.readahead = ReadAheadPolicy(Mode.ON if way == "store" else Mode.OFF)
    store.mapped_reads = way == "mmap"
    pinning = way in ("store", "no-ahead")
    model.gguf.advise_dontneed()
    t0 = time.perf_counter()
    pinned = store.pin_hottest(heat) if pinning else 0
    t_pin = time.perf_counter() - t0
    c0, r0 = store.counters(), disk_read_bytes()
    ids, elapsed = decode(model, tokens)
    c1, r1 = store.counters(), disk_read_bytes()
    hits, misses = c1.hits - c0.hits, c1.misses - c0.misses
    steps = tokens + 1  # the prompt's forward step is in the counters too
    return dict(
        ids=ids, tok_s=tokens / elapsed, disk_per_tok=(r1 - r0) / steps,
        hit=100.0 * hits / max(hits + misses, 1), pinned=pinned,
        t_pin=t_pin, missed_per_tok=(c1.missed_bytes - c0.missed_bytes) / steps,
        resident_per_tok=hits * store.expert_nbytes / steps + dense_bytes_per_token(model),
        ram_gb=store.tier_counts()[2] / (1 << 30),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--budget-gb", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not args.gguf.exists():
        args.gguf.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {args.gguf} ...", flush=True)
        load_tool().write_synthetic_moe(args.gguf)
    budget = gb_to_bytes(args.budget_gb)

    probe = Model(args.gguf, ram_budget=None)
    store = probe.decoder.experts
    expert_gb = len(store.layers) * store.n_experts * store.expert_file_bytes / (1 << 30)
    disk_bw, ram_bw = disk_bandwidth(args.gguf, probe), ram_bandwidth()
    print(f"model {args.gguf.name}: {len(store.layers)} MoE layers x {store.n_experts} experts, "
          f"top-{store.n_used}, experts {expert_gb:.2f} GiB, budget {args.budget_gb:.2f} GiB "
          f"({expert_gb / max(args.budget_gb, 1e-9):.1f}x smaller)")
    print(f"measured: disk {disk_bw / 1e9:.2f} GB/s (random expert reads, cold), RAM {ram_bw / 1e9:.1f} GB/s")

    warm = SingleSequence(probe, len(WARMUP_PROMPT) + WARMUP_TOKENS + 8, 64)
    sampler, out = Sampler(SamplingParams(temperature=1.0, seed=SAMPLING_SEED + 1)), []
    logits = warm.prefill(WARMUP_PROMPT)[-1]
    for _ in range(WARMUP_TOKENS):  # the warm-up's routing heat stands in for .coli_usage
        out.append(sampler(logits, out))
        logits = warm.step(np.array([out[-1]]), False)[-1]
    heat = store.heat.copy()
    del probe, warm, store
    gc.collect()

    results: dict[str, list[dict]] = {"store": [], "no-ahead": [], "mmap": []}
    for _ in range(args.runs):
        for way in results:
            results[way].append(run_way(args.gguf, way, 0 if way == "mmap" else budget, heat, args.tokens))
    if len({tuple(r[0]["ids"]) for r in results.values()}) != 1:
        raise SystemExit("the ways generated different tokens")

    print(f"{args.tokens} sampled tokens (seeded), one stream, cold page cache each run, "
          f"median of {args.runs}")
    print(f"{'way':>9}{'tok/s':>8}{'hit %':>7}{'miss MB/tok':>12}{'res MB/tok':>11}{'bound tok/s':>12}"
          f"{'of bound':>9}{'disk MB/tok':>12}{'of disk bound':>14}{'RAM GB':>8}{'pin s':>7}")
    summary = {}
    for way, runs in results.items():
        def med(key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs)
        bound = 1.0 / (med("resident_per_tok") / ram_bw + med("missed_per_tok") / disk_bw)
        # the same bound charging the disk only what it really read (the rest of the misses came
        # from the page cache, at RAM speed)
        from_cache = max(med("missed_per_tok") - med("disk_per_tok"), 0.0)
        disk_bound = 1.0 / ((med("resident_per_tok") + from_cache) / ram_bw + med("disk_per_tok") / disk_bw)
        summary[way] = med("tok_s")
        print(f"{way:>9}{med('tok_s'):8.2f}{med('hit'):7.1f}{med('missed_per_tok') / 1e6:12.1f}"
              f"{med('resident_per_tok') / 1e6:11.1f}{bound:12.2f}{med('tok_s') / bound:9.2f}"
              f"{med('disk_per_tok') / 1e6:12.1f}{med('tok_s') / disk_bound:14.2f}"
              f"{med('ram_gb'):8.2f}{med('t_pin'):7.2f}")
    print(f"store / mmap: {summary['store'] / summary['mmap']:.2f}x")


if __name__ == "__main__":
    main()
