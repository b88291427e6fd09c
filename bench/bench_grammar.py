"""The cost of grammar-constrained decoding: decode tok/s with and without a JSON schema.

    python bench/bench_grammar.py [--model PATH] [--runs 5] [--tokens 64]

Three measurements, on the same prompts (the default model's chat markup, asking for a person
described as JSON) and the same JSON schema (``SCHEMA``: strings with maxLength, a bounded integer,
a number, an enum, an array of at most three strings):

1. Through a real ``coli engine`` (16 slots, no persistence): 1 stream, then 4 concurrent streams,
   each without a grammar and with the schema as the SUBMIT's grammar (``start: %json {...}``),
   temperature 1, top_p 1 and a fixed seed per stream and run, so both sides sample the same way.
   A grammar can end an answer before ``--tokens``, so speeds are tokens per second, never the
   wall time of a fixed count: per stream, the DONE line's ``tok_s`` (first token to end); for all
   streams together ("tok/s all", the ratio's figure), the DATA lines (one per token) of every
   stream from the last stream's first token to the first DONE, while the batch is whole (answers
   of different lengths would otherwise leave a tail of fewer streams); and, as bench_engine.py,
   the whole run to the last DONE. Medians over --runs, the tokens generated per stream (mean),
   the answers cut by --tokens, and the ratio with/without. The grammar is the one the HTTP
   server sends for ``response_format`` (``colibri.api.structured.json_grammar``: whitespace
   fixed). Every grammar-constrained answer that ended on
   its own (not cut by --tokens) must parse as JSON and satisfy the schema; failures are printed.
2. The mask alone: ``Constraint.mask`` (llguidance's token mask, then numpy's unpack and
   ``np.where`` over the logits) and ``Constraint.advance`` per token, replayed over the token
   sequences of the engine's JSON answers, in microseconds and as a share of the per-token decode
   time measured in 1 (1 stream, no grammar); split into llguidance's part and numpy's.
3. The peer: llama.cpp through llama-cpp-python (``make peer``) on the same GGUF file, in this
   process, n_threads=2: decode tok/s (first sampled token to end, through ``Llama.generate``,
   sampling included) without a grammar and with ``LlamaGrammar.from_json_schema`` of the same
   schema, temperature 1, top_k 0, top_p 1, min_p 0, fixed seeds; its ratio beside ours. Skipped
   (with how to install it) when llama_cpp is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import bench_engine
import numpy as np

from colibri.api.structured import json_grammar
from colibri.io.events import Data, Done, Error, Submit
from colibri.io.mux import encode_request
from colibri.model.grammar import GrammarVocab
from colibri.model.text import ModelText
from colibri.settings import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string",
                       "enum": ["teacher", "engineer", "artist", "doctor", "farmer", "other"]},
        "height_m": {"type": "number"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "occupation", "height_m", "hobbies"],
    "additionalProperties": False,
}
# What the HTTP server sends for ``response_format`` json_schema: whitespace fixed by x-guidance.
GRAMMAR = json_grammar(SCHEMA)

WHO = ["a baker", "a sailor", "a librarian", "a painter"]
SEED = 1000  # stream i of run r samples with seed SEED + 10 * r + i, on both sides and both engines


def prompt(who: str) -> str:
    q = (f"Describe {who} you imagine as a JSON object with the keys name, age, occupation, height_m "
         "and hobbies.")
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Run:
    """One batch of streams: per stream its DONE and its text, and the aggregate tok/s."""

    done: list[Done]
    texts: list[str]
    whole: float  # tokens after each stream's first / (last DONE - last stream's first token)
    together: float  # tokens while every stream runs / (first DONE - last stream's first token)


class Engine(bench_engine.Engine):
    """bench_engine's engine process (16 slots, no persistence), run with a grammar and seeds."""

    def run(self, n: int, tokens: int, grammar: str | None, seed: int) -> Run:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        frames = b"".join(
            encode_request(Submit(rid, i, tokens, 1.0, 1.0, prompt(WHO[i % len(WHO)]), seed + i,
                                  grammar=grammar))
            for i, rid in enumerate(ids))
        self.proc.stdin.write(frames)
        self.proc.stdin.flush()
        first_seen: dict[int, float] = {}
        texts = {rid: b"" for rid in ids}
        data_at: list[float] = []  # one DATA line per token (the detokenizer holds back only
        done: dict[int, Done] = {}  # an incomplete UTF-8 character, rare here)
        done_at: list[float] = []
        for now, event in self._events():
            if isinstance(event, Data) and event.id in texts:
                first_seen.setdefault(event.id, now)
                texts[event.id] += event.text
                data_at.append(now)
            elif isinstance(event, Done) and event.id in texts:
                done[event.id] = event
                done_at.append(now)
            elif isinstance(event, Error) and event.id in texts:
                raise RuntimeError(f"request failed: {event}")
            if len(done) == n:
                break
        start = max(first_seen.values(), default=done_at[0])
        emitted = sum(max(d.emitted - 1, 0) for d in done.values())
        steady = sum(start < t <= done_at[0] for t in data_at)
        return Run([done[r] for r in ids], [texts[r].decode("utf-8", "replace") for r in ids],
                   _rate(emitted, done_at[-1] - start), _rate(steady, done_at[0] - start))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


