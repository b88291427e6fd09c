"""Grammar-constrained sampling: every sampled token keeps the output inside a grammar.

The token-mask machinery is llguidance's (the library llama.cpp and vLLM use): it takes GBNF or its
own Lark dialect, where ``%json {...}`` embeds a JSON schema (a grammar that is a bare JSON schema,
as colibri's gateway sends, is read as one), and computes, per step, the set of
vocabulary tokens that keep the output a prefix of some sentence of the grammar, in tens of
microseconds for a 49k vocabulary. Chosen over xgrammar (needs torch and transformers at run time)
and outlines-core (regex-only: no GBNF, and an index build per schema that costs seconds): see
docs/serve_protocol.md.

A grammar is compiled once per request at most, and once per distinct text in each process:

- ``compile_grammar`` checks a grammar without a vocabulary, where it is first met (the HTTP server
  answers a schema llguidance refuses with a 400 naming the field, the Channel session refuses the
  SET_SYSTEM); it is cached by text, so the tools or schema an agent sends with every turn are
  checked once.
- ``GrammarVocab.constraint``, in the engine, compiles the grammar against the vocabulary (the
  compile that the mask needs, a few milliseconds for a tool set) and keeps the fresh matcher by
  text; each request gets a copy (microseconds), which shares the compiled lexer and its caches.
  It does not check the grammar first: the matcher's own compile reports the same faults.

Caching by text in each process, rather than checking in the server and trusting the engine, keeps
the engine safe from any SUBMIT's grammar and the server's 400s before admission, at the price of
one compile per process for a grammar never seen before.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from colibri.errors import ColibriError
from colibri.model.json_grammar import json_grammar

# Distinct grammars kept compiled, in each cache: a server's clients send a handful of tool sets and
# schemas over and over; the bound keeps one that sends a new schema every request from growing it.
GRAMMAR_CACHE = 32
# How much of llguidance's message an error keeps: its first line names the fault; the rest echoes
# the whole grammar back.
MAX_ERROR_CHARS = 300


class GrammarError(ColibriError):
    """A grammar that does not parse or compile."""


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return (lines[0] if lines else "")[:MAX_ERROR_CHARS]


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _schema_lark(text: str) -> str:
    """A JSON object given as the grammar is a JSON schema, the grammar colibri's gateway sends for
    ``json_schema`` (the schema itself): its Lark is ``json_grammar``'s, as ``coli serve`` builds
    it. Neither GBNF nor Lark can begin with ``{`` (a rule begins with its name), so nothing else
    is read as a schema."""
    try:
        schema = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        reason = _first_line(str(e)) or "nested too deep"
        raise GrammarError(f"the grammar looks like a JSON schema but is not JSON: {reason}") from None
    try:
        return json_grammar(schema)
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deep") from None


def _lark(text: str) -> str:
    """``text`` (GBNF, llguidance Lark, or a JSON schema) as llguidance's grammar object (not yet
    compiled)."""
    schema = _schema_lark(text) if text.lstrip().startswith("{") else None
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text) if schema is None else schema)
    except Exception as e:  # noqa: BLE001 - the converter's own errors carry no common base class
        raise GrammarError(f"the grammar does not parse: {_first_line(str(e)) or type(e).__name__}") from None


@lru_cache(maxsize=GRAMMAR_CACHE)
def compile_grammar(text: str) -> str:
    """``text`` as llguidance's grammar, once it compiles; GrammarError says what is wrong. A
    grammar that is valid here compiles against any vocabulary. Cached by text (a refused one
    is not: the exception is raised afresh)."""
    grammar = _lark(text)
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message:
        raise GrammarError(f"the grammar does not compile: {_first_line(message)}")
    return grammar


class GrammarVocab:
    """llguidance's view of the model's vocabulary: built once (~0.2 s for 49k tokens), shared by
    every request. ``stop_ids`` are the tokens a finished grammar lets through (end of turn)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, stop_ids: frozenset[int]) -> None:
        self.n_vocab = n_vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=sorted(stop_ids))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # never advanced
        self._lock = threading.Lock()  # requests compile in worker threads

    def constraint(self, text: str) -> Constraint:
        """A fresh state of ``text``'s grammar for one request (module docstring: the cache)."""
        with self._lock:
            fresh = self._compiled.get(text)
            if fresh is not None:
                self._compiled.move_to_end(text)
                return Constraint(self, fresh.deep_copy())
        fresh = llguidance.LLMatcher(self.tokenizer, _lark(text))
        if fresh.is_error():
            raise GrammarError(f"the grammar does not compile: {_first_line(fresh.get_error())}")
        with self._lock:
            self._compiled[text] = fresh
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
            return Constraint(self, fresh.deep_copy())


class Constraint:
    """One request's grammar state: ``allowed()`` before sampling, ``advance(token)`` after."""

    def __init__(self, vocab: GrammarVocab, matcher: llguidance.LLMatcher) -> None:
        self.vocab = vocab
        self.matcher = matcher
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
