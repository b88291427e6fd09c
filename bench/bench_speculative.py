"""Speculative decoding: prompt lookup against speculation off and against llama.cpp's own.

    python bench/bench_speculative.py [--model PATH] [--runs 3] [--draft 8] [--json PATH]

Three workloads of this bench's own, each one chat turn, greedy:

- **code edit**: a ~400-token Python function given, the same function asked back with one
  change (a variable renamed): an edit re-emits most of what it was given;
- **grounded answer**: a ~300-token policy text, its lines broken at ~100 characters as a
  plain-text document's are, and a question whose answer quotes a paragraph of it (the model
  quotes it as flowing text: ``sched/lookup.py``'s joined lines);
- **open chat**: a story, where the prompt holds nothing to copy.

colibri: ``coli engine`` (mux protocol) with ``--speculative off`` and ``--speculative ngram``
(``--draft-max`` = --draft), its DONE's decode tok/s (first token to the last, prefill excluded).
llama.cpp: ``bench_peer.py lookup`` in a fresh process per run, ``Llama.generate`` greedy without
drafts and with ``LlamaPromptLookupDecoding(num_pred_tokens=--draft)``, the same prompt ids, the
same measure. 2 threads each, one side at a time, the sides alternating run by run; medians of
--runs. Then the open chat at 16 streams at once (16 prompts, one per slot), colibri's aggregate
decode tok/s with speculation off and on. The greedy answers of colibri off and on must be the
same tokens: the bench stops if they are not. ``tok/step`` is the tokens each forward step gave the
turn with speculation (the last run's), a figure the host's noise does not move.
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
from colibri.io.events import Data, Done, Error, Perf, Prof, Ready, Submit
from colibri.io.mux import ResponseReader, encode_request

PEER_ENV = {k: v for k, v in os.environ.items() if k not in colibri.ENV_SET}
ROOT = Path(__file__).resolve().parent.parent
THREADS = "2"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import QUESTIONS  # noqa: E402

FUNCTION = '''def summarize_orders(orders, currency="EUR", min_total=0.0):
    """Group orders by customer and return one summary row per customer, largest total first.

    Each order is a dict with the keys "customer", "amount", "currency" and "status". Orders that
    were cancelled or refunded are skipped, and amounts in another currency are left out.
    """
    totals = {}
    counts = {}
    largest = {}
    for order in orders:
        if order.get("status") in ("cancelled", "refunded"):
            continue
        if order.get("currency", currency) != currency:
            continue
        customer = order["customer"].strip().lower()
        if not customer:
            raise ValueError("an order without a customer: " + repr(order))
        amount = float(order.get("amount", 0.0))
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        if amount > largest.get(customer, 0.0):
            largest[customer] = amount
    grand_total = sum(totals.values()) or 1.0
    rows = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        rows.append({
            "customer": customer,
            "orders": counts[customer],
            "total": round(total, 2),
            "average": round(average, 2),
            "largest": round(largest[customer], 2),
            "share": round(total / grand_total, 4),
        })
    rows.sort(key=lambda row: row["total"], reverse=True)
    return rows
'''
POLICY = """Returns and refunds. You may return most new, unopened items within 30 days of delivery for a
full refund. We also accept returns of opened items within 14 days if they are in their original
condition and packaging; a restocking fee of 10 percent applies to opened electronics.

Warranty. Every product we sell is covered by a limited warranty of two years from the date of
delivery. The warranty covers defects in materials and workmanship under normal use. It does not
cover damage caused by accidents, misuse, unauthorized repairs, or normal wear and tear. To make a
claim, contact our support team with your order number and a short description of the problem; we
will repair or replace the product, or refund its price if neither is possible.

Shipping. Orders placed before 2 pm on a working day are shipped the same day. Standard delivery
takes three to five working days; express delivery takes one to two working days and costs extra.
We ship to every country in the European Union, to Switzerland and to Norway.

