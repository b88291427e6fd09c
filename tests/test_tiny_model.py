"""The tiny random llama of tools/make_tiny_llama.py: colibri loads it, and its logits are those of
a plain float64 llama forward over the same weights, read and dequantized by gguf-py, not by us."""

from __future__ import annotations

import importlib.util
import mmap
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from colibri.model.generate import SingleSequence
from colibri.model.kernels.int8_matmul import LEVELS
from colibri.model.loader import Model
from colibri.model.reference import rounded
from colibri.model.sampling import Sampler, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tiny_llama", ROOT / "tools" / "make_tiny_llama.py")
mtl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mtl
_spec.loader.exec_module(mtl)

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]
CONFIG = dict(n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, context_length=512)
PROMPT = [1, *range(40, 75), 300, 2, 0, 5, 259]  # 41 ids: specials, bytes, merged tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    out = {t: mtl.write_tiny_llama(d / f"tiny-{t}.gguf", gtype=t, **CONFIG) for t in TYPES}
    out["q8_0-untied"] = mtl.write_tiny_llama(d / "tiny-untied.gguf", gtype="q8_0", tied=False, seed=3)
    return out


@pytest.fixture(scope="module")
def models(files) -> dict[str, Model]:
    return {k: Model(p) for k, p in files.items()}


# --- the reference: gguf-py reads the file, numpy float64 computes -----------------------------


def reference_weights(path: Path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
            [int(n) for n in reversed(t.shape)]
        )
        for t in reader.tensors
    }


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, head_dim: int, base: float = 10000.0) -> np.ndarray:
    """x (T, heads * head_dim): rotate adjacent pairs (2i, 2i+1) by pos * base^(-2i/head_dim)."""
    t_rows = x.shape[0]
    x = x.reshape(t_rows, -1, head_dim // 2, 2)
    angle = np.arange(t_rows)[:, None] * base ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., 0], x[..., 1]
    return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(t_rows, -1)


def half(x: np.ndarray) -> np.ndarray:
    """x as the KV cache keeps it: rounded to float32, then to an IEEE half."""
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def reference_logits(w: dict[str, np.ndarray], ids: list[int], n_layers: int, n_heads: int,
                     n_kv: int, levels: int = 0) -> np.ndarray:
    """The float64 forward; every matmul's input first ``rounded`` to ``levels``, keys and values
    held as halves."""
    x = w["token_embd.weight"][ids]
    t_rows, n_embd = x.shape
    hd = n_embd // n_heads
    causal = np.tril(np.ones((t_rows, t_rows), bool))
    for i in range(n_layers):
        p = f"blk.{i}."
        h = rounded(rmsnorm(x, w[p + "attn_norm.weight"]), levels)
        q = rope(h @ w[p + "attn_q.weight"].T, hd).reshape(t_rows, n_heads, hd)
        k = rope(h @ w[p + "attn_k.weight"].T, hd).reshape(t_rows, n_kv, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(t_rows, n_kv, hd)
        k, v = half(k), half(v)  # the KV cache's halves
        attn = np.empty((t_rows, n_heads, hd))
        for head in range(n_heads):
            kv = head // (n_heads // n_kv)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            prob = np.exp(scores - scores.max(axis=1, keepdims=True))
            prob /= prob.sum(axis=1, keepdims=True)
            attn[:, head] = prob @ v[:, kv]
        x = x + rounded(attn.reshape(t_rows, -1), levels) @ w[p + "attn_output.weight"].T
        h = rounded(rmsnorm(x, w[p + "ffn_norm.weight"]), levels)
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + rounded(gate / (1 + np.exp(-gate)) * up, levels) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", w["token_embd.weight"])
    return rounded(rmsnorm(x, w["output_norm.weight"]), levels) @ out.T


# --- tests ---------------------------------------------------------------------------------------


def test_vocabulary_shape():
    tokens, types, merges = mtl.build_vocab()
    assert len(tokens) % 32 == 0 and len(tokens) == len(types) == len(set(tokens))
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:3] == [3, 3, 3]
    assert types[3:259] == [1] * 256
    assert len(merges) == len(tokens) - 259 - types.count(5)


