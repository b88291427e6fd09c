"""``coli convert``'s files loaded by llama.cpp (llama-cpp-python, skipped without it): its logits and
greedy tokens against transformers', the proof that names, permutations and routing semantics are
right."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from convert_harness import ARCHS, LOGIT_TOLERANCE, TINY, convert_every_type

# llama.cpp's top-1 agreement with transformers for q8_0 and q4_0 files. It rounds every matmul's
# input to 8 bits: on the tiny DeepSeek-V3 layout's q4_0 file it keeps 25 of 28 choices (0.89),
# where colibri, whose dense inputs keep 15 bits, is held to 0.9 (test_moe_models.py).
MIN_QUANT_AGREEMENT = 0.85


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every tiny checkpoint converted to every type, once for the module."""
    return convert_every_type(tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_agrees_with_transformers(converted, arch: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = np.load(TINY / arch / "reference.npz")
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()

    def load(t: str):
        # F32 KV cache: llama.cpp's default F16 cache alone moves logits by ~1e-2.
        return llama_cpp.Llama(str(converted[arch, t]), n_ctx=256, logits_all=True, verbose=False,
                               type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)

    llm = load("f32")
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)])
    assert np.abs(logits - ref["logits"]).max() <= LOGIT_TOLERANCE
    tokens = []
    for _ in greedy:
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    assert tokens == greedy
    for t in ("q8_0", "q4_0"):
        llm = load(t)
        llm.eval(prompt + greedy)
        top1 = np.array(llm.scores[: len(prompt) + len(greedy)]).argmax(-1)
        assert (top1 == ref["full_logits"].argmax(-1)).mean() >= MIN_QUANT_AGREEMENT, t