Privacy. We use your address and phone number only to deliver your order and to contact you about
it. We never sell your personal data, and you can ask us to delete it at any time."""
WORKLOADS = {
    "code edit": (f"Here is a Python function:\n\n```python\n{FUNCTION}```\n\nRewrite this function "
                  "with one change: rename the variable `rows` to `summary`. Reply with the whole "
                  "function in a code block.", 450),
    "grounded answer": (f"{POLICY}\n\nWhat does the warranty cover? Quote the paragraph about the "
                        "warranty word for word.", 250),
    "open chat": ("Tell me a story about a dragon who learns to cook.", 200),
}
OPEN_PROMPTS = QUESTIONS  # bench_engine.py's sixteen: the same open chat at 16 streams
STREAMS_TOKENS = 128


def chat(question: str) -> str:
    return (f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


class Engine:
    """A ``coli engine`` process, 16 slots, no persistence, speculation as asked."""

    def __init__(self, model: Path, mode: str, draft: int) -> None:
        cmd = [sys.executable, "-m", "colibri", "engine", "--model", str(model), "--kv-slots", "16",
               "--no-persist", "--ctx", "2048", "--speculative", mode, "--draft-max", str(draft)]
        env = {**os.environ, "NUMBA_NUM_THREADS": THREADS, "SERVE_PERF": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.reader, self.next_id = ResponseReader(), 1
        for event in self._events():
            if isinstance(event, Ready):
                break

    def _events(self):
        while True:
            data = self.proc.stdout.read1(1 << 16)
            if not data:
                raise RuntimeError("the engine exited")
            yield from self.reader.receive_data(data)

    def run(self, prompts: list[str], max_tokens: int) -> tuple[float, list[dict]]:
        """All ``prompts`` at once, one per slot: (aggregate decode tok/s, each one's outcome)."""
        ids = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        self.proc.stdin.write(b"".join(encode_request(Submit(rid, slot, max_tokens, 0.0, 1.0, p))
                                       for slot, (rid, p) in enumerate(zip(ids, prompts, strict=True))))
        self.proc.stdin.flush()
        outs = {rid: {"text": b"", "drafted": 0, "accepted": 0} for rid in ids}
        first: dict[int, float] = {}
        pending = set(ids)
        steps = 0  # PROF's forward steps (it carries no id: the DONE after it is its turn's)
        for event in self._events():
            rid = getattr(event, "id", 0)
            if isinstance(event, Prof):
                steps = event.forwards
            if isinstance(event, Data) and rid in outs:
                first.setdefault(rid, time.perf_counter())
                outs[rid]["text"] += event.text
            elif isinstance(event, Perf) and rid in outs:
                outs[rid].update(drafted=event.drafted_tokens, accepted=event.accepted_tokens)
            elif isinstance(event, Done) and rid in outs:
                outs[rid].update(tok_s=event.tok_s, emitted=event.emitted, steps=steps)
                pending.discard(rid)
            elif isinstance(event, Error) and rid in outs:
                raise RuntimeError(f"request failed: {event}")
            if not pending:
                break
        seconds = time.perf_counter() - max(first.values())
        return sum(o["emitted"] - 1 for o in outs.values()) / seconds, [outs[rid] for rid in ids]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def peer(model: Path, ids: list[int], max_tokens: int, draft: int, stops: list[int]) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_peer.py"), "lookup", "--model", str(model),
           "--prompt", ",".join(map(str, ids)), "--tokens", str(max_tokens), "--draft", str(draft),
           "--stops", ",".join(map(str, stops)), "--ctx", "2048"]
    out = subprocess.run(cmd, env=PEER_ENV, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"llama.cpp's worker failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft", type=int, default=settings.DRAFT_MAX.default)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    model = args.model or settings.default_model_path()
    from colibri.model.tokenizer import GGUFTokenizer
    from colibri.store.gguf import GGUFFile

    tok = GGUFTokenizer(GGUFFile(model))
    engines = {mode: Engine(model, mode, args.draft) for mode in ("off", "ngram")}
    for e in engines.values():
        e.run([chat("Hello")], 8)  # warm-up: compiled code, page cache
    rows = {}
    for name, (question, max_tokens) in WORKLOADS.items():
        prompt = chat(question)
        ids = tok.encode(prompt, True)
        figs: dict[str, list[float]] = {"off": [], "ngram": [], "llama": [], "lookup": []}
        texts, counts = {}, []
        for _ in range(args.runs):
            for mode, e in engines.items():
                _, (out,) = e.run([prompt], max_tokens)
                figs[mode].append(out["tok_s"])
                texts.setdefault(mode, out["text"])
                if mode == "ngram":
                    counts.append((out["drafted"], out["accepted"], out["emitted"], out["steps"]))
            for side, draft in (("llama", 0), ("lookup", args.draft)):
                figs[side].append(peer(model, ids, max_tokens, draft, sorted(tok.stop_ids))["decode_tps"])
        if texts["off"] != texts["ngram"]:
            raise SystemExit(f"{name}: the answers with and without speculation differ")
        med = {k: statistics.median(v) for k, v in figs.items()}
        drafted, accepted, emitted, steps = counts[-1]
        rows[name] = {**med, "drafted": drafted, "accepted": accepted, "emitted": emitted, "steps": steps}
    many: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(args.runs):
        for mode, e in engines.items():
            tps, outs = e.run([chat(q) for q in OPEN_PROMPTS], STREAMS_TOKENS)
            many[mode].append(tps)
            if mode == "ngram":
                many_counts = (sum(o["drafted"] for o in outs), sum(o["accepted"] for o in outs))
    streams = {mode: statistics.median(v) for mode, v in many.items()}
    for e in engines.values():
        e.close()
    print(f"decode tok/s, greedy, 2 threads, medians of {args.runs}; drafts of at most {args.draft} tokens")
    print(f"{'workload':<17}{'tokens':>7}{'off':>8}{'ngram':>8}{'x off':>7}{'llama':>8}{'lookup':>8}"
          f"{'x lookup':>9}{'accepted':>10}{'tok/step':>9}")
    for name, r in rows.items():
        print(f"{name:<17}{r['emitted']:>7}{r['off']:>8.1f}{r['ngram']:>8.1f}{r['ngram'] / r['off']:>7.2f}"
              f"{r['llama']:>8.1f}{r['lookup']:>8.1f}{r['ngram'] / r['lookup']:>9.2f}"
              f"{r['accepted']:>5}/{r['drafted']:<4}{r['emitted'] / max(r['steps'], 1):>9.2f}")
    print(f"open chat, 16 streams at once, aggregate: off {streams['off']:.1f}, ngram "
          f"{streams['ngram']:.1f} ({streams['ngram'] / streams['off']:.2f}x), accepted "
          f"{many_counts[1]}/{many_counts[0]}")
    if args.json:
        figures = {"workloads": rows, "streams16": streams, "streams16_accepted": many_counts,
                   "draft": args.draft}
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
