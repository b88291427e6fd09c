"""Sampler parameters and their guarantees; the GGUF tokenizer and streaming detokenizer on the
real default model."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.model.sampling import REPETITION_WINDOW, Sampler, SamplingParams, top_candidates
from colibri.model.tokenizer import GGUFTokenizer
from colibri.settings import default_model_path
from colibri.store.gguf import GGUFFile

VOCAB = 64


def logits(seed: int, n: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 2


def draws(params: SamplingParams, n: int = 300, row: np.ndarray | None = None) -> list[int]:
    s = Sampler(params)
    row = logits(0) if row is None else row
    return [s(row) for _ in range(n)]


def test_temperature_zero_is_argmax():
    s = Sampler(SamplingParams(temperature=0.0, seed=1))
    for seed in range(20):
        row = logits(seed)
        assert s(row) == int(np.argmax(row))


def test_seed_fixes_the_sequence_and_different_seeds_differ():
    p = SamplingParams(temperature=1.0, seed=42)
    a, b = draws(p), draws(p)
    c = draws(SamplingParams(temperature=1.0, seed=43))
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # really sampling, not argmax


def test_samples_follow_the_softmax():
    row = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    got = np.bincount(draws(SamplingParams(temperature=1.0, seed=3), 4000, row), minlength=4) / 4000
    want = np.exp(row) / np.exp(row).sum()
    np.testing.assert_allclose(got, want, atol=0.03)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=5.0, top_k=1, seed=0),
        SamplingParams(temperature=5.0, top_p=1e-6, seed=0),
        SamplingParams(temperature=5.0, min_p=1.0, seed=0),
    ],
    ids=["top_k=1", "top_p~0", "min_p=1"],
)
def test_truncation_to_one_token_is_argmax(params: SamplingParams):
    s = Sampler(params)
    for seed in range(50):
        row = logits(seed)
        assert s(row) == int(np.argmax(row))


def test_top_k_keeps_only_the_k_best():
    row = logits(4)
    best3 = set(np.argsort(-row)[:3].tolist())
    got = set(draws(SamplingParams(temperature=10.0, top_k=3, seed=5), 300, row))
    assert got == best3


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.7, seed=6), 500, row))
    assert got == {0, 1}


def test_min_p_drops_tokens_below_the_threshold():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    got = set(draws(SamplingParams(temperature=1.0, min_p=0.6, seed=7), 500, row))
    assert got == {0, 1}  # threshold 0.6 * 0.4 = 0.24


def test_repetition_penalty_changes_the_argmax():
    row = np.array([2.0, 1.9, 0.5, -1.0, -1.1], np.float32)
    s = Sampler(SamplingParams(repetition_penalty=1.2))
    assert s(row) == 0
    assert s(row, history=[0, 0, 4]) == 1  # 2.0 / 1.2 < 1.9
    neg = np.array([-1.0, -1.1], np.float32)
    assert s(neg) == 0
    assert s(neg, history=[0]) == 1  # a negative logit is multiplied: -1.2 < -1.1
    assert s(row, history=[0] + [2] * REPETITION_WINDOW) == 0  # 0 is outside the window
    assert row[0] == 2.0  # the caller's logits are not modified


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
        {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1}, {"min_p": 1.01}, {"top_k": -1},
        {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
    ],
)
def test_invalid_params_raise(kwargs: dict):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**kwargs))


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(default_model_path()))


def stream(tok: GGUFTokenizer, ids: list[int]) -> list[str]:
    dec = tok.stream()
    pieces = [dec.feed(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("text", ["日本語 🙂 café", "a🦜b𝔘 ñ", "Hello, world!\n  x = 1"])
def test_encode_decode_round_trip(tok: GGUFTokenizer, text: str):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_holds_back_a_split_emoji(tok: GGUFTokenizer):
    text = "a🦜b"
    ids = tok.encode(text)

    def valid(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    split = [i for i in ids if not valid(tok.token_bytes(i))]
    assert len(split) >= 2, "the emoji must span several tokens for this test to mean anything"
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert "" in pieces  # something was held back
    assert "🦜" in pieces  # and came out whole
    assert not any("\ufffd" in p for p in pieces)


def test_flush_of_an_unfinished_character_drops_it(tok: GGUFTokenizer):
    """A reply cut mid-character ends before it, not in U+FFFD."""
    first = tok.encode("🦜")[0]
    dec = tok.stream()
    assert dec.feed(first) == ""
    assert dec.flush() == ""


def test_special_tokens(tok: GGUFTokenizer):
    assert tok.encode("<|im_start|>", special=True) == [1]
    plain = tok.encode("<|im_start|>")
    assert len(plain) > 1 and 1 not in plain
    assert tok.decode(plain) == "<|im_start|>"
    assert tok.token_bytes(1) == b""  # control tokens render as nothing
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", special=True)[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", special=True)[-1] == 2
    assert tok.eos_id in tok.stop_ids
    assert tok.token_bytes(-1) == b"" and tok.token_bytes(tok.n_vocab) == b""


def test_client_text_stays_text_while_other_threads_encode_control_tokens(tok: GGUFTokenizer):
    """Requests encode in worker threads: one encoding template markup (special) must not make
    another's client text become control tokens (the flag is the ``tokenizers`` object's state).
    The real tokenizer, behind a proxy whose encode sleeps once the flag is read, so that the other
    thread runs exactly in the window."""
    import threading
    import time

    real = tok._tok

    class Slow:
        encode_special_tokens = True

        def encode_batch(self, texts: list[str], add_special_tokens: bool):
            real.encode_special_tokens = self.encode_special_tokens
            time.sleep(0.002)  # the other thread runs here
            real.encode_special_tokens = self.encode_special_tokens
            return real.encode_batch(texts, add_special_tokens=add_special_tokens)

    im_start = tok.encode("<|im_start|>", special=True)[0]
    leaked: list[list[int]] = []
    go = threading.Barrier(2)

    failed: list[BaseException] = []
    done: list[int] = []

    def markup() -> None:
        go.wait()
        for _ in range(20):
            tok.encode("<|im_start|>user", special=True)

    def client() -> None:
        go.wait()
        for _ in range(20):
            ids = tok.encode("<|im_start|>user")
            done.append(1)
            if im_start in ids:
                leaked.append(ids)

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # a thread's failure must fail the test, not only warn
                failed.append(e)
        return run

    tok._tok = Slow()
    try:
        threads = [threading.Thread(target=guarded(markup)), threading.Thread(target=guarded(client))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        tok._tok = real
    assert not failed, failed
    assert len(done) == 20
    assert not leaked, f"{len(leaked)} of 20 client encodes held <|im_start|> as a control token"


def _top_reference(logits: np.ndarray, sampled: int, n: int) -> list[tuple[int, float]]:
    order = np.lexsort((np.arange(len(logits)), -logits.astype(np.float64)))  # ties: lower id first
    best = [int(t) for t in order[:n] if t != sampled][: n - 1]
    shifted = logits.astype(np.float64) - float(logits.max())
    log_z = float(logits.max()) + float(np.log(np.exp(shifted).sum()))
    return [(t, float(logits[t]) - log_z) for t in [sampled, *best]]


def test_top_candidates_are_the_best_ids_with_their_log_probabilities():
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(6, 4000))
        logits = (rng.standard_normal(n) * rng.uniform(0.1, 20)).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits)  # ties
        if trial % 5 == 0:
            logits[rng.random(n) < 0.7] = -np.inf  # a grammar's mask
        sampled = int(rng.integers(0, n))
        got, want = top_candidates(logits, sampled, 5), _top_reference(logits, sampled, 5)
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == b or abs(a - b) < 1e-5 * max(1.0, abs(b))


def test_top_candidates_of_a_row_without_a_finite_peak_are_nan_not_an_error():
    for row in (np.full(8, -np.inf, np.float32), np.array([0.0, np.nan, 1.0], np.float32)):
        got = top_candidates(row, 1, 3)
        assert got[0][0] == 1 and all(np.isnan(lp) for _, lp in got)


def test_top_candidates_with_fewer_finite_logits_than_asked_are_still_real_ids():
    logits = np.full(50, -np.inf, np.float32)
    logits[[7, 30]] = [1.0, 2.0]  # a grammar left two tokens
    got = top_candidates(logits, 30, 5)
    assert [t for t, _ in got][:2] == [30, 7]
    assert all(0 <= t < 50 for t, _ in got)
    assert got[0][1] == pytest.approx(-np.log1p(np.exp(-1.0)), abs=1e-6)
    assert all(lp == -np.inf for _, lp in got[2:])
    assert [t for t, _ in top_candidates(np.array([3.0, 1.0], np.float32), 1, 5)] == [1, 0]
