"""``coli convert`` on the dense checkpoints (qwen2, qwen3, gemma3, phi3, phi3 with longrope, llama
with Llama 3's rope scaling) against the file llama.cpp's own converter writes for the same
checkpoint (``llama_cpp.gguf``, made by tools/make_tiny_dense.py): the same tensors bit for bit, the
same metadata where inference reads it, and llama.cpp (llama-cpp-python, skipped without it)
computing transformers' logits from both files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from convert_harness import (
    DENSE,
    DENSE_LOGIT_TOLERANCE,
    LLAMA_CPP_GGUF,
    TINY,
    assert_one_error,
    coli_convert,
    copy_tiny,
    dense_conversions,
    edit_config,
    logit_error,
    read_checkpoint,
    values,
)

from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFFile

# Vectors both converters compute from config numbers in float32 (numpy's and torch's pow may
# differ in the last bit); every other tensor is copied or shifted and must be equal.
COMPUTED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
COMPUTED_RTOL = 1e-6
# What llama.cpp assumes for a SentencePiece ("llama") vocabulary whose file does not say: coli
# convert writes them, llama.cpp's converter leaves them out for these architectures.
SPM_DEFAULTS = {"tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": True}
DEFAULT_ROPE_BASE = 10000.0  # llama.cpp's, for a file without rope.freq_base
CONTEXT = 256  # the checkpoints' max_position_embeddings
# ggml's CPU GELU rounds its input and output to float16 (a table lookup): llama.cpp's gemma3 logits
# are then ~3e-4 from transformers' (measured 2.6e-4), and within 1e-5 of transformers' computed
# with that rounding (full_logits_gelu_f16).
GGML_GELU_TOLERANCE = 1e-3
# phi3_longrope: the long rope factors take over in llama.cpp above this context.
LONGROPE_ORIGINAL_CONTEXT = 256


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> dict[str, tuple[Path, Path, dict[str, np.ndarray]]]:
    """Every dense checkpoint converted by coli convert (f32), with llama.cpp's file and reference."""
    converted = dense_conversions(tmp_path_factory.mktemp("dense"))
    return {name: (coli, lcpp, ref) for name, coli, lcpp, ref in converted}


@pytest.mark.parametrize("name", DENSE)
def test_same_tensors_as_llama_cpp(conversions, name: str) -> None:
    coli, lcpp, _ = conversions[name]
    ours, theirs = GGUFFile(coli), GGUFFile(lcpp)
    assert set(ours.tensors) == set(theirs.tensors)
    for t, info in ours.tensors.items():
        other = theirs.tensors[t]
        assert (info.shape, info.gtype) == (other.shape, other.gtype) and info.gtype == GGMLType.F32, t
        if t in COMPUTED:
            np.testing.assert_allclose(values(ours, t), values(theirs, t), rtol=COMPUTED_RTOL, err_msg=t)
        else:
            np.testing.assert_array_equal(values(ours, t), values(theirs, t), err_msg=t)


def hparams(g: GGUFFile) -> dict[str, Any]:
    """The architecture's metadata (``{arch}.*``), with llama.cpp's defaults for what is left out."""
    arch = g.get("general.architecture")
    meta = {k.removeprefix(f"{arch}."): v for k, v in g.metadata.items() if k.startswith(f"{arch}.")}
    head = meta["embedding_length"] // meta["attention.head_count"]
    meta.setdefault("attention.key_length", head)
    meta.setdefault("attention.value_length", head)
    meta.setdefault("rope.dimension_count", meta["attention.key_length"])
    meta.setdefault("rope.freq_base", DEFAULT_ROPE_BASE)
    meta.setdefault("vocab_size", len(g.get("tokenizer.ggml.tokens")))
    return {"architecture": arch, **meta}


def tokenizer(g: GGUFFile) -> dict[str, Any]:
    return SPM_DEFAULTS | {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}


@pytest.mark.parametrize("name", DENSE)
def test_same_metadata_as_llama_cpp(conversions, name: str) -> None:
    coli, lcpp, _ = conversions[name]
    ours, theirs = GGUFFile(coli), GGUFFile(lcpp)
    assert hparams(ours) == hparams(theirs)  # floats as both store them, float32
    assert tokenizer(ours) == tokenizer(theirs)


def test_what_the_files_say(conversions) -> None:
    """Both files agree; this says on what, so that agreeing on a mistake would show."""
    gemma = GGUFFile(conversions["gemma3"][0])
    assert [gemma.get(f"gemma3.{k}") for k in ("attention.sliding_window", "rope.freq_base",
            "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor", "attention.key_length")] == \
        [4, 100000.0, 10000.0, "linear", 2.0, 16]
    assert gemma.get("tokenizer.ggml.add_space_prefix") is False
    ckpt = read_checkpoint(TINY / "gemma3")
    for hf, ours in (("model.layers.2.self_attn.q_norm.weight", "blk.2.attn_q_norm.weight"),
                     ("model.layers.5.post_feedforward_layernorm.weight", "blk.5.post_ffw_norm.weight"),
                     ("model.norm.weight", "output_norm.weight")):
        np.testing.assert_array_equal(values(gemma, ours), ckpt[hf] + np.float32(1))  # Gemma's 1 + w
    llama3 = GGUFFile(conversions["llama3"][0])
    # head_dim 16 at theta 5e5: wavelengths 6.3 (kept), 33 (between 16 and 64: blended), then over
    # 64 positions (divided by the factor 8)
    factors = values(llama3, "rope_freqs.weight")
    assert factors[0] == 1 and 1 < factors[1] < 8 and (factors[2:] == 8).all()
    phi3 = GGUFFile(conversions["phi3"][0])
    assert phi3.tensors["blk.0.attn_qkv.weight"].shape == (64, 64 + 2 * 32)  # q, k, v rows fused
    assert phi3.tensors["blk.0.ffn_up.weight"].shape == (64, 2 * 96)  # gate and up rows fused
    assert "blk.0.ffn_gate.weight" not in phi3.tensors
    longrope = GGUFFile(conversions["phi3_longrope"][0])
    assert longrope.get("phi3.rope.dimension_count") == 12  # 3/4 of head_dim 16
    assert len(values(longrope, "rope_factors_long.weight")) == 6  # one per rotated pair
    extension = 2  # context 512 from 256
    attn_factor = (1 + np.log(extension) / np.log(LONGROPE_ORIGINAL_CONTEXT)) ** 0.5
    assert longrope.get("phi3.rope.scaling.attn_factor") == pytest.approx(attn_factor)


