"""The MoE headline: colibri's expert store against llama.cpp on the same file, under memory caps.

    python bench/bench_moe_peer.py [--arch llama|llama-q4km|qwen3moe|glm4moe|deepseek2|gpt-oss | --gguf PATH]
        [--caps 1.5:0.6,1.0:0.3]
        [--tokens 64] [--runs 3] [--no-uncapped] [--read-mbps N] [--readahead-ways] [--no-peer]

The file is tools/make_synthetic_moe.py's, written on first use, with a placeholder SentencePiece
vocabulary so that llama.cpp loads it: ``--arch llama`` (the default) 24 layers x 64 experts of
1024x1024 Q4_0, top-4, 2.58 GiB; ``--arch qwen3moe`` Qwen3-MoE's layout scaled down (``QWEN3MOE``:
24 layers x 64 experts of 768 x 1024, top-8, q/k norms, 16 heads of 128) in llama.cpp's Q4_K_M mix,
2.12 GiB; ``--arch glm4moe`` GLM-4.5-Air's (``GLM4MOE``: a dense first layer, then 64 experts of 768
x 1024, top-8, plus a shared one, sigmoid routing with a selection bias, q/k/v biases, 24 heads of
128, half of each rotated) in the same mix, 2.09 GiB; ``--arch deepseek2`` DeepSeek-V2-Lite's
(``DEEPSEEK2``: latent attention, a dense first layer, then 64 experts of 768 x 1024, top-6, plus
two shared ones, softmax routing) in the same mix; ``--arch gpt-oss`` gpt-oss-20b's (``GPT_OSS``:
64 experts of 1024 x 1024 in MXFP4, top-4, biases, sinks, sliding layers, the rest Q8_0), 1.4 GiB;
``--arch llama-q4km`` the llama file
requantized by llama.cpp's own quantizer to its Q4_K_M mix (once, cached), 2.98 GB. Each case is a
memory cap (GB, RSS plus page cache, as a small machine's RAM: ``memcap.py`` says how it is applied
here) and colibri's ``--ram-budget`` (GiB) under it, then one case with no cap and no budget.
``--read-mbps`` also makes the disk slow (every run's reads throttled: ``readcap.py``) and implies
``--readahead-ways``: beside "colibri" (whose store measures whether reading ahead pays), colibri
reading ahead always and never, in the capped cases (uncapped there is nothing to read ahead).
``--no-peer``: colibri's ways only.
Every run is one fresh worker process started inside its cgroup, after the file's pages are dropped
from the page cache; the sides alternate run by run. Each worker prefills the same prompt, then
samples ``--tokens`` tokens at temperature 1 (a random model's greedy output loops over a few
tokens, and so would its routing); only those steps are timed, start-up excluded on both sides.
Then, in the same warm worker, a PREFILL_TOKENS prompt (the same random ids both sides) is
prefilled and timed: colibri in its default steps for a prompt alone (512 tokens,
``settings.prefill_chunks``), llama.cpp in one 512-token micro-batch; the table's row under each
case.

- **colibri**: ``Model(path, ram_budget)``, the hottest experts of an earlier generation pinned at
  start (their heat, as ``.coli_usage`` carries it between runs; pinning is start-up).
- **llama.cpp** (llama-cpp-python, the Makefile's ``peer`` build, 2 threads, mmap): under a cap with
  ``use_extra_bufts = False``, since its default repacks every Q4_0 tensor into an anonymous copy,
  which a cap smaller than the file kills; with no cap both ways, and the faster one is its figure.

Printed per case: tok/s (median of ``--runs``), the ratio, each side's peak memory (the cgroup's
peak of RSS plus page cache, and the worker's peak RSS) and out-of-memory kills.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import colibri

# The OpenMP and BLAS settings colibri's import set (``colibri.ENV_SET``): llama.cpp's workers drop
# them (recorded by the parent, whose import is the first, and inherited by every worker), so that
# the peer starts its OpenMP at its own defaults.
os.environ.setdefault("COLI_BENCH_PEER_UNSET", ",".join(colibri.ENV_SET))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402  (the synthetic model, the prompt, the decode loop, the cache drop)
from memcap import MemoryCap  # noqa: E402
from readcap import ReadCap  # noqa: E402

from colibri.store.readahead import Mode, ReadAheadPolicy  # noqa: E402

THREADS = 2
DEFAULT_CAPS = "1.5:0.6,1.0:0.3"  # cap GB : colibri --ram-budget GiB, the README's table
HEAT_TOKENS = 128  # the earlier generation whose heat colibri pins (bench_moe's warm-up)
RUN_TIMEOUT_S = 1800  # a thrashing run at a small cap is slow, not stuck
# The prefill row: a prompt of this many tokens, after the decode run (the same warm process), in
# the engines' own steps (colibri's --prefill-chunk default for a MoE model's prompt alone,
# ``settings.prefill_chunks``; llama.cpp's default micro-batch).
PREFILL_TOKENS = 512
LLAMA_UBATCH = 512
# The ways --read-mbps (or --readahead-ways) adds beside "colibri" (whose read-ahead is measured,
# colibri/store/readahead.py): the read-ahead always on, and never.
READAHEAD_WAYS = {"colibri, read-ahead on": "on", "colibri, no read-ahead": "off"}
NO_RESULT = {"tok_s": None, "cg_peak": None, "rss": None, "oom": 0}  # a side not run (--no-peer)
CACHE = Path.home() / ".cache" / "colibri" / "bench"
# The real-architecture file: Qwen3-30B-A3B's shape (48 layers, 128 experts of 768 x 2048, top-8,
# 32 heads of 128, 4 KV heads) at half its width, half its depth and half its experts.
QWEN3MOE = dict(arch="qwen3moe", n_layers=24, n_experts=64, n_used=8, n_embd=1024, n_ff=768,
                n_heads=16, n_kv_heads=4, head_dim=128, n_vocab=4096)
# GLM-4.5-Air's shape (46 layers, 128 experts of 1408 x 4096 plus a shared one, top-8, 96 heads of
# 128, 8 KV heads, half of each head rotated, one leading dense layer) at a quarter of its width and
# half its depth and experts; its experts as narrow as QWEN3MOE's, so the two files compare.
GLM4MOE = dict(arch="glm4moe", n_layers=24, n_experts=64, n_used=8, n_embd=1024, n_ff=768,
               n_heads=24, n_kv_heads=2, head_dim=128, n_vocab=4096)
# DeepSeek-V2-Lite's shape (27 layers, 64 experts of 1408 x 2048 top-6 plus two shared, 16 heads of
# latent attention: kv_lora 512, nope 128, rope 64, value 128) at half its width (the attention's
# too: make_synthetic_moe.DEEPSEEK_MLA), its experts as narrow as the others'.
DEEPSEEK2 = dict(arch="deepseek2", n_layers=24, n_experts=64, n_used=6, n_embd=1024, n_ff=768,
                 n_heads=16, n_kv_heads=1, head_dim=64, n_vocab=4096)
# gpt-oss-20b's shape (24 layers, 32 experts of 2880 x 2880 top-4, 64 heads of 64, 8 KV heads,
# sinks, sliding layers) at about a third of its width, twice its experts (the other files' count):
# MXFP4 experts, the rest Q8_0, as llama.cpp's MXFP4_MOE writes it (tools/synthetic_gpt_oss.py).
GPT_OSS = dict(arch="gpt-oss", n_layers=24, n_experts=64, n_used=4, n_embd=1024, n_ff=1024,
               n_heads=16, n_kv_heads=4, head_dim=64, n_vocab=4096)
FILES = {"llama": (bench_moe.DEFAULT_GGUF, {}), "qwen3moe": (CACHE / "synthetic-qwen3moe.gguf", QWEN3MOE),
         "glm4moe": (CACHE / "synthetic-glm4moe.gguf", GLM4MOE),
         "deepseek2": (CACHE / "synthetic-deepseek2.gguf", DEEPSEEK2),
         "gpt-oss": (CACHE / "synthetic-gpt-oss.gguf", GPT_OSS)}
# ``--arch llama-q4km``: the Q4_0 file requantized by llama.cpp's own quantizer to its Q4_K_M mix
# (``llama_model_quantize``, ``allow_requantize``), as the K-quant files people download are made.
REQUANTIZED = {"llama-q4km": ("llama", "Q4_K_M")}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- the workers (one process per run) -------------------------------------------------------------


def work_colibri(args) -> dict:
    from colibri.model.generate import SingleSequence
    from colibri.model.loader import Model
    from colibri.settings import gb_to_bytes, prefill_chunks

    t0 = time.perf_counter()
    model = Model(args.gguf, ram_budget=None if args.budget is None else gb_to_bytes(args.budget))
    model.decoder.experts.readahead = ReadAheadPolicy(Mode(args.readahead))
    pinned = model.decoder.experts.pin_hottest(np.load(args.heat)) if args.heat else 0
    start_s = time.perf_counter() - t0
    ids, elapsed = bench_moe.decode(model, args.tokens)
    policy = model.decoder.experts.readahead
    prompt = prefill_prompt(model.hp.n_vocab)
    seq = SingleSequence(model, len(prompt) + 8, prefill_chunks(None, True, model.streams_experts).alone)
    start = time.perf_counter()
    seq.prefill(prompt)
    prefill_s = time.perf_counter() - start
    return {"tok_s": args.tokens / elapsed, "rss": peak_rss(), "start_s": start_s, "pinned": pinned,
            "readahead_kept": policy.chosen if policy.decisions else None,
            "prefill_tok_s": len(prompt) / prefill_s}


def prefill_prompt(n_vocab: int) -> list[int]:
    """The prefill row's prompt: the same PREFILL_TOKENS ids on both sides (random, away from the
    control tokens at the start of the vocabulary)."""
    return np.random.default_rng(7).integers(16, n_vocab, PREFILL_TOKENS).tolist()


def work_llama(args) -> dict:
    for name in filter(None, os.environ["COLI_BENCH_PEER_UNSET"].split(",")):
        os.environ.pop(name, None)  # before libgomp loads with llama.cpp and reads them
    import llama_cpp as lib

    t0 = time.perf_counter()
    lib.llama_backend_init()
    mp = lib.llama_model_default_params()
    mp.use_mmap, mp.use_extra_bufts = True, bool(args.repack)
    model = lib.llama_model_load_from_file(str(args.gguf).encode(), mp)
    if not model:
        raise SystemExit("llama.cpp could not load the model")
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 256, 64, THREADS, THREADS
    ctx = lib.llama_init_from_model(model, cp)
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(1.0))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(bench_moe.SAMPLING_SEED))
    prompt = (lib.llama_token * len(bench_moe.PROMPT))(*bench_moe.PROMPT)
    if lib.llama_decode(ctx, lib.llama_batch_get_one(prompt, len(bench_moe.PROMPT))) != 0:
        raise SystemExit("llama_decode failed on the prompt")
    start_s = time.perf_counter() - t0
    one = (lib.llama_token * 1)()
    start = time.perf_counter()
    for _ in range(args.tokens):
        one[0] = lib.llama_sampler_sample(chain, ctx, -1)
        if lib.llama_decode(ctx, lib.llama_batch_get_one(one, 1)) != 0:
            raise SystemExit("llama_decode failed")
    tok_s = args.tokens / (time.perf_counter() - start)
    cp.n_ctx, cp.n_batch, cp.n_ubatch = PREFILL_TOKENS + 64, PREFILL_TOKENS, LLAMA_UBATCH
    pctx = lib.llama_init_from_model(model, cp)
    ids = prefill_prompt(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
    batch = (lib.llama_token * len(ids))(*ids)
    start = time.perf_counter()
    if lib.llama_decode(pctx, lib.llama_batch_get_one(batch, len(ids))) != 0:
        raise SystemExit("llama_decode failed on the prefill prompt")
    prefill_s = time.perf_counter() - start
    return {"tok_s": tok_s, "rss": peak_rss(), "start_s": start_s, "prefill_tok_s": len(ids) / prefill_s}


def work_heat(args) -> dict:
    """The heat of a HEAT_TOKENS generation from bench_moe's warm-up prompt, saved for the runs."""
    from colibri.model.generate import SingleSequence
    from colibri.model.loader import Model
    from colibri.model.sampling import Sampler, SamplingParams

    model = Model(args.gguf, ram_budget=0)
    seq = SingleSequence(model, len(bench_moe.WARMUP_PROMPT) + HEAT_TOKENS + 8, 64)
    sampler, out = Sampler(SamplingParams(temperature=1.0, seed=bench_moe.SAMPLING_SEED + 1)), []
    logits = seq.prefill(bench_moe.WARMUP_PROMPT)[-1]
    for _ in range(HEAT_TOKENS):
        out.append(sampler(logits, out))
        logits = seq.step(np.array([out[-1]]), False)[-1]
    np.save(args.heat, model.decoder.experts.heat)
    return {}