@dataclass
class Side:
    """The runs of one configuration (N streams, with or without the grammar)."""

    runs: list[Run] = field(default_factory=list)

    @property
    def whole(self) -> float:
        return statistics.median(r.whole for r in self.runs)

    @property
    def together(self) -> float:
        return statistics.median(r.together for r in self.runs)

    @property
    def per_stream(self) -> float:
        return statistics.median(d.tok_s for r in self.runs for d in r.done if d.emitted > 1)

    @property
    def mean_tokens(self) -> float:
        return statistics.mean(d.emitted for r in self.runs for d in r.done)

    @property
    def cut(self) -> int:
        return sum(d.length_limited for r in self.runs for d in r.done)


def check_json(side: Side) -> tuple[int, list[str]]:
    """Answers that ended on their own: how many, and why each that is not valid JSON of SCHEMA failed."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    checked, failures = 0, []
    for run in side.runs:
        for d, text in zip(run.done, run.texts, strict=True):
            if d.length_limited:
                continue
            checked += 1
            try:
                value = json.loads(text)
                if jsonschema is not None:
                    jsonschema.validate(value, SCHEMA)
            except Exception as e:
                failures.append(f"request {d.id} ({d.emitted} tokens): {type(e).__name__}: "
                                f"{str(e).splitlines()[0]} in {text!r}")
    return checked, failures


def engine_part(args: argparse.Namespace) -> tuple[dict[tuple[int, bool], Side], float]:
    engine = Engine(args.model)
    engine.run(2, 8, None, 0)  # warm-up: numba compilation, page cache
    engine.run(2, 8, GRAMMAR, 0)  # and the grammar vocabulary (built on the first grammar)
    results: dict[tuple[int, bool], Side] = {}
    for n in (1, 4):
        for with_grammar in (False, True):
            side = results[n, with_grammar] = Side()
            for r in range(args.runs):
                side.runs.append(engine.run(n, args.tokens, GRAMMAR if with_grammar else None, SEED + 10 * r))
    engine.close()
    print(f"\ncoli engine, temperature 1, --tokens {args.tokens}, median of {args.runs} runs")
    print(f"{'streams':>8}{'grammar':>9}{'tokens':>8}{'cut':>5}{'tok/s/stream':>14}{'tok/s all':>11}"
          f"{'x no grammar':>14}{'whole run':>11}")
    for (n, g), side in results.items():
        base = results[n, False]
        print(f"{n:8d}{'json' if g else '-':>9}{side.mean_tokens:8.1f}{side.cut:5d}{side.per_stream:14.1f}"
              f"{side.together:11.1f}{side.together / base.together:14.2f}{side.whole:11.1f}")
    print("tokens: generated per stream (mean); cut: answers ended by --tokens; tok/s/stream: the DONE\n"
          "lines' tok_s; tok/s all: every stream's tokens while all of them run (x no grammar: its ratio);\n"
          "whole run: all tokens until the last DONE (streams that end early leave the batch smaller)")
    for n in (1, 4):
        checked, failures = check_json(results[n, True])
        print(f"{n} stream(s), grammar: {checked} answers ended on their own, "
              f"{checked - len(failures)} valid JSON of the schema")
        for f in failures:
            print("  NOT VALID:", f)
    return results, results[1, False].per_stream


def replay(vocab: GrammarVocab, sequences: list[list[int]], engine_path: bool) -> list[int]:
    """Nanoseconds per token over ``sequences``: the engine's path (``Constraint.mask`` of a logits
    row, then ``advance``), or llguidance's part of it alone (the mask into a bitset, the token fed)."""
    logits = np.random.default_rng(0).standard_normal(vocab.n_vocab).astype(np.float32)
    bits = np.zeros((vocab.n_vocab + 31) // 32, np.int32)
    times = []
    for seq in sequences:
        c = vocab.constraint(GRAMMAR)
        for token in seq:
            t0 = time.perf_counter_ns()
            if engine_path:
                ok = np.isfinite(c.mask(logits)[token]) and c.advance(token)
            else:
                c.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
                ok = c.matcher.consume_token(token)
            times.append(time.perf_counter_ns() - t0)
            if not ok:
                raise RuntimeError(f"the grammar refused token {token} of {seq}")
    return times


def mask_part(path: Path, answers: list[tuple[str, bool]], decode_tok_s: float, runs: int) -> None:
    """``answers``: the engine's constrained texts, and whether each ended on its own (a cut one is
    still a prefix the grammar accepts, replayed without the end of turn)."""
    tok = ModelText.open(path).tokenizer
    t0 = time.perf_counter()
    vocab = GrammarVocab(tok.to_json(), tok.n_vocab, tok.stop_ids)
    t_vocab = time.perf_counter() - t0
    t0 = time.perf_counter()
    vocab.constraint(GRAMMAR)  # compiled: a grammar's first request
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        vocab.constraint(GRAMMAR)  # the compiled matcher copied: every later request of that grammar
    t_copy = (time.perf_counter() - t0) / 20
    # The answers' tokens as the tokenizer writes them (the engine's own choices may split a few
    # differently), each finished one ended by the end-of-turn token the finished grammar allows.
    sequences = [tok.encode(t) + ([min(tok.stop_ids)] if ended else []) for t, ended in answers if t]
    if not sequences:
        print("\nno constrained answer to replay: the mask cost is not measured")
        return
    replay(vocab, sequences, True)  # warm-up
    engine = [replay(vocab, sequences, True) for _ in range(runs)]
    native = [replay(vocab, sequences, False) for _ in range(runs)]
    us = statistics.median(statistics.mean(t) for t in engine) / 1e3
    us_native = statistics.median(statistics.mean(t) for t in native) / 1e3
    median_us = statistics.median(t for ts in engine for t in ts) / 1e3
    p90_us = float(np.percentile([t for ts in engine for t in ts], 90)) / 1e3
    per_token_us = 1e6 / decode_tok_s
    print(f"\nConstraint.mask + advance, replayed over the {sum(map(len, sequences))} tokens of the "
          f"{len(sequences)} JSON answers above (vocabulary {tok.n_vocab}), median of {runs} passes")
    print(f"  {us:.0f} us/token on average (median token {median_us:.0f} us, p90 {p90_us:.0f} us): "
          f"llguidance's mask and advance {us_native:.0f} us, numpy's unpack and where "
          f"{us - us_native:.0f} us")
    print(f"  = {100 * us / per_token_us:.2f}% of a decode token at 1 stream without grammar "
          f"({decode_tok_s:.1f} tok/s = {per_token_us / 1e3:.1f} ms/token)")
    print(f"  once: GrammarVocab built in {t_vocab * 1e3:.0f} ms (per engine); the schema compiled in "
          f"{t_compile * 1e3:.2f} ms (its first request), copied in {t_copy * 1e3:.3f} ms (each later one)")


def peer_part(path: Path, args: argparse.Namespace, ours: dict[tuple[int, bool], Side]) -> None:
    try:
        import llama_cpp
    except ImportError:
        print("\nllama.cpp peer skipped: llama_cpp is not installed (`make peer`, or "
              "CMAKE_ARGS=... pip install llama-cpp-python==0.3.36 with the Makefile's PEER_CMAKE_ARGS)")
        return
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=2, verbose=False)
    tokens = llm.tokenize(prompt(WHO[0]).encode(), add_bos=False, special=True)

    def decode(grammar_on: bool, seed: int, n: int) -> tuple[float, int, str]:
        grammar = (llama_cpp.LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
                   if grammar_on else None)
        llm.set_seed(seed)
        out: list[int] = []
        first = 0.0
        for t in llm.generate(tokens, top_k=0, top_p=1.0, min_p=0.0, temp=1.0, repeat_penalty=1.0,
                              grammar=grammar):
            if not out and not first:
                first = time.perf_counter()
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t):  # as Llama.create_completion does
                break
            out.append(t)
            if len(out) >= n:
                break
        elapsed = time.perf_counter() - first
        return ((len(out) - 1) / elapsed if len(out) > 1 else 0.0), len(out), llm.detokenize(out).decode(
            "utf-8", "replace")

    decode(False, 0, 8)  # warm-up
    rows = {}
    for g in (False, True):
        runs = [decode(g, SEED + 10 * r, args.tokens) for r in range(args.runs)]
        rows[g] = (statistics.median(r[0] for r in runs), statistics.mean(r[1] for r in runs), runs)
    print(f"\nllama.cpp {llama_cpp.__version__} (same file, n_threads=2, 1 stream), "
          f"median of {args.runs} runs")
    print(f"{'grammar':>9}{'tokens':>8}{'cut':>5}{'tok/s':>9}{'x no grammar':>14}{'colibri x':>11}")
    for g, (tps, mean_tokens, runs) in rows.items():
        ours_ratio = ours[1, g].per_stream / ours[1, False].per_stream
        cut = sum(n >= args.tokens for _, n, _ in runs)
        print(f"{'json' if g else '-':>9}{mean_tokens:8.1f}{cut:5d}{tps:9.1f}{tps / rows[False][0]:14.2f}"
              f"{ours_ratio:11.2f}")
    print("(colibri x: our 1-stream tok/s/stream ratio above, beside llama.cpp's)")
    for _, n, text in rows[True][2]:
        if n < args.tokens:
            try:
                json.loads(text)
            except ValueError as e:
                print(f"  llama.cpp answer NOT JSON: {e}: {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    results, decode_tok_s = engine_part(args)
    answers = [(t, not d.length_limited) for n in (1, 4) for r in results[n, True].runs
               for d, t in zip(r.done, r.texts, strict=True)]
    mask_part(path, answers, decode_tok_s, args.runs)
    peer_part(path, args, results)


if __name__ == "__main__":
    main()
