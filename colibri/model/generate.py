"""One sequence, start to end: chunked prefill, then decode until a stop token or the limit.

The engine's scheduler batches many sequences through ``forward`` itself; this is the plain loop
behind ``coli run`` and ``coli logits``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from colibri.errors import ColibriError
from colibri.model.interface import EngineModel
from colibri.model.sampling import Sampler


@dataclass
class Timings:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # forward steps of one token (the first token comes from the prefill)
    ids: list[int] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s else 0.0


class SingleSequence:
    """A single conversation in slot 0 of its own KV cache."""

    def __init__(self, model: EngineModel, n_ctx: int, chunk: int) -> None:
        self.model, self.chunk = model, chunk
        self.kv = model.new_kv_cache(1, n_ctx)
        self.n_past = 0

    def step(self, tokens: np.ndarray, all_logits: bool) -> np.ndarray:
        n = tokens.shape[0]
        if self.n_past + n > self.kv.n_ctx:
            raise ColibriError(f"context exceeded: {self.n_past + n} tokens, limit {self.kv.n_ctx}")
        positions = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        slots = np.zeros(n, dtype=np.int64)
        rows = np.arange(n) if all_logits else np.array([n - 1])
        n_direct = 1 if n == 1 else 0  # a decode step, or a prompt chunk (as the engine does)
        logits = self.model.forward(tokens.astype(np.int64), slots, positions, self.kv, rows, n_direct)
        self.n_past += n
        return logits

    def prefill(self, prompt: list[int], all_logits: bool = False) -> np.ndarray:
        """Logits after the prompt (of every position when ``all_logits``)."""
        if not prompt:
            raise ColibriError("empty prompt")
        ids = np.asarray(prompt, dtype=np.int64)
        out = [self.step(ids[i : i + self.chunk], all_logits) for i in range(0, len(ids), self.chunk)]
        return np.concatenate(out) if all_logits else out[-1]

    def generate(
        self, prompt: list[int], sampler: Sampler, max_tokens: int, stop_ids: frozenset[int],
        timings: Timings | None = None,
    ) -> Iterator[int]:
        """Yield generated ids; a stop id ends the stream and is not yielded."""
        t = timings or Timings()
        t.prompt_tokens = len(prompt)
        start = time.perf_counter()
        logits = self.prefill(prompt)[-1]
        t.prefill_s = time.perf_counter() - start
        history = list(prompt)
        decode_start = time.perf_counter()
        for i in range(max_tokens):
            token = sampler(logits, history)
            if token in stop_ids:
                break
            history.append(token)
            t.ids.append(token)
            t.generated_tokens += 1
            yield token
            if i + 1 == max_tokens or self.n_past >= self.kv.n_ctx:
                break
            logits = self.step(np.array([token]), False)[-1]
            t.decode_steps += 1
            t.decode_s = time.perf_counter() - decode_start
