"""GLM-4.5's NextN (MTP) layer drafting for speculative decoding, on a tiny glm4moe that carries
one (``nextn_harness.py``): the layer's logits are the reference's (``reference.glm4moe_nextn``),
run over a whole sequence at once and row by row as the engine runs it; in the real engine
(``coli engine --speculative mtp``, and ``auto``, which adds prompt lookup's copies) the tokens are
plain decoding's, greedy and seeded, batched, with every expert resident or read from the file at
each use; drafts are made, reported (PERF's drafted and accepted tokens), and accepted where the
layer predicts well (the "echo" layer on a stream that repeats a token)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from engine_harness import EngineProcess, engine_args
from nextn_harness import nextn_gguf

from colibri.io.events import Done, Perf, Submit
from colibri.io.mux import encode_request
from colibri.model import reference
from colibri.model.loader import Model

TINY = Path(__file__).parent / "data" / "tiny_hf" / "glm4moe"
REF = json.loads((TINY / "reference.json").read_text())
IDS = REF["prompt_ids"] + REF["greedy_ids"]  # 28 tokens; the greedy tail repeats one token
# float32 arithmetic against the reference's float64, a float32 file and cache: measured 1.2e-5
# (logits of std 1.4); the main model's own bound in test_reference.py is 5e-5.
F32_BOUND = 5e-5
PROMPTS = [IDS[:12], [1, 7, 7, 40, 41, 42, 7, 7, 40, 41], [1, 200, 3, 4, 5, 6, 200, 3, 4]]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("nextn")
    kinds = (("random", "f32"), ("random", "q8_0"), ("echo", "q8_0"))
    return {(k, t): nextn_gguf(out, k, t) for k, t in kinds}


def test_the_layers_logits_are_the_references_at_once_and_row_by_row(files):
    path = files["random", "f32"]
    model = Model(path, kv_type="f32", mtp=True)
    want = reference.glm4moe_nextn(reference.Weights(path), IDS)
    n = len(IDS)
    slots, pos = np.zeros(n, np.int64), np.arange(n, dtype=np.int64)
    kv = model.new_kv_cache(1, 64)
    model.forward(np.asarray(IDS), slots, pos, kv, np.arange(n), 0)
    logits, _ = model.draft(np.asarray(IDS[1:]), model.hidden[:-1], slots[1:], pos[:-1], kv,
                            np.arange(n - 1), 0)
    assert np.abs(logits - want).max() < F32_BOUND
    # as the engine runs it: a prompt, then one decode row a step, the layer one row behind
    kv = model.new_kv_cache(2, 64)
    slot1 = np.ones(n, np.int64)
    model.forward(np.asarray(IDS[:10]), slot1[:10], pos[:10], kv, np.arange(0), 0)
    hidden = model.hidden.copy()
    rows = []
    for t in range(10, n):
        model.forward(np.asarray([IDS[t]]), slot1[:1], pos[t : t + 1], kv, np.arange(1), 1)
        if t == 10:  # the prompt's rows but its last, whose next token is only known now
            model.draft(np.asarray(IDS[1:10]), hidden[:9], slot1[:9], pos[:9], kv, np.arange(0), 0)
        got, _ = model.draft(np.asarray([IDS[t]]), hidden[-1:], slot1[:1], pos[t - 1 : t], kv,
                             np.arange(1), 1)
        rows.append(got[0])
        hidden = model.hidden.copy()
    assert np.abs(np.asarray(rows) - want[9:]).max() < F32_BOUND
    assert model.kv_fingerprint(64) == model.fingerprint
    assert Model(path, kv_type="f32").new_kv_cache(1, 8).k.shape[1] == 4  # the layer's K/V, loaded or not


async def _run(nursery, path: Path, mode: str, budget: str = "inf", temperature: float = 0.0,
               tokens: int = 40) -> tuple[list[bytes], list[Perf]]:
    engine = await EngineProcess.start(nursery, "--model", str(path), "--ram-budget", budget,
                                       *engine_args(None, "--speculative", mode, slots=len(PROMPTS)))
    subs = [Submit(i + 1, i, tokens, temperature, 1.0, "", seed=i + 7 if temperature else None,
                   prompt_ids=tuple(p)) for i, p in enumerate(PROMPTS)]
    await engine.send(b"".join(encode_request(s) for s in subs))
    outs = [await engine.result(s.id) for s in subs]
    assert await engine.close() == 0
    for out in outs:
        assert isinstance(out.final, Done), out.final
    return [o.text for o in outs], [e for o in outs for e in o.events if isinstance(e, Perf)]


async def test_mtp_drafts_give_plain_decodings_tokens_batched_at_every_budget(nursery, files):
    path = files["random", "q8_0"]
    drafted = 0
    for budget in ("inf", "0"):
        plain, _ = await _run(nursery, path, "off", budget)
        assert all(plain), plain
        for mode in ("mtp", "auto"):
            spec, perf = await _run(nursery, path, mode, budget)
            assert spec == plain, (budget, mode)
            drafted += sum(p.drafted_tokens for p in perf)
    assert drafted > 0


async def test_seeded_sampling_gives_the_same_tokens_with_mtp_drafts(nursery, files):
    path = files["echo", "q8_0"]
    plain, _ = await _run(nursery, path, "off", temperature=0.8)
    spec, perf = await _run(nursery, path, "mtp", temperature=0.8)
    assert spec == plain
    assert sum(p.drafted_tokens for p in perf) > 0


async def test_the_echo_layers_drafts_are_accepted_on_a_repeating_stream(nursery, files):
    """The echo layer drafts the token the main model just gave: greedy, the tiny model's
    continuation of IDS[:12] repeats one token six times over, and those drafts are accepted."""
    _, perf = await _run(nursery, files["echo", "q8_0"], "mtp")
    accepted = sum(p.accepted_tokens for p in perf)
    assert 0 < accepted <= sum(p.drafted_tokens for p in perf)


def test_coli_info_tells_of_the_layer(files):
    from colibri.model.file_info import describe
    from colibri.store.gguf import GGUFFile

    lines = describe(GGUFFile(files["random", "f32"]))
    features = next(line for line in lines if line.startswith("features"))
    assert "1 NextN (MTP) layer: the first drafts tokens" in features
