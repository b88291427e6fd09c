"""The MoE architectures against transformers: tiny random checkpoints (tests/data/tiny_hf, made by
tools/make_tiny_moe.py) converted with ``coli convert`` and run by our forward pass.

- f32: every logit within 1e-3 of the reference transformers computed, the greedy continuation
  exactly, through the Model API and through ``coli logits`` / ``coli run`` as a user runs them.
- q8_0 and q4_0: top-1 agreement with the reference over the positions of prompt + continuation.
- Batched routing: a decode row gives bitwise the same logits alone or in a step with other rows
  (decode rows of other slots, and a prompt chunk).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri.convert.writer import convert
from colibri.model.generate import SingleSequence
from colibri.model.kv_cache import KVCache
from colibri.model.loader import Model
from colibri.model.network.routing import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    Routing,
    by_expert,
    route,
)
from colibri.store.packed import KIND_Q5, KIND_Q8

DATA = Path(__file__).parent / "data" / "tiny_hf"
MOE_ARCHS = ["mixtral", "qwen2moe", "qwen3moe", "glm4moe", "olmoe", "olmoe_wide",
             "deepseek2", "deepseek2_routed", "deepseek3", "deepseek3_yarn", "gpt_oss", "gpt_oss_gqa"]
ARCHS = ["llama", *MOE_ARCHS]  # the dense llama checkpoint checks the shared code against transformers
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe",
             "glm4moe": "glm4moe", "olmoe": "olmoe", "olmoe_wide": "olmoe", "deepseek2": "deepseek2",
             "deepseek3": "deepseek2",
             "deepseek3_yarn": "deepseek2", "deepseek2_routed": "deepseek2", "gpt_oss": "gpt-oss",
             "gpt_oss_gqa": "gpt-oss"}
MAX_ABS_DIFF = 1e-3
# Top-1 agreement with transformers over the 28 positions: q4_k_m's experts round their activations
# to one 8-bit level (``int8_matmul.EXPERT_LEVELS``), as llama.cpp's do, and llama.cpp on the same
# files agrees 0.89 (qwen2moe) to 0.96 (measured), so its floor is lower.
MIN_TOP1_AGREEMENT = {"q8_0": 0.90, "q4_0": 0.90, "q4_k_m": 0.85, "mxfp4_moe": 0.90}
# The quantizations each checkpoint is held to. deepseek3_yarn is there for YaRN's arithmetic (f32
# above, q8_0 and q4_0 here); its q4_k_m file, whose rows of 32 and 64 fall back to Q5_0, keeps
# 0.61 of transformers' choices in llama.cpp (0.75 here): the file's rounding, not the kernels'.
# gpt_oss's experts lie on MXFP4's grid (its own format, exact there), which Q4_0's and Q5_0's (the
# tiny rows' K-quant fallback) do not hold: 0.71 of its choices kept in q4_k_m; mxfp4_moe
# (llama.cpp's MXFP4_MOE: experts MXFP4, the rest Q8_0) is gpt-oss's alone.
GPT_OSS = ("gpt_oss", "gpt_oss_gqa")
# deepseek2_routed's q4_k_m file (rows of 32 and 64 fall back to Q5_0 and Q5_1) keeps 0.79 here, and
# llama.cpp cannot load the layout to compare (its deepseek2 requires shared experts).
NOT_HELD = {("deepseek3_yarn", "q4_k_m"), ("deepseek2_routed", "q4_k_m"),
            *((a, t) for a in GPT_OSS for t in ("q4_0", "q4_k_m"))}
QUANTIZED = [(a, t) for a in MOE_ARCHS for t in MIN_TOP1_AGREEMENT
             if (a, t) not in NOT_HELD and (t != "mxfp4_moe" or a in GPT_OSS)]
# The command line and the batched routing on every layout but deepseek3_yarn (deepseek3's with
# another RoPE), deepseek2_routed (no shared expert), gpt_oss_gqa and olmoe_wide (their families'
# with other sizes), which the Model API's tests above cover: they would repeat the others' engine
# paths.
LAYOUTS = [a for a in MOE_ARCHS
           if a not in ("deepseek3_yarn", "deepseek2_routed", "gpt_oss_gqa", "olmoe_wide")]

needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="tests/data/tiny_hf is missing")


class Reference:
    def __init__(self, arch: str) -> None:
        ref = np.load(DATA / arch / "reference.npz")
        self.prompt = [int(i) for i in ref["prompt_ids"]]
        self.logits = ref["logits"]  # (len(prompt), vocab): every prompt position
        self.greedy = [int(i) for i in ref["greedy_ids"]]
        self.full_logits = ref["full_logits"]  # (len(prompt + greedy), vocab): one pass over both

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.greedy


@pytest.fixture(scope="module")
def gguf_of(tmp_path_factory):
    """``gguf_of(arch, type)``: the checkpoint converted to GGUF (once per module)."""
    out_dir = tmp_path_factory.mktemp("tiny_gguf")
    done: dict[tuple[str, str], Path] = {}

    def get(arch: str, type_name: str) -> Path:
        key = (arch, type_name)
        if key not in done:
            out = out_dir / f"{arch}-{type_name}.gguf"
            convert(DATA / arch, out, type_name)
            done[key] = out
        return done[key]

    return get


@pytest.fixture(scope="module")
def model_of(gguf_of):
    models: dict[tuple[str, str], Model] = {}

    def get(arch: str, type_name: str) -> Model:
        key = (arch, type_name)
        if key not in models:
            # transformers keeps keys and values in float32: the f32 files' comparisons at float
            # rounding run with a float32 cache (the halves alone move these logits by ~1e-2)
            kv_type = "f32" if type_name == "f32" else "f16"
            models[key] = Model(gguf_of(arch, type_name), kv_type=kv_type)
        return models[key]

    return get


def coli(*args: str) -> str:
    cmd = [sys.executable, "-m", "colibri", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def ids_arg(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def greedy(model: Model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens: a prompt prefill, then one decode step per token (as ``coli run``)."""
    seq = SingleSequence(model, 256, 512)
    logits = seq.prefill(prompt)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = seq.step(np.array([out[-1]]), False)[-1]
    return out


