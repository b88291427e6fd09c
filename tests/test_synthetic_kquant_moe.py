"""The scaled-down real architectures of ``tools/make_synthetic_moe.py --arch qwen3moe|glm4moe``
(``bench/bench_moe_peer.py``'s real architectures): each is llama.cpp's Q4_K_M mix, its random
K-quant blocks have the spread of the Q4_0 file's, and colibri and llama.cpp (the peer, on the same
file) compute the same logits from it; colibri gives the same tokens whatever its expert budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from quant_harness import llama_model
from test_expert_store import make_synthetic_moe

from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.model.sampling import Sampler, SamplingParams
from colibri.store.blocks import dequantize_row
from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFFile
from colibri.store.packed import KIND_Q4, KIND_Q6, weight_nbytes

LAYERS = 8
SHAPE = dict(n_layers=LAYERS, n_experts=8, n_used=2, n_embd=256, n_ff=256, n_vocab=512, n_heads=4,
             n_kv_heads=2, head_dim=64)
PROMPT = [1, 300, 301, 302, 400, 401, 7, 9, 300, 260, 261, 500]


@pytest.fixture(scope="module", params=["qwen3moe", "glm4moe"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def kquant_file(arch, tmp_path_factory) -> Path:
    """The file of each real architecture."""
    path = tmp_path_factory.mktemp(arch) / f"synthetic-{arch}.gguf"
    return make_synthetic_moe.write_synthetic_moe(path, arch=arch, **SHAPE)


def test_the_file_is_llama_cpps_q4_k_m_mix(kquant_file, arch):
    g = GGUFFile(kquant_file)
    assert g.get("general.architecture") == arch
    assert g.tensors["token_embd.weight"].gtype == GGMLType.Q4_K
    assert g.tensors["output.weight"].gtype == GGMLType.Q6_K
    more = [i for i in range(LAYERS) if make_synthetic_moe.use_more_bits(i, LAYERS)]
    assert more == [0, 3, 6, 7]  # llama.cpp's rule at 8 layers: first and last eighth, every third
    dense = {"qwen3moe": 0, "glm4moe": 1}[arch]  # GLM-4.5's leading dense layer
    assert g.get(f"{arch}.leading_dense_block_count", 0) == dense
    for i in range(LAYERS):
        big = GGMLType.Q6_K if i in more else GGMLType.Q4_K
        ffn = [("ffn_gate", GGMLType.Q4_K), ("ffn_up", GGMLType.Q4_K), ("ffn_down", big)]
        parts = [(name + sfx, t) for name, t in ffn for sfx in (("",) if i < dense else ("_exps",))]
        if arch == "glm4moe" and i >= dense:  # the shared expert, in the same mix
            parts += [(name + "_shexp", t) for name, t in ffn]
        for name, want in (*parts, ("attn_v", big), ("attn_q", GGMLType.Q4_K)):
            assert g.tensors[f"blk.{i}.{name}.weight"].gtype == want, (i, name)
        if arch == "qwen3moe":
            assert f"blk.{i}.attn_q_norm.weight" in g.tensors and f"blk.{i}.attn_k_norm.weight" in g.tensors
        else:  # GLM-4.5-Air: q/k/v biases, the selection bias, half of each head rotated
            assert all(f"blk.{i}.attn_{x}.bias" in g.tensors for x in "qkv")
            assert (f"blk.{i}.exp_probs_b.bias" in g.tensors) == (i >= dense)
    if arch == "glm4moe":
        assert g.get("glm4moe.rope.dimension_count") == SHAPE["head_dim"] // 2
        assert g.get("glm4moe.expert_gating_func") == 2  # sigmoid


def test_a_wider_v_is_kept_apart_from_q_and_k(kquant_file):
    """The mix's Q6_K attn_v beside Q4_K q and k would pack all three to Q8 of 16-value blocks
    (1.5x the file's bytes, read every token): those layers keep v apart in Q6 lanes, q and k one
    Q4 stack; a Q4_K v stays in the one stack."""
    g, model = GGUFFile(kquant_file), Model(kquant_file)
    for i, a in enumerate(model.decoder.attn):
        wide = g.tensors[f"blk.{i}.attn_v.weight"].gtype == GGMLType.Q6_K
        assert a.wqkv.kind == KIND_Q4
        if wide:
            assert a.wv.kind == KIND_Q6 and a.wv.n_rows == SHAPE["n_kv_heads"] * SHAPE["head_dim"]
        else:
            assert a.wv.n_rows == 0
        file_bytes = sum(g.tensors[f"blk.{i}.attn_{x}.weight"].nbytes for x in "qkv")
        assert weight_nbytes(a.wqkv) + weight_nbytes(a.wv) <= 1.1 * file_bytes


def _values(g: GGUFFile, name: str, expert: int = 0) -> np.ndarray:
    info = g.tensors[name]
    raw = g.raw(name)
    rows = info.shape[1]
    out = np.empty((rows, info.shape[0]), np.float32)
    for r in range(rows):
        dequantize_row(raw[expert * rows + r], int(info.gtype), out[r])
    return out


def test_random_k_blocks_are_centred_with_the_q4_0_files_spread(kquant_file, tmp_path):
    """Drawn in their byte layout, the Q4_K and Q6_K experts decode to values centred on zero with
    the spread of the Q4_0 file's (so both files' routing behaves alike)."""
    g = GGUFFile(kquant_file)
    q4_0 = GGUFFile(make_synthetic_moe.write_synthetic_moe(
        tmp_path / "q4_0.gguf", n_layers=1, n_experts=2, n_used=1, n_embd=256, n_ff=256, n_vocab=300))
    spread = _values(q4_0, "blk.0.ffn_gate_exps.weight").std()
    for name in ("blk.1.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight"):  # Q4_K, Q6_K
        v = _values(g, name)
        assert abs(v.mean()) < 0.05 * v.std(), name
        assert 0.75 < v.std() / spread < 1.33, (name, v.std(), spread)


def test_colibri_and_llama_cpp_compute_the_same_logits(kquant_file):
    """The whole prompt's logits, colibri against llama.cpp (F32 KV cache) on the same file: the
    in-place Q4_K/Q6_K experts, q/k norms or biases, NEOX RoPE (whole or partial), top-k
    renormalisation, the selection bias and the shared expert as the peer has them. (On the glm4moe
    file, routing without the selection bias moves the logits by 0.15 of their spread, dropping the
    shared expert by 0.25: each fails.)"""
    llm = llama_model(kquant_file)
    llm.eval(PROMPT)
    ref = np.array(llm.scores[: len(PROMPT)])
    m = Model(kquant_file)
    n = len(PROMPT)
    ours = m.forward(np.array(PROMPT), np.zeros(n, np.int64), np.arange(n), m.new_kv_cache(1, 64),
                     np.arange(n), 0)
    for pos in range(n):
        diff = float(np.max(np.abs(ours[pos] - ref[pos])))
        assert diff < 0.1 * ref[pos].std(), (pos, diff, ref[pos].std())
        assert int(np.argmax(ours[pos])) == int(np.argmax(ref[pos])) or np.ptp(np.sort(ref[pos])[-2:]) < 0.01


def test_the_same_tokens_whatever_the_expert_budget(kquant_file):
    def tokens(budget: int | None) -> list[int]:
        m = Model(kquant_file, ram_budget=budget)
        seq = SingleSequence(m, 64, 16)
        sampler, out = Sampler(SamplingParams(temperature=1.0, seed=3)), []
        logits = seq.prefill(PROMPT)[-1]
        for _ in range(12):
            out.append(sampler(logits, out))
            logits = seq.step(np.array([out[-1]]), False)[-1]
        return out

    assert tokens(None) == tokens(0) == tokens(1 << 20)


def test_resident_k_quant_experts_are_stacked_and_give_the_per_expert_bits(kquant_file):
    """A model that fits keeps each layer's Q4_K/Q6_K experts packed into Q4 and Q6 lanes
    (``experts.STORE_LANES``) as one stack per matrix (``ExpertStore.resident_layer``), its FFN one
    compiled call; a row's output is the same bits as through experts read one by one and packed
    on every use (budget 0), decode and prompt rows mixed in a step."""
    whole = Model(kquant_file)
    store = whole.decoder.experts
    store.pin_hottest(None)
    alone = Model(kquant_file, ram_budget=0)
    h = np.random.default_rng(5).standard_normal((7, whole.decoder.hp.n_embd)).astype(np.float32)
    for layer in store.layers:
        resident = store.resident_layer(layer)
        assert resident is not None
        assert resident.pool.gate_up.kind == KIND_Q4 and resident.pool.down.kind in (KIND_Q4, KIND_Q6)
        assert np.shares_memory(store.get(layer, 1).down.q, resident.pool.down.q)
        assert np.array_equal(whole.decoder.moe[layer](h, 3), alone.decoder.moe[layer](h, 3))