# -- the parent: cases, runs, the table ------------------------------------------------------------


def worker_argv(side: str, gguf: Path, tokens: int, budget: float | None = None, heat: Path | None = None,
                repack: bool = False, readahead: str = "auto") -> list[str]:
    argv = [sys.executable, __file__, "worker", side, "--gguf", str(gguf), "--tokens", str(tokens)]
    if budget is not None:
        argv += ["--budget", str(budget)]
    if heat is not None:
        argv += ["--heat", str(heat)]
    return argv + (["--repack"] if repack else []) + (["--readahead", readahead] if side == "colibri" else [])


def run_one(cap: MemoryCap, argv: list[str], gguf: Path, limit: int | None, reads: ReadCap | None) -> dict:
    bench_moe.drop_cache(gguf)
    if reads is None:
        r = cap.run(argv, limit, RUN_TIMEOUT_S)
    else:
        with reads.group() as procs:
            r = cap.run(argv, limit, RUN_TIMEOUT_S, also_join=procs)
    if r.returncode != 0:
        return {"tok_s": 0.0, "oom": r.oom_killed, "cg_peak": r.peak_bytes, "rss": None,
                "error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {**out, "oom": False, "cg_peak": r.peak_bytes}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def measure_case(cap: MemoryCap, args, limit_gb: float | None, budget: float | None, heat: Path,
                 reads: ReadCap | None = None) -> dict:
    """Both sides' runs for one case, alternating; with no cap, llama.cpp both with and without
    its repacking; with ``args.readahead_ways``, colibri also with its read-ahead always on and
    never (``--no-peer``: colibri's ways only)."""
    limit = None if limit_gb is None else int(limit_gb * 1e9)
    ways = {"colibri": worker_argv("colibri", args.gguf, args.tokens, budget, heat)}
    if not args.no_peer:
        ways["llama.cpp"] = worker_argv("llama", args.gguf, args.tokens, repack=False)
        if limit_gb is None:
            ways["llama.cpp repack"] = worker_argv("llama", args.gguf, args.tokens, repack=True)
    if args.readahead_ways and budget is not None:  # no budget: nothing is ever read ahead
        for way, mode in READAHEAD_WAYS.items():
            ways[way] = worker_argv("colibri", args.gguf, args.tokens, budget, heat, readahead=mode)
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for i in range(args.runs):
        for way, argv in ways.items():
            runs[way].append(run_one(cap, argv, args.gguf, limit, reads))
            r = runs[way][-1]
            kept = r.get("readahead_kept")
            prefill = f", prefill {r['prefill_tok_s']:.1f} tok/s" if r.get("prefill_tok_s") else ""
            print(f"    {way} run {i + 1}: {r['tok_s']:.2f} tok/s{prefill}" + (" (OOM)" if r["oom"] else "")
                  + (f" {r['error']}" if "error" in r else "")
                  + ("" if kept is None else f" (read-ahead {'kept' if kept else 'dropped'})"), flush=True)
    return {way: {"tok_s": median_of(rs, "tok_s"), "prefill_tok_s": median_of(rs, "prefill_tok_s"),
                  "cg_peak": median_of(rs, "cg_peak"),
                  "rss": median_of(rs, "rss"), "oom": sum(r["oom"] for r in rs), "runs": len(rs)}
            for way, rs in runs.items()}


def gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def print_table(results: list[tuple[str, dict]], file_bytes: int) -> None:
    print(f"\n{'case':<30}{'colibri':>9}{'llama.cpp':>11}{'ratio':>8}   peak GB (cgroup / RSS): "
          f"colibri, llama.cpp   [file {file_bytes / 1e9:.2f} GB]")
    for case, r in results:
        c = r["colibri"]
        peers = [w for w in r if w.startswith("llama") and r[w]["tok_s"]]
        best = max(peers, key=lambda w: r[w]["tok_s"]) if peers else "llama.cpp"
        p = r.get(best, NO_RESULT)
        ran = best in r  # not with --no-peer
        ratio = c["tok_s"] / p["tok_s"] if p["tok_s"] else float("inf")
        note = f"  (llama.cpp: {best}" + (f", {p['oom']} OOM" if p["oom"] else "") + ")" if ran else ""
        peer = f"{p['tok_s'] or 0:11.2f}{ratio:7.2f}x" if ran else f"{'-':>11}{'-':>8}"
        rss_share = f"  [colibri's RSS {c['rss'] / file_bytes:.3f}x the file]" if c["rss"] else ""
        print(f"{case:<30}{c['tok_s']:9.2f}{peer}   "
              f"{gb(c['cg_peak'])} / {gb(c['rss'])}, {gb(p['cg_peak'])} / {gb(p['rss'])}{note}{rss_share}")
        for w in peers:
            if w != best:
                print(f"{'':<30}{'':>9}{r[w]['tok_s']:11.2f}  ({w})")
        prefills = [w for w in peers if r[w].get("prefill_tok_s")]
        if c.get("prefill_tok_s") and prefills:
            fast = max(prefills, key=lambda w: r[w]["prefill_tok_s"])
            pf = r[fast]["prefill_tok_s"]
            print(f"{'  prefill ' + str(PREFILL_TOKENS) + ' tokens':<30}{c['prefill_tok_s']:9.1f}{pf:11.1f}"
                  f"{c['prefill_tok_s'] / pf:7.2f}x   (llama.cpp: {fast})")
        elif c.get("prefill_tok_s"):
            print(f"{'  prefill ' + str(PREFILL_TOKENS) + ' tokens':<30}{c['prefill_tok_s']:9.1f}")
        for w in READAHEAD_WAYS:
            if w in r:
                n = r[w]
                print(f"{'':<30}{n['tok_s'] or 0:9.2f}{'':>11}{'':>8}   {gb(n['cg_peak'])} / {gb(n['rss'])}"
                      f"  ({w}; colibri is {c['tok_s'] / n['tok_s'] if n['tok_s'] else 0:.2f}x this)")


