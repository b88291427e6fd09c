"""The default model against llama.cpp's view of it (tests/data/golden, see its README)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from colibri.model.generate import SingleSequence
from colibri.model.sampling import Sampler, SamplingParams

# llama.cpp multiplies against 8-bit activations, we against two 8-bit levels (~15 bits): near-ties
# may flip.
NEAR_TIE = 0.3
MIN_TOP1_AGREEMENT = 0.95


def test_golden_is_for_this_model(golden, model_path):
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert digest == golden["model_sha256"]


def test_tokenize_matches_llamacpp(golden, model):
    tok = model.tokenizer
    for entry in golden["tokenize"]:
        assert tok.encode(entry["text"]) == entry["ids"], entry["text"]
        assert tok.encode(entry["text"], special=True) == entry["ids_special"], entry["text"]


def test_chat_template_and_prompt_ids(golden, model):
    for gen in golden["generations"]:
        prompt = model.chat_template.render(gen["messages"])
        assert prompt == gen["prompt"]
        assert model.tokenizer.encode(prompt, special=True) == gen["prompt_ids"]


@pytest.fixture(scope="module")
def teacher_forced(golden, model):
    """Our logits at every position of prompt + llama.cpp's greedy continuation."""
    out = []
    for gen in golden["generations"]:
        seq = gen["prompt_ids"] + gen["greedy_ids"]
        logits = SingleSequence(model, 1024, 512).prefill(seq, all_logits=True)
        out.append((gen, logits))
    return out


def test_top1_agreement(teacher_forced):
    agree = total = 0
    for gen, logits in teacher_forced:
        for entry in gen["top10"]:
            if entry["pos"] >= logits.shape[0]:
                continue  # the position after the last token: llama.cpp evaluated it, we did not
            ours = int(np.argmax(logits[entry["pos"]]))
            total += 1
            agree += ours == entry["ids"][0]
            gap = entry["logits"][0] - entry["logits"][1]
            if gap >= NEAR_TIE:
                assert ours == entry["ids"][0], (gen["prompt"][-40:], entry["pos"], gap)
    assert total > 200
    assert agree / total >= MIN_TOP1_AGREEMENT, agree / total


def test_logits_close(teacher_forced):
    """The top-10 logits themselves, not only their order, are llama.cpp's within quantization noise."""
    diffs = []
    for gen, logits in teacher_forced:
        for entry in gen["top10"]:
            if entry["pos"] < logits.shape[0]:
                diffs.extend(np.abs(logits[entry["pos"]][entry["ids"]] - np.array(entry["logits"])))
    assert np.median(diffs) < 0.25, np.median(diffs)


def test_greedy_matches_until_first_near_tie(golden, model):
    stop = model.tokenizer.stop_ids
    for gen in golden["generations"]:
        gaps = [e["logits"][0] - e["logits"][1] for e in gen["top10"]]
        n_sure = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
        n_sure = min(n_sure, len(gen["greedy_ids"]))
        seq = SingleSequence(model, 1024, 512)
        ours = list(seq.generate(gen["prompt_ids"], Sampler(SamplingParams()), n_sure, stop))
        assert ours[:n_sure] == gen["greedy_ids"][:n_sure], gen["prompt"][-40:]


def test_chunked_prefill_equals_one_batch(golden, model):
    """Prefill split in chunks of 7, and token by token, gives the logits of a single batch, bit
    for bit: every row takes the same integer matmul steps and the same attention loop, whatever
    else is in its step."""
    ids = golden["generations"][3]["prompt_ids"]
    whole = SingleSequence(model, 256, 512).prefill(ids, all_logits=True)
    chunked = SingleSequence(model, 256, 7).prefill(ids, all_logits=True)
    single = SingleSequence(model, 256, 1).prefill(ids, all_logits=True)
    np.testing.assert_allclose(chunked, whole, atol=2e-3, rtol=1e-4)
    np.testing.assert_allclose(single, whole, atol=2e-3, rtol=1e-4)
    assert np.array_equal(chunked, whole) and np.array_equal(single, whole)
