"""Aggregate decode throughput through the engine protocol with 1, 4 and 16 concurrent streams.

    python bench/bench_engine.py [--model PATH] [--runs 3] [--tokens 64] [--streams 1,4,16] [--temperature T]

A real ``coli engine`` process (16 slots, no persistence) is driven over stdin/stdout; each run
submits N requests at once in N slots and measures, from the first token to the last DONE, the
generated tokens per second of all streams together (prefill excluded: streams start together
once their prompts are in). Prints the median of --runs runs per N and the ratio to one stream.
Greedy by default; ``--temperature`` samples (top_p 1, each request seeded by its id), which is
what a client that leaves the temperature unset gets from ``coli serve`` (OpenAI's default, 1).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from colibri.io.events import Data, Done, Error, Ready, Submit
from colibri.io.mux import ResponseReader, encode_request

QUESTIONS = [
    "Tell me about the ocean.", "Describe a forest in spring.", "Explain how a bicycle works.",
    "Write about a city at night.", "Describe a mountain hike.", "Tell me about the moon.",
    "Explain what a library is for.", "Describe a thunderstorm.", "Tell me about honey bees.",
    "Describe a busy market.", "Explain how bread is made.", "Tell me about trains.",
    "Describe a winter morning.", "Explain how a compass works.", "Tell me about volcanoes.",
    "Describe a quiet beach.",
]


def prompt(q: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


class Engine:
    def __init__(self, model: str | None) -> None:
        cmd = [sys.executable, "-m", "colibri", "engine", "--kv-slots", "16", "--no-persist", "--ctx", "512"]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.reader = ResponseReader()
        self.next_id = 1
        self._wait(lambda e: isinstance(e, Ready))

    def _events(self):
        """(the time its bytes were read, event), as they come."""
        while True:
            data = self.proc.stdout.read1(1 << 16)
            if not data:
                raise RuntimeError("the engine exited")
            now = time.perf_counter()
            for event in self.reader.receive_data(data):
                yield now, event

    def _wait(self, pred) -> None:
        for _, event in self._events():
            if pred(event):
                return

    def run(self, n: int, tokens: int, temperature: float = 0.0) -> float:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        frames = b"".join(encode_request(Submit(rid, i, tokens, temperature, 1.0, prompt(QUESTIONS[i]), rid))
                          for i, rid in enumerate(ids))
        self.proc.stdin.write(frames)
        self.proc.stdin.flush()
        first_seen: dict[int, float] = {}
        emitted, pending = 0, set(ids)
        for now, event in self._events():
            if isinstance(event, Data) and event.id not in first_seen:
                first_seen[event.id] = now
            elif isinstance(event, Done) and event.id in pending:
                emitted += event.emitted - 1  # tokens after each stream's first
                pending.discard(event.id)
            elif isinstance(event, Error) and event.id in pending:
                raise RuntimeError(f"request failed: {event}")
            if not pending:
                break
        return emitted / (time.perf_counter() - max(first_seen.values()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    args = ap.parse_args()
    engine = Engine(args.model)
    engine.run(2, 8)  # warm-up
    results = {}
    for n in (int(x) for x in args.streams.split(",")):
        results[n] = statistics.median(engine.run(n, args.tokens, args.temperature) for _ in range(args.runs))
    engine.close()
    base = results[min(results)]
    how = f"temperature {args.temperature:g}" if args.temperature else "greedy"
    print(f"engine protocol, decode tok/s of all streams together ({how}), median of {args.runs} runs")
    print(f"{'streams':>8}{'tok/s':>10}{'x one':>8}")
    for n, tps in results.items():
        print(f"{n:8d}{tps:10.1f}{tps / base:8.2f}")


if __name__ == "__main__":
    main()