def parse_caps(text: str) -> list[tuple[float, float]]:
    caps = []
    for part in filter(None, text.split(",")):
        cap, _, budget = part.partition(":")
        caps.append((float(cap), float(budget)))
    return caps


def parse_args() -> argparse.Namespace:
    """The benchmark's options, and the worker's (one process per run)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("side", choices=("colibri", "llama", "heat"))
    w.add_argument("--gguf", type=Path, required=True)
    w.add_argument("--tokens", type=int, default=64)
    w.add_argument("--budget", type=float, default=None, help="colibri's --ram-budget, GiB (none: no limit)")
    w.add_argument("--heat", type=Path, default=None)
    w.add_argument("--repack", action="store_true")
    w.add_argument("--readahead", choices=[m.value for m in Mode], default="auto",
                   help="colibri's read-ahead: measured (auto, the default), always, never")
    ap.add_argument("--arch", choices=sorted([*FILES, *REQUANTIZED]), default="llama",
                    help="which synthetic file (written on first use): llama Q4_0, qwen3moe and "
                         "glm4moe Q4_K_M, llama-q4km the llama file requantized by llama.cpp")
    ap.add_argument("--gguf", type=Path, default=None, help="any MoE GGUF instead of --arch's file")
    ap.add_argument("--caps", default=DEFAULT_CAPS, help="CAP_GB:BUDGET_GIB,... (empty: uncapped only)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-uncapped", action="store_true")
    ap.add_argument("--read-mbps", type=float, default=None,
                    help="throttle every run's reads of the file's disk to this many MB/s (a slow disk); "
                         "implies --readahead-ways")
    ap.add_argument("--readahead-ways", action="store_true",
                    help="also run colibri with its read-ahead always on and never")
    ap.add_argument("--no-peer", action="store_true", help="colibri's ways only, no llama.cpp")
    ap.add_argument("--json", type=Path, default=None, help="also write the medians here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.mode == "worker":
        print(json.dumps({"colibri": work_colibri, "llama": work_llama, "heat": work_heat}[args.side](args)))
        return
    args.readahead_ways |= args.read_mbps is not None
    if args.gguf is None:
        base, ftype = REQUANTIZED.get(args.arch, (args.arch, None))
        args.gguf, shape = FILES[base]
        if not args.gguf.exists():
            args.gguf.parent.mkdir(parents=True, exist_ok=True)
            print(f"writing {args.gguf} ...", flush=True)
            bench_moe.load_tool().write_synthetic_moe(args.gguf, **shape)
        if ftype is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.quant_harness import quantized

            print(f"requantizing {args.gguf.name} to {ftype} with llama.cpp (once) ...", flush=True)
            args.gguf = quantized(args.gguf, ftype, CACHE)
    cap = MemoryCap.detect()
    reads = None
    if args.read_mbps is not None:
        reads = ReadCap.detect(args.gguf, int(args.read_mbps * 1e6))
        if reads.method is None or cap.method != "cgroup1":
            raise SystemExit(f"--read-mbps: cannot throttle reads here: {reads.describe()} "
                             f"(memory cap: {cap.describe()})")
    file_bytes = args.gguf.stat().st_size
    print(f"model {args.gguf.name} ({file_bytes / 1e9:.2f} GB), {args.tokens} tokens sampled at "
          f"temperature 1, {THREADS} threads, median of {args.runs}; cap: {cap.describe()}; "
          f"{os.cpu_count()} CPUs" + (f"; disk: {reads.describe()}" if reads else ""), flush=True)
    heat = CACHE / f"{args.gguf.stem}-heat.npy"
    CACHE.mkdir(parents=True, exist_ok=True)  # the heat worker writes there, on a new machine too
    cap.run(worker_argv("heat", args.gguf, HEAT_TOKENS, heat=heat), None, RUN_TIMEOUT_S)
    cases = [] if cap.method is None else [(f"cap {c:g} GB (--ram-budget {b:g})", c, b)
                                           for c, b in parse_caps(args.caps)]
    if cap.method is None and args.caps:
        print(f"the capped cases are skipped: no way to cap memory here ({cap.why})")
    if not args.no_uncapped:
        cases.append(("no cap (--ram-budget inf)", None, None))
    results = []
    for name, limit_gb, budget in cases:
        print(f"  {name}", flush=True)
        results.append((name, measure_case(cap, args, limit_gb, budget, heat, reads)))
    print_table(results, file_bytes)
    if args.json is not None:
        args.json.write_text(json.dumps({"cap": cap.describe(), "file_bytes": file_bytes,
                                         "cases": dict(results)}, indent=1))


if __name__ == "__main__":
    main()
