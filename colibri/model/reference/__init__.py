"""A plain-numpy forward pass of every architecture the engine runs: the test oracle, and the math
written down once, readable top to bottom (in the manner of nanoGPT and llama2.c).

Nothing here shares code with the engine: the ``gguf`` package reads the file (metadata, tensors)
and dequantizes the blocks, numpy computes in float64 over the whole sequence at once (no KV cache,
no batching, no quantized activations but the experts' inputs where asked: ``Weights``). What it
gives is what the file's weights mean, so a test holds the engine's logits against it, and it
against transformers' where a test has those.

    logits = forward(Weights(path), token_ids)  # [len(token_ids), n_vocab], every position

Tensor names and metadata keys are llama.cpp's. A matrix ``w[name]`` is [rows, row length]: a
layer computes ``h @ w[name].T``. Slow and memory-hungry by design: every matrix is dequantized
again each time it is used (a 135M-parameter model: seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from colibri.model.reference.deepseek2 import deepseek2
from colibri.model.reference.dense import dense, gemma3, llama
from colibri.model.reference.moe import glm4moe, glm4moe_nextn, olmoe, qwen2moe, qwen3moe
from colibri.model.reference.parts import rounded, softmax_routing
from colibri.model.reference.weights import Config, Weights

__all__ = ["ARCHITECTURES", "Config", "Weights", "forward", "glm4moe_nextn", "rounded", "softmax_routing"]

ARCHITECTURES: dict[str, Callable[[Weights, np.ndarray], np.ndarray]] = {
    "llama": llama,
    "qwen2": dense,
    "qwen3": dense,
    "phi3": dense,
    "gemma3": gemma3,
    "qwen2moe": qwen2moe,
    "qwen3moe": qwen3moe,
    "glm4moe": glm4moe,
    "olmoe": olmoe,
    "deepseek2": deepseek2,
}


def forward(w: Weights | Path | str, ids: Sequence[int]) -> np.ndarray:
    """The logits [len(ids), n_vocab] (float64) at every position of the token sequence ``ids``,
    the first at position 0."""
    w = w if isinstance(w, Weights) else Weights(w)
    arch = ARCHITECTURES.get(w.config.arch)
    if arch is None:
        have = ", ".join(ARCHITECTURES)
        raise ValueError(f"no reference for architecture {w.config.arch!r} (have: {have})")
    return arch(w, np.asarray(ids, np.int64))
