"""llama.cpp's side of bench/bench_table.py: one worker process per measurement, 2 threads.

    python bench/bench_peer.py loop  --model PATH --prompt IDS --tokens 64 --t0 WALL
    python bench/bench_peer.py batch --model PATH --prompts JSON --tokens 64 --streams 16 --t0 WALL
    python bench/bench_peer.py prefill --model PATH --prompt IDS --runs 3 [--flash-attn]
    python bench/bench_peer.py lookup --model PATH --prompt IDS --tokens 400 --draft 8 --stops IDS

Each prints one JSON line. ``loop``: the Python ``Llama`` object, greedy decode by ``eval`` one
token at a time (what ``coli run`` is set against), and the process's peak RSS. ``batch``: the
low-level API, one context with ``n_seq_max`` = streams, ``llama_batch_init`` and one sequence id
per stream; every step decodes one token of each stream in a single ``llama_batch`` (what ``coli
engine`` with that many streams is set against). ``prefill``: ``Llama.eval`` of the whole prompt
(n_batch 512), a warm-up then --runs runs. ``lookup``: greedy ``Llama.generate`` until a stop id or
--tokens, with llama-cpp-python's prompt-lookup decoding (``LlamaPromptLookupDecoding``, --draft
tokens a draft; 0: none), decode tok/s from the first token to the last, and the ids. ``--t0`` is
the parent's wall clock at spawn: the worker reports the time from there to a ready model and
context (its start-up).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np

THREADS = 2


def _llama(path: str, n_ctx: int, flash_attn: bool = False):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                 flash_attn=flash_attn, verbose=False)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def loop(args) -> dict:
    """Greedy decode through the ``Llama`` object: the rate over the steps after the prompt."""
    llm = _llama(args.model, args.ctx)
    ready = time.time() - args.t0
    prompt = [int(x) for x in args.prompt.split(",")]
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(args.tokens - 1):  # the first token comes from the prompt's logits
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    tps = (args.tokens - 1) / (time.perf_counter() - start)
    return {"decode_tps": tps, "peak_rss": peak_rss_bytes(), "ready_s": ready}


def _prefill_once(llm, prompt: list[int]) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


def prefill(args) -> dict:
    """A warm-up (graph allocation, page cache: the prompt's first 512 tokens, one batch), then
    --runs timed evals of the whole prompt; --flash-attn: llama.cpp's fused attention."""
    prompt = [int(x) for x in args.prompt.split(",")]
    llm = _llama(args.model, len(prompt) + 64, args.flash_attn)
    _prefill_once(llm, prompt[:512])
    return {"prefill_tps": statistics.median(_prefill_once(llm, prompt) for _ in range(args.runs))}


def lookup(args) -> dict:
    """Greedy decode through ``Llama.generate``, with prompt-lookup drafts of --draft tokens (its
    ``max_ngram_size`` left at 2, the default) or none; the prompt's evaluation is excluded."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    prompt = [int(x) for x in args.prompt.split(",")]
    stops = {int(x) for x in args.stops.split(",")} if args.stops else set()
    draft = LlamaPromptLookupDecoding(num_pred_tokens=args.draft) if args.draft else None
    llm = Llama(model_path=args.model, n_ctx=args.ctx, n_batch=512, n_threads=THREADS,
                n_threads_batch=THREADS, draft_model=draft, verbose=False,
                # drafts need every row's logits; said here too, or its score table holds n_batch
                # rows only and an answer past position 512 overflows it (llama-cpp-python 0.3.36)
                logits_all=draft is not None)
    out: list[int] = []
    first = 0.0
    for token in llm.generate(prompt, temp=0.0, reset=True):
        if not out:
            first = time.perf_counter()
        if token in stops:
            break
        out.append(token)
        if len(out) >= args.tokens:
            break
    seconds = time.perf_counter() - first
    return {"decode_tps": (len(out) - 1) / seconds if len(out) > 1 else 0.0, "ids": out}


class Batched:
    """One llama.cpp context holding ``streams`` sequences, driven through ``llama_batch``."""

    def __init__(self, path: str, streams: int, n_ctx_seq: int) -> None:
        import llama_cpp as lib

        self.lib = lib
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = streams * n_ctx_seq, 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = streams, THREADS, THREADS
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.streams = streams
        self.batch = lib.llama_batch_init(512, 0, streams)

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) into the batch."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        row = self.lib.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """Each stream's prompt (one batch per stream), its first token from the last logits."""
        first = []
        for seq, ids in enumerate(prompts):
            self._fill([(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])
            first.append(self._argmax(len(ids) - 1))
        return first

    def run(self, prompts: list[list[int]], tokens: int) -> float:
        """Aggregate tok/s of all streams over the steps after their first token (greedy)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        prompts = prompts[: self.streams]
        last = self._prefill(prompts)
        pos = [len(p) for p in prompts]
        start = time.perf_counter()
        for _ in range(tokens - 1):
            self._fill([(last[s], pos[s], s, True) for s in range(len(prompts))])
            last = [self._argmax(s) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
        return len(prompts) * (tokens - 1) / (time.perf_counter() - start)


def batch(args) -> dict:
    prompts = json.loads(args.prompts)
    peer = Batched(args.model, args.streams, args.ctx)
    ready = time.time() - args.t0
    peer.run(prompts, 8)  # warm-up: graph allocation, page cache
    return {"decode_tps": peer.run(prompts, args.tokens), "ready_s": ready, "peak_rss": peak_rss_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("loop", "batch", "prefill", "lookup"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", help="loop, prefill: comma-separated prompt ids")
    ap.add_argument("--prompts", help="batch: JSON list of prompt id lists, one per stream")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512, help="loop: n_ctx; batch: context per sequence")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--t0", type=float, default=None)
    ap.add_argument("--flash-attn", action="store_true", help="prefill: llama.cpp's flash attention")
    ap.add_argument("--draft", type=int, default=0, help="lookup: draft tokens (0: no drafts)")
    ap.add_argument("--stops", default="", help="lookup: comma-separated ids that end the answer")
    args = ap.parse_args()
    if args.t0 is None:
        args.t0 = time.time()
    modes = {"loop": loop, "batch": batch, "prefill": prefill, "lookup": lookup}
    print(json.dumps(modes[args.mode](args)))


if __name__ == "__main__":
    main()