# -- f32: the numbers ------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_and_experts(arch, model_of):
    model = model_of(arch, "f32")
    assert model.hp.arch == GGUF_ARCH[arch]
    if arch in MOE_ARCHS:
        config = json.loads((DATA / arch / "config.json").read_text())
        assert model.hp.n_expert_used == config["num_experts_per_tok"]
        store = model.decoder.experts
        assert store.n_experts == model.hp.n_expert > 0 and store.n_used == model.hp.n_expert_used
        assert store.layers  # glm4moe's first layer is dense, the others have experts
        w = store.get(store.layers[0], store.n_experts - 1)
        assert w.gate_up.n_rows == 2 * (model.hp.n_ff_exp or model.hp.n_ff)
        assert w.down.n_rows == model.hp.n_embd


@needs_data
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(arch, model_of):
    """Every logit of one pass over prompt + continuation, in prompt chunks of 5 (so that later
    chunks attend to cached keys), within MAX_ABS_DIFF of transformers'."""
    ref = Reference(arch)
    ours = SingleSequence(model_of(arch, "f32"), 256, 5).prefill(ref.sequence, all_logits=True)
    assert ours.shape == ref.full_logits.shape
    diff = float(np.abs(ours - ref.full_logits).max())
    assert diff <= MAX_ABS_DIFF, f"{arch}: max abs logit difference {diff:.2e}"


@needs_data
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_greedy_matches_transformers(arch, model_of):
    ref = Reference(arch)
    assert greedy(model_of(arch, "f32"), ref.prompt, len(ref.greedy)) == ref.greedy


