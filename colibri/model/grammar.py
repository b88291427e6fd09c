"""Grammar-constrained sampling: every sampled token keeps the output inside a grammar.

The token-mask machinery is llguidance's (the library llama.cpp and vLLM use): it takes GBNF or its
own Lark dialect, where ``%json {...}`` embeds a JSON schema, and computes, per step, the set of
vocabulary tokens that keep the output a prefix of some sentence of the grammar, in tens of
microseconds for a 49k vocabulary. Chosen over xgrammar (needs torch and transformers at run time)
and outlines-core (regex-only: no GBNF, and an index build per schema that costs seconds): see
docs/serve_protocol.md.

``compile_grammar`` checks a grammar without a vocabulary (the HTTP server validates a client's
schema before it reaches the engine); ``GrammarVocab`` binds llguidance to the model's tokenizer
once; ``Constraint`` is one request's state.
"""

from __future__ import annotations

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from colibri.errors import ColibriError


class GrammarError(ColibriError):
    """A grammar that does not parse or compile."""


def compile_grammar(text: str) -> str:
    """``text`` (GBNF, or llguidance Lark) as llguidance's grammar; GrammarError says what is wrong.
    A grammar that is valid here compiles against any vocabulary."""
    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter's own errors carry no common base class
        raise GrammarError(f"the grammar does not parse: {e}") from None
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message:
        raise GrammarError(f"the grammar does not compile: {message}")
    return grammar


class GrammarVocab:
    """llguidance's view of the model's vocabulary: built once (~0.2 s for 49k tokens), shared by
    every request. ``stop_ids`` are the tokens a finished grammar lets through (end of turn)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, stop_ids: frozenset[int]) -> None:
        self.n_vocab = n_vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=sorted(stop_ids))

    def constraint(self, text: str) -> Constraint:
        return Constraint(self, compile_grammar(text))


class Constraint:
    """One request's grammar state: ``allowed()`` before sampling, ``advance(token)`` after."""

    def __init__(self, vocab: GrammarVocab, grammar: str) -> None:
        self.vocab = vocab
        self.matcher = llguidance.LLMatcher(vocab.tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {self.matcher.get_error()}")
        self._bits = np.zeros((vocab.n_vocab + 31) // 32, np.int32)

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.vocab.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids at -inf (a copy)."""
        return np.where(self.allowed(), logits, -np.inf).astype(np.float32)

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False if the grammar refuses it (it was not masked in)."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The output is a whole sentence of the grammar and nothing may follow it."""
        return self.matcher.is_stopped()
