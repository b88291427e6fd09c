"""A second, wider model than the default one, made so that llama.cpp's K-quant mixtures put real
K-quant blocks in every matrix, routed experts included: a random qwen2moe (hidden 512, 4 heads of
128, 2 KV heads, 8 experts of 256 top-2 beside a gated shared expert of 512, 4 layers, vocab 640;
``convert_harness.make_wide_moe``), every row a whole number of 256-value blocks, so no Q5_0 / Q8_0 /
F16 fallback. ``coli convert --type f32`` writes it once (cached in pytest's cache), llama.cpp's
own quantizer makes each of QUANT_TYPES from that file, and colibri runs each against llama.cpp:
teacher-forced top-1 agreement, decided positions, greedy continuations; llama.cpp on the file's
weights dequantized to F32 (the same logits to float rounding); the expert store under a small RAM
budget (the unbounded store's bits).

The weights (MODEL): matrices N(0, (layer_std / sqrt(fan_in))^2), q/k 1/sqrt(fan_in) (soft
attention), the embedding N(0, 1), the output N(0, output_std^2) for confident logits (std about
11; llama.cpp's top-2 gap >= 0.5 at 80-92% of the positions). colibri rounds the activations to
two 8-bit levels per 32 values (15 bits), llama.cpp to one (Q8_K blocks against the K-quants), which moves
its logits by a few percent of their spread; how much the model amplifies that is the layers' std.
At layer_std 0.5 the layers change the embedding-only model's top-1 at ~45% of the positions and
llama.cpp's rounding moves the top-2 logits by ~0.05 (median); at 1.0 by ~0.2, top-1 agreement
falls to 0.93-0.98 and the rounding flips routers' near-ties, and with them decided positions, in
half the files. On the dequantized weights (llama.cpp's F32 matmuls round nothing) the two agree to ~1e-3.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import inspect
import io
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from convert_harness import WIDE_MOE, make_wide_moe
from quant_harness import (
    DECIDED_GAP,
    QUANT_TYPES,
    Agreement,
    llama_cpp,
    llama_model,
    peer_runs,
    quantized,
    sure_prefix,
)

from colibri.cli import main
from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.model.sampling import Sampler, SamplingParams

MODEL = dict(seed=0, layer_std=0.5, output_std=0.5)
N_PROMPTS, PROMPT_LEN, N_NEW = 6, 24, 20  # random prompt ids; llama.cpp's greedy tokens after each
PROMPT_SEED = 7
MIN_TOP1 = 0.95  # teacher-forced top-1 agreement with llama.cpp on the same file
MIN_DECIDED_SHARE = 0.75  # positions whose llama.cpp top-2 gap is >= DECIDED_GAP: the model is confident
N_CTX = 64
# mean |colibri - llama.cpp on the dequantized weights| (logits' std ~11) over llama.cpp's own on the
# K-quant file: 0.011-0.015 against 0.071-0.080 measured where the experts are on lanes (one level),
# ~2e-4 where they are on blocks (two levels: Q3_K_M, Q2_K)
DEQUANTIZED_SHARE = 0.3
# Each mixture's own type: every ffn_gate_exps / ffn_up_exps is of it; ffn_down_exps of it or of the
# type llama.cpp bumps it to (use_more_bits layers, Q2_K's and Q3_K_M's down projections).
MAIN_TYPE = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K",
             "IQ4_XS": "IQ4_XS"}
BUMPED = {"Q4_K_M": {"Q6_K"}, "Q5_K_M": {"Q6_K"}, "Q3_K_M": {"Q4_K"}, "Q2_K": {"Q3_K"}}
K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def build_f32(cache: Path, scratch: Path) -> Path:
    """The model's ``coli convert --type f32`` file, made once per generator (its source) and
    parameters."""
    key = json.dumps([WIDE_MOE, MODEL, inspect.getsource(make_wide_moe)])
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = cache / f"wide-moe-{tag}-f32.gguf"
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            for stale in cache.glob("wide-moe-*.gguf"):  # an older generator's file and quantizations
                stale.unlink()
            src = make_wide_moe(scratch / "wide-moe", **MODEL)
            part = out.with_suffix(".part")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                assert main(["convert", str(src), "-o", str(part), "--type", "f32"]) == 0
            part.rename(out)
    return out


@pytest.fixture(scope="module")
def f32_file(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    llama_cpp()  # skipped without the peer
    return build_f32(Path(request.config.cache.mkdir("kquants-wide")), tmp_path_factory.mktemp("wide"))


@pytest.fixture(scope="module")
def files(f32_file: Path) -> dict[str, Path]:
    return {t: quantized(f32_file, t, f32_file.parent) for t in QUANT_TYPES}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(0, WIDE_MOE["vocab_size"], PROMPT_LEN).tolist() for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module", params=QUANT_TYPES)
def compared(request: pytest.FixtureRequest, files, prompts):
    """(type, file, colibri's model, llama.cpp's runs, colibri's forced logits per run)."""
    path = files[request.param]
    llm = llama_model(path)
    runs = peer_runs(llm, prompts, N_NEW)
    del llm
    model = Model(path, kv_type="f32")  # llama.cpp here keeps F32 keys and values (quant_harness)
    ours = [SingleSequence(model, N_CTX, 512).prefill(r.prompt + r.continuation, all_logits=True)
            for r in runs]
    return request.param, path, model, runs, ours


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def dequantized_copy(f32: Path, quantized_file: Path, out: Path) -> Path:
    """``f32`` (the file ``quantized_file`` was made from: the same tensors, all F32) with every
    tensor's values replaced by ``quantized_file``'s, dequantized by gguf-py."""
    shutil.copyfile(f32, out)
    source = {t.name: t for t in gguf.GGUFReader(quantized_file).tensors}
    target = gguf.GGUFReader(out, "r+")
    for t in target.tensors:
        s = source[t.name]
        t.data[...] = gguf.quants.dequantize(s.data, s.tensor_type).reshape(t.data.shape)
    target.data.flush()
    return out


@pytest.mark.parametrize("ftype", QUANT_TYPES)
def test_every_matrix_is_a_k_quant(files, ftype: str) -> None:
    """Expert tensors of the mixture's type (or its bumped one); every other matrix a K-quant,
    but attn_k / attn_v, which llama.cpp gives Q8_0 in 8-expert models; routers and vectors F32."""
    types = tensor_types(files[ftype])
    counts = collections.Counter(types.values())
    for name, typ in types.items():
        kind = name.split(".")[-2]
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            assert typ == MAIN_TYPE[ftype], (ftype, name, typ)
        elif kind == "ffn_down_exps":
            assert typ in {MAIN_TYPE[ftype], *BUMPED.get(ftype, ())}, (ftype, name, typ)
        elif kind in ("attn_k", "attn_v") and name.endswith(".weight"):
            assert typ == "Q8_0", (ftype, name, typ)
        elif typ not in K_TYPES:
            assert typ == "F32" and (kind == "ffn_gate_inp" or "norm" in kind or name.endswith(".bias")
                                     or kind == "ffn_gate_inp_shexp"), (ftype, name, typ, counts)
    assert sum(n.endswith("_exps.weight") for n in types) == 3 * WIDE_MOE["num_hidden_layers"]


def test_the_experts_meet_every_k_quant(files) -> None:
    seen = {typ for path in files.values() for name, typ in tensor_types(path).items() if "_exps." in name}
    assert seen == K_TYPES


def test_llama_cpp_is_confident(compared) -> None:
    """Random models have flat logits; this one's output scale makes most positions decided, so
    that the checks below are about something."""
    name, _, _, runs, _ = compared
    gaps = np.concatenate([np.diff(np.sort(r.forced[len(r.prompt) - 1 :], axis=1)[:, -2:], axis=1)[:, 0]
                           for r in runs])
    share = float(np.mean(gaps >= DECIDED_GAP))
    quantiles = np.quantile(gaps, [0.1, 0.25, 0.5, 0.75]).round(2).tolist()
    assert share >= MIN_DECIDED_SHARE, f"{name}: {share:.2f} decided; top-2 gaps at 10/25/50/75%: {quantiles}"


def test_top1_agreement_with_llama_cpp(compared) -> None:
    """Against llama.cpp's forced logits, every decided position agreeing; llama.cpp's own token
    by token logits against the same forced ones are in the message as a yardstick."""
    name, _, _, runs, ours = compared
    agreement, peer_self = Agreement(), Agreement()
    for run, logits in zip(runs, ours, strict=True):
        agreement.add(run.forced, logits, len(run.prompt) - 1)
        peer_self.add(run.forced, run.incremental, len(run.prompt) - 1)
    assert agreement.rate >= MIN_TOP1 and not agreement.decided_misses, (
        f"{name}: colibri {agreement}; llama.cpp token by token vs forced {peer_self}")


def test_greedy_equals_llama_cpp_until_its_first_near_tie(compared) -> None:
    """The decode path (direct matmuls, one token a step) as the engine runs it."""
    name, _, model, runs, _ = compared
    for run in runs:
        n_sure = sure_prefix(run)
        seq = SingleSequence(model, N_CTX, 512)
        ours = list(seq.generate(run.prompt, Sampler(SamplingParams()), max(n_sure, 1), frozenset()))
        assert ours[:n_sure] == run.continuation[:n_sure], (name, n_sure, ours, run.continuation)


def test_the_logits_are_llama_cpps_on_the_dequantized_weights(compared, f32_file, tmp_path) -> None:
    """llama.cpp on an F32 file of the K-quant file's weights dequantized (F32 matmuls: nothing
    rounds the activations) gives colibri's logits on the K-quant file within the activations'
    rounding: colibri computes with the file's weights exactly, and what the agreement above
    measures is how each side rounds the activations. The experts' one 8-bit level per 32 values
    (``int8_matmul.EXPERT_LEVELS``) moves the logits a fifth as much as llama.cpp's own Q8_K (one
    per 256) on the same file, on average; a position where rounding flips a near-tie in the
    router's top-k moves them as much on either side, so the maximum is not compared."""
    name, path, _, runs, ours = compared
    llm = llama_model(dequantized_copy(f32_file, path, tmp_path / "dequantized.gguf"))
    for run, logits in zip(runs, ours, strict=True):
        seq = run.prompt + run.continuation
        llm.reset()
        llm.eval(seq)
        exact = np.array(llm.scores[: len(seq)])
        err, peer_err = float(np.abs(logits - exact).mean()), float(np.abs(run.forced - exact).mean())
        assert err <= DEQUANTIZED_SHARE * peer_err, (name, err, peer_err)


def test_a_small_ram_budget_gives_the_same_bits(compared) -> None:
    """The expert store with room for 3 experts (of 32): experts packed from the file again and
    again, the resident ones evicted; prefill and token-by-token logits bitwise the unbounded's."""
    name, path, model, runs, ours = compared
    budget = 3 * model.decoder.experts.expert_nbytes
    small = Model(path, ram_budget=budget, kv_type="f32")
    for run, logits in zip(runs, ours, strict=True):
        seq = run.prompt + run.continuation
        np.testing.assert_array_equal(SingleSequence(small, N_CTX, 512).prefill(seq, all_logits=True), logits,
                                      err_msg=name)
    seq = runs[0].prompt + runs[0].continuation
    np.testing.assert_array_equal(SingleSequence(small, N_CTX, 1).prefill(seq, all_logits=True),
                                  SingleSequence(model, N_CTX, 1).prefill(seq, all_logits=True), err_msg=name)
    store = small.decoder.experts
    ram, _, resident = store.tier_counts()
    counters = store.counters()
    assert resident <= budget and ram <= 3, (name, ram, resident, budget)
    assert counters.misses > store.shape[0] * store.shape[1], (name, counters)  # packed again after eviction