# -- f32 through the command line ------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize("arch", LAYOUTS)
def test_cli_logits_and_run(arch, gguf_of):
    """``coli logits --prompt-ids --top 0`` prints every logit of every prompt position (rounded
    to 5 decimals) and ``coli run --prompt-ids --output ids`` the greedy continuation."""
    ref = Reference(arch)
    path = str(gguf_of(arch, "f32"))
    lines = coli("logits", "--model", path, "--kv-type", "f32", "--prompt-ids", ids_arg(ref.prompt),
                 "--top", "0").splitlines()
    assert len(lines) == len(ref.prompt)
    for pos, line in enumerate(lines):
        entry = json.loads(line)
        assert entry["pos"] == pos
        row = np.full(ref.logits.shape[1], np.nan, np.float32)
        for token, value in entry["top"]:
            row[token] = value
        diff = float(np.abs(row - ref.logits[pos]).max())
        assert diff <= MAX_ABS_DIFF, f"{arch}: position {pos}: max abs logit difference {diff:.2e}"
    out = coli("run", "--model", path, "--kv-type", "f32", "--prompt-ids", ids_arg(ref.prompt),
               "--output", "ids", "--max-tokens", str(len(ref.greedy)))
    assert [int(i) for i in out.strip().split(",")] == ref.greedy


# -- quantized -------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(("arch", "type_name"), QUANTIZED)
def test_quantized_top1_agreement(arch, type_name, model_of):
    """Quantizations against transformers. The mixture's rows of 64 are not whole 256-blocks, so its
    K-quants fall back as llama.cpp's do (Q4_K to Q5_0, Q6_K to Q8_0): experts the store packs into
    Q5 and Q8 lanes (``experts.STORE_LANES``). (q5_k_m's file agrees 0.89 on mixtral, computed on
    the lanes or on the blocks alike: its quantization's, not the kernels'.)"""
    assert_experts_in_lanes(model_of(arch, type_name), type_name)
    ref = Reference(arch)
    ours = SingleSequence(model_of(arch, type_name), 256, 512).prefill(ref.sequence, all_logits=True)
    agreement = float(np.mean(ours.argmax(-1) == ref.full_logits.argmax(-1)))
    assert agreement >= MIN_TOP1_AGREEMENT[type_name], f"{arch} {type_name}: top-1 agreement {agreement:.2f}"


# -- batched routing is batch-invariant ------------------------------------------------------------


def assert_experts_in_lanes(model: Model, type_name: str) -> None:
    """A mixture's experts (Q5_0, Q5_1 where rows of 64 take no K-quant; Q8_0) and MXFP4 ones are
    packed lanes."""
    if type_name.endswith("_k_m") or type_name == "mxfp4_moe":
        store = model.decoder.experts
        store.pin_hottest(None)
        pool = store.resident_layer(store.layers[0]).pool
        assert pool.gate_up.kind == KIND_Q5 and pool.down.kind in (KIND_Q5, KIND_Q8)


def prefilled(model: Model, prompts: list[list[int]]) -> KVCache:
    """A cache with prompt s prefilled in slot s, each alone."""
    kv = KVCache(model.hp, len(prompts), 64)
    for s, p in enumerate(prompts):
        n = len(p)
        model.forward(np.array(p, np.int64), np.full(n, s), np.arange(n), kv, np.array([n - 1]), 0)
    return kv


@needs_data
@pytest.mark.parametrize(("arch", "type_name"), [(a, t) for a in LAYOUTS for t in ("q8_0", "q4_0", "q5_k_m")]
                         + [("gpt_oss", "mxfp4_moe")])
def test_decode_rows_bitwise_equal_alone_or_batched(arch, type_name, model_of):
    """Five sequences decode one token each: in one step, in a step with another slot's prompt
    chunk, and each alone. Every row's logits are the same bits in all three (the experts each row
    routes to are applied to sub-batches whose make-up depends on the other rows)."""
    model = model_of(arch, type_name)
    assert_experts_in_lanes(model, type_name)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, model.hp.n_vocab, n)] for n in (5, 9, 3, 12, 7)]
    tokens = rng.integers(3, model.hp.n_vocab, len(prompts)).astype(np.int64)
    n = len(prompts)
    positions = np.array([len(p) for p in prompts])

    kv = prefilled(model, prompts)
    alone = np.concatenate([
        model.forward(tokens[s : s + 1], np.array([s]), positions[s : s + 1], kv, np.array([0]), 1)
        for s in range(n)
    ])
    kv = prefilled(model, prompts)
    batched = model.forward(tokens, np.arange(n), positions, kv, np.arange(n), n)
    assert np.array_equal(batched, alone)

    # The engine's mixed step: the decode rows first, then a prompt chunk of one more slot.
    kv = prefilled(model, [*prompts, [1]])
    chunk = rng.integers(3, model.hp.n_vocab, 6).astype(np.int64)
    mixed = model.forward(
        np.concatenate([tokens, chunk]), np.array([*range(n), *[n] * len(chunk)]),
        np.concatenate([positions, np.arange(1, len(chunk) + 1)]), kv, np.arange(n), n,
    )
    assert np.array_equal(mixed, alone)


