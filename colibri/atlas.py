"""``coli atlas``: which experts each topic routes to, measured, for the web console's Atlas view.

The prompts come grouped by topic (a JSON object ``{"topic": ["prompt", ...], ...}``; a prompt is
text, or a list of token ids for a model whose file has no tokenizer). Each prompt
runs token by token through the model (one forward step per token, no sampling: prefill routes the
same way, but a step's hit map is per step, and per token is the routing we want to count); after
every step the expert store's hit map says which experts that token used in every MoE layer.

Written to ``experts.json`` (by default in the state directory, where ``coli serve`` publishes it
at ``/atlas``):

- ``rows``, ``cols``: MoE layers and experts per layer, as ``/experts``;
- ``topics``: the topics, in the file's order; ``tokens``: tokens routed per topic;
- ``share``: rows × cols, the fraction of all routed tokens that used each expert;
- ``affinity``: rows × cols × topics, for each expert the share of its tokens from each topic,
  normalised by the topic's token count (a topic with more prompts does not win by size): each
  expert's row sums to 1, or is all 0 for an expert nothing routed to;
- ``dominant``: rows × cols, the index of each expert's top topic (-1 where unused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from colibri.errors import ColibriError
from colibri.settings import ATLAS_FILE
from colibri.state_files import check_state_dir, replacing

__all__ = ["ATLAS_FILE", "measure", "read_prompts", "write_atlas"]
MAX_PROMPT_TOKENS = 512  # per prompt: routing statistics need many prompts, not long ones


Prompt = str | list[int]


def _is_prompt(p: Any) -> bool:
    if isinstance(p, str):
        return bool(p)
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and t >= 0 for t in p)


def read_prompts(path: Path) -> dict[str, list[Prompt]]:
    """The prompts file, checked: a JSON object of topic -> non-empty list of prompts."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ColibriError(f"{path}: cannot read the prompts: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ColibriError(f"{path}: expected a JSON object of topic -> list of prompts")
    for topic, prompts in data.items():
        if not isinstance(prompts, list) or not prompts or not all(_is_prompt(p) for p in prompts):
            raise ColibriError(f"{path}: topic {topic!r} needs a non-empty list of prompts "
                               "(non-empty strings or lists of token ids)")
    return data


def measure(model, prompts: dict[str, list[Prompt]]) -> dict[str, Any]:
    """The atlas (module docstring) of ``model`` over ``prompts``."""
    experts = model.experts
    if experts is None:
        raise ColibriError("this model has no experts: an atlas needs a mixture-of-experts model")
    rows, cols = experts.shape
    topics = list(prompts)
    counts = np.zeros((len(topics), rows, cols), np.int64)
    tokens = np.zeros(len(topics), np.int64)
    kv = model.new_kv_cache(1, MAX_PROMPT_TOKENS)
    experts.take_hits()  # start clean
    for t, topic in enumerate(topics):
        for prompt in prompts[topic]:
            ids = (model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)[:MAX_PROMPT_TOKENS]
            if max(ids) >= model.hp.n_vocab:
                raise ColibriError(f"topic {topic!r}: a token id outside the vocabulary "
                                   f"of {model.hp.n_vocab}")
            for pos, token in enumerate(ids):
                model.forward(np.asarray([token], np.int64), np.zeros(1, np.int64),
                              np.asarray([pos], np.int64), kv, np.zeros(1, np.int64), 1)
                bits = np.frombuffer(experts.take_hits(), np.uint8)
                used = np.unpackbits(bits, bitorder="little")[: rows * cols].reshape(rows, cols)
                counts[t] += used
            tokens[t] += len(ids)
    total = counts.sum(axis=0)
    share = total / max(int(tokens.sum()), 1)
    per_topic = counts / np.maximum(tokens, 1)[:, None, None]  # a topic's rate of use of each expert
    norm = per_topic.sum(axis=0)
    affinity = np.where(norm > 0, per_topic / np.where(norm > 0, norm, 1), 0.0)
    dominant = np.where(total > 0, np.argmax(affinity, axis=0), -1)
    return {
        "rows": rows, "cols": cols, "topics": topics, "tokens": tokens.tolist(),
        "share": np.round(share, 6).tolist(),
        "affinity": np.round(np.moveaxis(affinity, 0, -1), 6).tolist(),
        "dominant": dominant.tolist(),
    }


def write_atlas(atlas: dict[str, Any], out: Path) -> None:
    """``out``, whole or not at all (the server may be reading the previous one), as the engine writes
    its state files: never through a planted link. Its directory is held to the state directory's
    rules wherever ``--out`` points, since a server may publish it from there."""
    check_state_dir(out.parent)
    data = json.dumps(atlas, separators=(",", ":")).encode()
    with replacing(out, out.with_name(out.name + ".tmp")) as f:
        f.write(data)
