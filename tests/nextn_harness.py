"""A tiny GLM-4.5 with a NextN (multi-token prediction) layer, as GLM-4.5's checkpoints carry one:
the tiny glm4moe of tests/data/tiny_hf with a fourth block, ``model.layers.3``, holding
``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` and a whole MoE layer (transformers builds
no NextN layer, so the checkpoint is extended by hand), and the mixtral checkpoint's tokenizer, so
that ``coli engine`` can serve it (same vocabulary size, 256).

``kind``: "random", the block's tensors a shuffle of layer 2's values (another layer, on the same
scales) and new random eh_proj and norms; "echo", a layer that predicts the token the main model
predicts at the same position (eh_proj passes the hidden state, normed by the model's final norm,
through; the block adds nothing; its norms are ones, so its head's input is that state rescaled):
its draft for the token after next is the next token again, which a stream repeating a token
accepts. """

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from convert_harness import TINY, edit_config, read_checkpoint, write_safetensors

from colibri.convert.writer import convert

N_EMBD = 64
NEXTN = "model.layers.3."


def nextn_checkpoint(out: Path, kind: str = "random") -> Path:
    d = Path(shutil.copytree(TINY / "glm4moe", out))
    hf = read_checkpoint(d)
    rng = np.random.default_rng(41)
    block = {k.replace("layers.2.", "layers.3."): v for k, v in hf.items() if k.startswith("model.layers.2.")}
    if kind == "random":
        block = {k: rng.permutation(v.reshape(-1)).reshape(v.shape) for k, v in block.items()}
        eh_proj = rng.integers(-8, 8, (N_EMBD, 2 * N_EMBD)).astype(np.float32) / 64.0
        norms = {n: (1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)
                 for n in ("enorm", "hnorm", "shared_head.norm")}
    elif kind == "echo":
        for k in block:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                block[k] = np.zeros_like(block[k])
        eh_proj = np.concatenate([np.zeros((N_EMBD, N_EMBD)), np.eye(N_EMBD)], axis=1).astype(np.float32)
        norms = {n: np.ones(N_EMBD, np.float32) for n in ("enorm", "hnorm", "shared_head.norm")}
    else:
        raise ValueError(kind)
    hf |= block | {NEXTN + "eh_proj.weight": eh_proj} | {f"{NEXTN}{n}.weight": v for n, v in norms.items()}
    write_safetensors(d / "model.safetensors", hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / "mixtral" / name, d / name)
    edit_config(d, num_nextn_predict_layers=1, bos_token_id=1, eos_token_id=2)
    return d


def nextn_gguf(out_dir: Path, kind: str = "random", type_name: str = "f32") -> Path:
    """The checkpoint converted by ``coli convert``."""
    out = out_dir / f"glm4moe-nextn-{kind}-{type_name}.gguf"
    convert(nextn_checkpoint(out_dir / f"hf-{kind}-{type_name}", kind), out, type_name)
    return out


def config_of(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())
