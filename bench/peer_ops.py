"""llama.cpp's prefill, operation by operation: where the peer's time goes, to set beside a profile
of colibri's own step before a kernel is written.

    python bench/peer_ops.py GGUF [--tokens 512] [--threads 2] [--runs 3] [--top 12]

llama.cpp (the Makefile's ``peer`` build, mmap, no repacking) prefills ``--tokens`` random ids
(``bench_moe_peer.prefill_prompt``'s) in one micro-batch. Its scheduler's evaluation callback
(``cb_eval``), asked to observe every node, computes the graph one node at a time and calls back
after each: the time between two calls is that node's (a barrier of the threads apiece, ~1% of a
MoE prefill). Printed: the whole decode's time and rate (median of ``--runs``, each on an empty
KV cache), then seconds per tensor name (the layer's number dropped: ``ffn_moe_gate`` sums every
layer's) and per operation, from the median run.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    import llama_cpp as lib

    base = ctypes.CDLL(str(Path(lib.__file__).parent / "lib" / "libggml-base.so"))
    for fn in (base.ggml_get_name, base.ggml_op_desc):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    by_name: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    last = [0.0]

    def observe(tensor: int, ask: bool, _user: int) -> bool:
        if ask:
            return True  # every node: the graph is computed one node at a time
        now = time.perf_counter()
        by_name[re.sub(r"-\d+$", "", base.ggml_get_name(tensor).decode())] += now - last[0]
        by_op[base.ggml_op_desc(tensor).decode()] += now - last[0]
        last[0] = time.perf_counter()
        return True

    callback = lib.ggml_backend_sched_eval_callback(observe)  # kept referenced while the context lives
    lib.llama_backend_init()
    mp = lib.llama_model_default_params()
    mp.use_mmap, mp.use_extra_bufts = True, False
    model = lib.llama_model_load_from_file(str(args.gguf).encode(), mp)
    if not model:
        raise SystemExit("llama.cpp could not load the model")
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = args.tokens + 64, args.tokens, args.tokens
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.cb_eval = callback
    ctx = lib.llama_init_from_model(model, cp)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    # bench_moe_peer.prefill_prompt's ids, not imported: that module imports colibri, which sets the
    # OpenMP variables the peer must start without
    ids = np.random.default_rng(7).integers(16, n_vocab, args.tokens).tolist()
    batch = (lib.llama_token * len(ids))(*ids)
    runs = []
    for _ in range(args.runs + 1):  # the first warms the pages and the threads
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        by_name.clear()
        by_op.clear()
        last[0] = start = time.perf_counter()
        if lib.llama_decode(ctx, lib.llama_batch_get_one(batch, len(ids))) != 0:
            raise SystemExit("llama_decode failed")
        runs.append((time.perf_counter() - start, dict(by_name), dict(by_op)))
    runs = sorted(runs[1:], key=lambda r: r[0])
    seconds, names, ops = runs[len(runs) // 2]
    print(f"{args.gguf.name}: {args.tokens} tokens in {seconds:.3f} s, {args.tokens / seconds:.1f} tok/s "
          f"(runs {', '.join(f'{r[0]:.3f}' for r in runs)} s), {args.threads} threads")
    for title, table in (("tensor", names), ("operation", ops)):
        print(f"\n{'seconds':>8} {'share':>6}  {title}")
        for key, s in sorted(table.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{s:8.3f} {100 * s / seconds:5.1f}%  {key}")


if __name__ == "__main__":
    main()