def llama_cpp_logits(path: Path, ids: list[int], n_ctx: int) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    # F32 KV cache: llama.cpp's default F16 cache alone moves logits by ~1e-2.
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def references(name: str) -> list[tuple[str, int, float]]:
    """(reference array, llama.cpp context, tolerance) that llama.cpp must compute for ``name``."""
    if name == "gemma3":
        return [("full_logits_gelu_f16", CONTEXT, DENSE_LOGIT_TOLERANCE), ("full_logits", CONTEXT,
                                                                            GGML_GELU_TOLERANCE)]
    if name == "phi3_longrope":
        return [("full_logits", LONGROPE_ORIGINAL_CONTEXT, DENSE_LOGIT_TOLERANCE),
                ("full_logits_long", 2 * LONGROPE_ORIGINAL_CONTEXT, DENSE_LOGIT_TOLERANCE)]
    return [("full_logits", CONTEXT, DENSE_LOGIT_TOLERANCE)]


@pytest.mark.parametrize("name", DENSE)
def test_llama_cpp_computes_transformers_logits_from_both_files(conversions, name: str) -> None:
    """Over the prompt and the greedy continuation, in one pass: the logits within the tolerance
    of transformers', and each greedy token the argmax where transformers chose it."""
    coli, lcpp, ref = conversions[name]
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
    for path in (coli, lcpp):
        for key, n_ctx, tolerance in references(name):
            logits = llama_cpp_logits(path, prompt + greedy, n_ctx)
            assert logit_error(logits, ref[key]) <= tolerance, (path.name, key)
            chosen = slice(len(prompt) - 1, -1)  # the rows that chose the continuation
            assert (logits[chosen].argmax(-1) == ref[key][chosen].argmax(-1)).all(), (path.name, key)
        assert ref["full_logits"][chosen].argmax(-1).tolist() == greedy


@pytest.mark.parametrize("name", DENSE)
def test_llama_cpp_tokenizes_the_prompt_text(conversions, name: str) -> None:
    """The SentencePiece vocabulary as both converters write it: llama.cpp splits the prompt's text
    into the ids the checkpoint's tokenizer gave (BOS first)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    text = json.loads((TINY / name / "reference.json").read_text())["prompt_text"]
    for path in conversions[name][:2]:
        llm = llama_cpp.Llama(str(path), n_ctx=64, vocab_only=True, verbose=False)
        assert llm.tokenize(text.encode(), add_bos=True) == conversions[name][2]["prompt_ids"].tolist()


def test_gemma3_as_transformers_4_wrote_it(capsys, tmp_path: Path) -> None:
    """transformers 4's spelling of Gemma 3's ropes and layers (top-level rope_theta,
    rope_local_base_freq, rope_scaling, sliding_window_pattern) gives the same file."""
    d = copy_tiny("gemma3", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    ropes = cfg.pop("rope_parameters")
    del cfg["layer_types"]
    glob, local = ropes["full_attention"], ropes["sliding_attention"]
    cfg |= {"rope_theta": glob["rope_theta"], "rope_local_base_freq": local["rope_theta"],
            "rope_scaling": {"rope_type": glob["rope_type"], "factor": glob["factor"]},
            "sliding_window_pattern": 6}
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "old.gguf"
    rc, _, err = coli_convert(capsys, d, out, "--type", "f32")
    assert rc == 0, err
    assert hparams(GGUFFile(out)) == hparams(GGUFFile(TINY / "gemma3" / LLAMA_CPP_GGUF))


@pytest.mark.parametrize(("name", "changes", "needle"), [
    ("gemma3", {"layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 3}, "layer_types"),
    ("gemma3", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar is 32"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "needs a number low_freq_factor"),
    ("phi3", {"original_max_position_embeddings": None}, "original_max_position_embeddings"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0],
                                           "short_factor": [1.0], "partial_rotary_factor": 0.75}},
     "long_factor must list 6 numbers"),
    ("qwen2", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3'"),
])
def test_what_llama_cpp_could_not_compute_is_refused(capsys, tmp_path: Path, name: str, changes: dict,
                                                      needle: str) -> None:
    """A config.json that the file llama.cpp reads would not follow stops with one line."""
    d = copy_tiny(name, tmp_path)
    edit_config(d, **changes)
    assert_one_error(capsys, d, tmp_path / "x.gguf", needle)
