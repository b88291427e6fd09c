"""A generation ends on every end-of-generation token the vocabulary marks
(not only eos), so no template text leaks into answers; and a reply cut by its token limit in the
middle of a character does not end in U+FFFD."""

from __future__ import annotations

import os

import pytest
from engine_harness import EngineProcess, chat_prompt, engine_args

from colibri.io.events import Done, Submit
from colibri.io.mux import encode_request
from colibri.model.text import ModelText
from colibri.settings import default_model_path

# The issue saw 2 leaks in ~40 samples: 200 make a clean run meaningful (``make test-long``);
# ``make test`` takes 64 (COLI_LEAK_SAMPLES) to keep the suite inside its time budget.
SAMPLES = int(os.environ.get("COLI_LEAK_SAMPLES", "200"))
BATCH = 16  # slots: the samples run sixteen at a time
LEAKS = ("\nuser\n", "\nassistant\n", "\nsystem\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>")
QUESTIONS = ["Tell me a short story about a gift.", "Write a poem about the sea.",
             "Describe your favourite meal.", "What do cats dream about?"]


@pytest.fixture(scope="module")
def tokenizer():
    return ModelText.open(default_model_path()).tokenizer


def test_every_end_of_generation_token_stops(tokenizer):
    names = {tokenizer.tokens[i] for i in tokenizer.stop_ids}
    assert {"<|im_end|>", "<|endoftext|>", "<|im_start|>"} <= names
    assert all(tokenizer.types[i] == 3 for i in tokenizer.stop_ids)  # control tokens only


def test_a_reply_cut_mid_character_drops_the_unfinished_tail(tokenizer):
    first_byte_of_e_acute = tokenizer.tokens.index("Ã")  # U+00E9 is C3 A9; this token is C3
    decoder = tokenizer.stream()
    assert "".join(decoder.feed(t) for t in tokenizer.encode("caf")) == "caf"
    assert decoder.feed(first_byte_of_e_acute) == ""
    assert decoder.flush() == ""  # was "\ufffd"
    whole = tokenizer.stream()
    text = "".join(whole.feed(t) for t in tokenizer.encode("café ☕")) + whole.flush()
    assert text == "café ☕"


async def test_sampled_replies_never_leak_template_text(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=BATCH, ctx=512))
    texts: list[str] = []
    for wave in range(0, SAMPLES, BATCH):
        rids = range(wave + 1, min(SAMPLES, wave + BATCH) + 1)
        for slot, rid in enumerate(rids):
            prompt = chat_prompt(QUESTIONS[rid % len(QUESTIONS)])
            await engine.send(encode_request(Submit(rid, slot, 64, 1.0, 1.0, prompt, seed=rid)))
        for rid in rids:
            out = await engine.result(rid)
            assert isinstance(out.final, Done)
            texts.append(out.text.decode("utf-8", errors="replace"))
    assert len(texts) == SAMPLES
    leaked = [t for t in texts if any(marker in t for marker in LEAKS)]
    assert leaked == []
    assert sum(t.endswith("\ufffd") for t in texts) == 0