@pytest.mark.parametrize("gtype", TYPES)
def test_hparams_and_tensor_types(models, files, gtype):
    m = models[gtype]
    hp = m.hp
    assert (hp.arch, hp.n_layers, hp.n_embd, hp.n_ff) == ("llama", 2, 64, 128)
    assert (hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.rope_dim) == (4, 2, 16, 16)
    assert hp.n_vocab == m.tokenizer.n_vocab == len(mtl.build_vocab()[0])
    assert hp.context_length == 512 and hp.rope_base == 10000.0
    assert hp.norm_eps == pytest.approx(1e-5)
    info = m.gguf.tensors
    assert info["token_embd.weight"].shape == (64, hp.n_vocab)
    assert info["blk.1.ffn_down.weight"].shape == (128, 64)
    assert info["blk.0.attn_k.weight"].shape == (64, 32)
    assert info["blk.0.attn_q.weight"].gtype.name.lower() == gtype
    assert info["output_norm.weight"].gtype.name == "F32"
    assert "output.weight" not in info


@pytest.mark.parametrize("gtype", [*TYPES, "q8_0-untied"])
def test_logits_match_float64_reference(models, files, gtype):
    """One step of 41 rows, chunks of 5 (the KV cache across steps), and the reference; both
    sides use the same dequantized weights. The packed kinds' activations are rounded to the
    integer path's two levels, on both sides, and keys and values to halves (the KV cache's type).
    Where a float32 value and its float64 twin round apart, they differ by a whole step (a last
    level's, or a half's ulp), so the two agree to 0.4-4.8e-3 (measured, logits' std 2.4), bounded
    at 6e-3; the halves alone move the logits by 1.2-2.8e-2, which this bound catches. A prompt
    run in chunks is bitwise the run whole."""
    m = models[gtype]
    levels = LEVELS if gtype.startswith("q") else 0
    bound = 6e-3
    ref = reference_logits(reference_weights(files[gtype]), PROMPT, 2, 4, 2, levels)
    whole = SingleSequence(m, 256, 64).prefill(PROMPT, all_logits=True)
    chunked = SingleSequence(m, 256, 5).prefill(PROMPT, all_logits=True)
    assert whole.shape == ref.shape == (len(PROMPT), m.hp.n_vocab)
    assert np.abs(whole - ref).max() < bound, np.abs(whole - ref).max()
    assert np.abs(chunked - ref).max() < bound, np.abs(chunked - ref).max()
    if levels:  # the float kinds' prompt rows go through BLAS as one product
        assert np.array_equal(chunked, whole)
    assert ref.std() > 0.5  # logits that mean something, not all near zero


@pytest.mark.parametrize("gtype", TYPES)
def test_greedy_generation_varies(models, gtype):
    m = models[gtype]
    prompt = m.tokenizer.encode(m.chat_template.render([{"role": "user", "content": "hello"}]), special=True)
    out = list(SingleSequence(m, 256, 64).generate(prompt, Sampler(SamplingParams()), 8, frozenset()))
    assert len(out) == 8
    assert len(set(out)) > 2, out


def test_same_seed_same_file_other_seed_other_weights(tmp_path, files):
    a = mtl.write_tiny_llama(tmp_path / "a.gguf", gtype="q4_1", **CONFIG)
    b = mtl.write_tiny_llama(tmp_path / "b.gguf", gtype="q4_1", seed=1, **CONFIG)
    assert a.read_bytes() == files["q4_1"].read_bytes()
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()


@pytest.mark.parametrize("text", [
    "hello world", "The cat sat on the mat, and the dog ran in.", "  two spaces\tand\na newline\n\n",
    "héllo 日本語 🐦 ünïcödé", "digits 1234567 and 3.14", "<|im_start|>user\nhi<|im_end|>", "",
])
def test_tokenizer_round_trip(models, text):
    tok = models["q4_1"].tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.n_vocab for i in ids)


