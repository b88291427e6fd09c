"""PROBE_AUTONOMIC (the Channel protocol; the reply is the codec's AutonomicResult): a question put
to the conversation's current KV state that leaves no trace in it.

The probe's rows go at the positions after the slot's history and its tokens never join the
history, so the next turn's rows overwrite them before any attention reads them: the state is
exactly as before (``tests/test_channel_engine.py`` checks the next turn's greedy output). One
decode token: the softmax over the candidate ids names the winner, its probability and the
distribution's entropy (nats, 0 .. ln K). More: a greedy micro-decode of up to that many tokens,
whose text comes back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from colibri.io import channel_frames as cf
from colibri.model.interface import EngineModel
from colibri.model.kv_cache import KVCache

# selected_index of a micro-decode, or of a probe over the whole vocabulary (the wire's value)
NO_CANDIDATE = cf.SELECTED_GENERATIVE
MAX_TEXT = 0xFFFF  # AUTONOMIC_RESULT's text_len is a u16


def choose(logits: np.ndarray, candidates: Sequence[int]) -> tuple[int, int, float, float]:
    """(index into candidates, token, its probability, entropy) of the softmax over the candidates'
    logits (the whole vocabulary when there are none)."""
    ids = np.asarray(candidates, np.int64) if len(candidates) else np.arange(logits.shape[0])
    z = logits[ids].astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    best = int(np.argmax(p))
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    index = best if len(candidates) else NO_CANDIDATE
    return index, int(ids[best]), float(p[best]), max(0.0, entropy)


def run_probe(model: EngineModel, kv: KVCache, slot: int, start: int, prompt: Sequence[int],
              candidates: Sequence[int], max_decode: int,
              stop_ids: frozenset[int] | set[int]) -> cf.AutonomicResult:
    """The probe of the module docstring, rows from position ``start`` of ``slot`` (the caller holds
    the step lock and has checked that ``start + len(prompt) + max_decode`` fits the context)."""
    t0 = time.perf_counter()
    n = len(prompt)
    positions = np.arange(start, start + n, dtype=np.int64)
    logits = model.forward(np.asarray(prompt, np.int64), np.full(n, slot, np.int64), positions, kv,
                           np.asarray([n - 1], np.int64), 0)[0]
    index, token, confidence, entropy = choose(logits, candidates)
    out: list[int] = []
    if max_decode > 1:
        index = NO_CANDIDATE
        pos = start + n
        for step in range(max_decode):
            pick = token if step == 0 else int(np.argmax(logits))
            if pick in stop_ids:
                break
            out.append(pick)
            if step == max_decode - 1:
                break
            logits = model.forward(np.asarray([pick], np.int64), np.asarray([slot], np.int64),
                                   np.asarray([pos], np.int64), kv, np.asarray([0], np.int64), 1)[0]
            pos += 1
    stream = model.tokenizer.stream()  # as generated text is streamed (decode() drops an SPM lead space)
    text = ("".join(stream.feed(t) for t in out) + stream.flush()).encode()
    cost_ms = (time.perf_counter() - t0) * 1000.0
    return cf.AutonomicResult(index, token, confidence, entropy, cost_ms, text[:MAX_TEXT])
