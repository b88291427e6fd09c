"""What the trained tiny models share (``make_tiny_harmony.py``, ``make_tiny_agent.py``): a
byte-level BPE trained on their own texts, and the check that a model learned its replies."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def byte_level_bpe(texts: list[str], vocab: int, specials: list[str]) -> Tokenizer:
    """A GPT-2-style byte-level BPE of ``vocab`` tokens (``specials`` first), as colibri's converter
    writes ``tokenizer.ggml.model = "gpt2"``: every byte text is encodable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def top1_margin(model: torch.nn.Module, prompt: list[int], reply: list[int], who: str) -> float:
    """The smallest top-1 margin over ``reply`` after ``prompt``; a greedy reply that is not the
    learned one stops the script (``who``: its name)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1)
    if top2.indices[:, 0].tolist() != reply:
        raise SystemExit(f"{who}: the model did not learn its replies; raise STEPS")
    return float((top2.values[:, 0] - top2.values[:, 1]).min())