def test_tokenizer_specials_and_merges(models):
    tok = models["q4_1"].tokenizer
    index = {t: i for i, t in enumerate(tok.tokens)}
    assert tok.encode("<|im_start|>", special=True) == [1]
    assert tok.encode("<|im_end|>", special=True) == [2]
    assert tok.encode("<|im_start|>") != [1]  # without special, it is text
    assert tok.decode([1, 2, 0]) == ""  # control tokens do not render
    assert tok.encode("hello world the") == [index["hello"], index["Ġworld"], index["Ġthe"]]
    # every end-of-text or turn marker stops, not only eos
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.stop_ids) == (1, 2, False, frozenset({0, 1, 2}))


def test_chat_template(models):
    m = models["q4_1"]
    text = m.chat_template.render([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = m.tokenizer.encode(text, special=True)
    assert ids.count(1) == 3 and ids.count(2) == 2 and ids[0] == 1


def test_load_time(files, models):
    """A load reads nothing a step does not need, which is what keeps it in milliseconds (the
    times are printed, run with -s, never asserted): the tokenizer and the chat template are built
    on first use, and the embedding table stays the file's mapped bytes (a token's row dequantized
    when a step needs it), not a copy."""
    path = files["q4_1"]
    times = []
    for _ in range(5):
        start = time.perf_counter()
        m = Model(path)
        times.append(time.perf_counter() - start)
    print(f"\ntiny q4_1 model ({path.stat().st_size} bytes): load {min(times) * 1e3:.1f} ms "
          f"(best of 5, median {sorted(times)[2] * 1e3:.1f} ms)")
    built = {"tokenizer", "chat_template"}
    assert not built & set(vars(m.text)), "the load built the tokenizer or the template"
    table = m.decoder.embedding.table
    assert table.nbytes == m.gguf.tensors["token_embd.weight"].nbytes
    while isinstance(table, np.ndarray):
        table = table.base
    assert isinstance(table, memoryview) and isinstance(table.obj, mmap.mmap), type(table)
    m.chat_template.render([{"role": "user", "content": "hi"}])
    assert built <= set(vars(m.text))  # built on first use, where the check above looks for them


def test_coli_run_on_tiny_model(files, models):
    """``coli run PROMPT --output ids`` prints the greedy continuation of the chat prompt that
    PROMPT makes, the same ids as the model run here (five, none of them a stop id)."""
    m = models["q4_1"]
    prompt = m.text.encode_chat([{"role": "user", "content": "hello"}])
    expected = list(SingleSequence(m, 256, 64).generate(prompt, Sampler(SamplingParams()), 5,
                                                        m.tokenizer.stop_ids))
    assert len(expected) == 5 and len(set(expected)) > 1, expected
    cmd = [sys.executable, "-m", "colibri", "run", "--model", str(files["q4_1"]), "--max-tokens", "5",
           "--output", "ids", "hello"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ",".join(map(str, expected)) + "\n", (proc.stdout, expected)
    print(f"\ncoli run on the tiny model: {elapsed:.2f} s (process start, imports, load, 5 tokens)")


def test_tool_cli(tmp_path):
    out = tmp_path / "cli.gguf"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_llama.py"), str(out), "--type", "q8_0",
         "--layers", "1", "--embd", "32", "--ff", "64", "--heads", "2", "--kv-heads", "1", "--untied"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    m = Model(out)
    assert (m.hp.n_layers, m.hp.n_embd, m.hp.n_ff, m.hp.n_heads, m.hp.n_kv_heads) == (1, 32, 64, 2, 1)
    assert "output.weight" in m.gguf.tensors
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_llama.py"), str(out),
                          "--type", "q4_0", "--embd", "48", "--heads", "3", "--kv-heads", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "multiples of 32" in bad.stderr