# -- routing rules against a plain numpy reference -------------------------------------------------


def reference_route(logits: np.ndarray, bias: np.ndarray, rule: Routing) -> tuple[np.ndarray, np.ndarray]:
    """transformers' routing in float64: softmax or sigmoid scores; selection by score + bias,
    within the best groups (a group's score: the sum of its two best); weights from the scores
    (gpt-oss: the softmax of the k best logits)."""
    if rule.gating == GATING_SOFTMAX_WEIGHT:
        ids = np.argsort(-logits, -1, kind="stable")[:, : rule.k]
        top = np.take_along_axis(logits, ids, -1)
        w = np.exp(top - top[:, :1])
        return ids, w / w.sum(-1, keepdims=True)
    if rule.gating == GATING_SOFTMAX:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    else:
        p = 1.0 / (1.0 + np.exp(-logits))
    select = p + bias if bias.size else p.copy()
    if rule.n_group > 1:
        groups = select.reshape(len(select), rule.n_group, -1)
        group_score = np.sort(groups, -1)[..., -2:].sum(-1)
        kept = np.argsort(-group_score, -1, kind="stable")[:, : rule.topk_group]
        mask = np.zeros(group_score.shape, bool)
        np.put_along_axis(mask, kept, True, -1)
        select = np.where(np.repeat(mask, groups.shape[-1], -1), select, -np.inf)
    ids = np.argsort(-select, -1, kind="stable")[:, : rule.k]
    w = np.take_along_axis(p, ids, -1)
    if rule.norm:
        w = w / w.sum(-1, keepdims=True)
    if rule.scale not in (0.0, 1.0):
        w = w * rule.scale
    return ids, w


@pytest.mark.parametrize("rule", [
    Routing(GATING_SOFTMAX, 2, True, 0.0, 0, 0),  # mixtral, qwen3moe
    Routing(GATING_SOFTMAX, 4, False, 0.0, 0, 0),  # qwen2moe
    Routing(GATING_SIGMOID, 4, True, 2.5, 4, 2),  # glm4moe with groups
    Routing(GATING_SIGMOID, 3, True, 1.0, 1, 1),  # glm4moe without
    Routing(GATING_SOFTMAX_WEIGHT, 4, False, 0.0, 0, 0),  # gpt-oss
], ids=["softmax-norm", "softmax", "sigmoid-grouped", "sigmoid", "softmax-of-chosen"])
def test_route_matches_reference(rule):
    rng = np.random.default_rng(1)
    n_expert, rows = 16, 64
    logits = (rng.standard_normal((rows, n_expert)) * 3).astype(np.float32)
    bias = (rng.standard_normal(n_expert) * 0.1).astype(np.float32) if rule.gating == GATING_SIGMOID \
        else np.zeros(0, np.float32)
    ids = np.empty((rows, rule.k), np.int64)
    weights = np.empty((rows, rule.k), np.float32)
    route(logits, bias, rule, ids, weights)
    ref_ids, ref_w = reference_route(logits.astype(np.float64), bias.astype(np.float64), rule)
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-6)

    experts, starts, rows_of, pair = by_expert(ids, n_expert)
    assert list(experts) == sorted(set(ids.ravel().tolist()))
    assert sorted(pair.ravel().tolist()) == list(range(ids.size))  # every pair once
    for i, e in enumerate(experts):
        span = range(starts[i], starts[i + 1])
        assert list(rows_of[span.start : span.stop]) == sorted(rows_of[span.start : span.stop])
        for t, r in zip(*np.nonzero(ids == e), strict=True):
            assert pair[t, r] in span and rows_of[pair[t, r]] == t
    assert starts[-1] == ids.size
