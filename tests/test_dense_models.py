"""The dense architectures (qwen2, qwen3, gemma3, phi3 with and without its long RoPE, Llama 3's rope
scaling) on tiny random checkpoints made with transformers (``tests/data/tiny_hf/``): the file
``coli convert`` writes and the one llama.cpp's own converter wrote, each computed by colibri,
against transformers' logits; and by the numpy reference (``colibri.model.reference``).

llama.cpp's agreement with transformers on the same two files is ``test_convert_dense.py``'s."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from convert_harness import DENSE_LOGIT_TOLERANCE, dense_conversions, logit_error

from colibri.model import reference
from colibri.model.generate import SingleSequence
from colibri.model.loader import Model

SHORT_CTX, LONG_CTX = 256, 512  # phi3_longrope's original context, and a cache past it


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    return dense_conversions(tmp_path_factory.mktemp("dense"))


def _cases(conversions):
    for name, ours, theirs, ref in conversions:
        for which, path in (("coli convert", ours), ("llama.cpp's converter", theirs)):
            yield name, which, path, ref


def _logits(path, ref: dict, n_ctx: int) -> np.ndarray:
    ids = [int(i) for i in (*ref["prompt_ids"], *ref["greedy_ids"])]
    model = Model(path, kv_type="f32")
    return SingleSequence(model, n_ctx, 64).prefill(ids, all_logits=True)


def test_colibri_computes_transformers_logits_from_both_files(conversions):
    """f32 files, a float32 KV cache: within 1e-4 of transformers' (relative to the logits' scale),
    the same greedy continuation. gemma3 is held to its exact GELU (colibri's is not rounded
    through ggml's half-precision table)."""
    for name, which, path, ref in _cases(conversions):
        got = _logits(path, ref, SHORT_CTX)
        want = ref["full_logits"]
        assert logit_error(got, want) < DENSE_LOGIT_TOLERANCE, (name, which, logit_error(got, want))
        n = len(ref["prompt_ids"])
        assert (got[n - 1 : -1].argmax(-1) == ref["greedy_ids"]).all(), (name, which)


def test_phi3_takes_its_long_rope_factors_in_a_longer_context(conversions):
    """A cache longer than the original context computes with the long factors (llama.cpp's rule),
    which change the logits: transformers' long-factor logits, not the short ones."""
    for name, which, path, ref in _cases(conversions):
        if name != "phi3_longrope":
            continue
        got = _logits(path, ref, LONG_CTX)
        assert logit_error(got, ref["full_logits_long"]) < DENSE_LOGIT_TOLERANCE, which
        assert logit_error(got, ref["full_logits"]) > 100 * DENSE_LOGIT_TOLERANCE, which


def test_the_reference_computes_transformers_logits(conversions):
    for name, which, path, ref in _cases(conversions):
        ids = [int(i) for i in (*ref["prompt_ids"], *ref["greedy_ids"])]
        got = reference.forward(path, ids)
        assert logit_error(got, ref["full_logits"]) < DENSE_LOGIT_TOLERANCE, (name, which)


# -- what the file's metadata switches, on the parsed hyperparameters ---------------------------------


@pytest.fixture(scope="module")
def gemma_hp(conversions):
    from colibri.model.hparams import HParams
    from colibri.store.gguf import GGUFFile

    path = next(p for name, p, _, _ in conversions if name == "gemma3")
    return HParams.from_gguf(GGUFFile(path))


def test_sliding_layers_follow_the_files_pattern_else_gemmas(gemma_hp):
    from colibri.model.network.dense import Qwen2Decoder
    from colibri.model.network.gemma3 import Gemma3Decoder

    def local(hp) -> list[bool]:
        return [Gemma3Decoder.is_sliding(hp, i) for i in range(hp.n_layers)]

    assert gemma_hp.sliding_window > 0 and gemma_hp.swa_pattern is None
    assert local(gemma_hp) == [True] * 5 + [False]  # six layers: five local, one global
    assert local(replace(gemma_hp, swa_pattern=3)) == [True, True, False] * 2
    assert local(replace(gemma_hp, swa_pattern=(False, True) * 3)) == [False, True] * 3
    assert not any(local(replace(gemma_hp, sliding_window=0)))
    # an architecture without sliding windows ignores a window in its file, as llama.cpp does
    assert not any(Qwen2Decoder.is_sliding(gemma_hp, i) for i in range(gemma_hp.n_layers))


def test_a_rope_scaling_the_engine_cannot_compute_is_named(gemma_hp):
    from colibri.model.file_info import architecture_features

    assert gemma_hp.unsupported_rope() is None
    dynamic = replace(gemma_hp, rope_scaling="dynamic")
    assert dynamic.unsupported_rope() == ("RoPE scaling 'dynamic' is not supported "
                                          "(supported: none, linear, longrope, yarn)")
    assert architecture_features(None, dynamic) == dynamic.unsupported_rope()  # coli info says why



def test_persisted_keys_name_the_rope_they_were_rotated_with(conversions, model):
    """Phi's long RoPE: a slot saved from a cache past the original context (long factors) is not
    restored into a shorter one (short factors), nor the reverse; other models keep the file's
    fingerprint at any context."""
    path = next(p for name, p, _, _ in conversions if name == "phi3_longrope")
    phi = Model(path)
    short, long = phi.kv_fingerprint(SHORT_CTX), phi.kv_fingerprint(LONG_CTX)
    assert len({short, long, phi.fingerprint}) == 3
    assert model.kv_fingerprint(SHORT_CTX) == model.kv_fingerprint(LONG_CTX) == model.fingerprint
