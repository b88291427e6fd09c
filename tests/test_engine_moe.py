"""The real ``coli engine`` on a MoE model: the expert store's tiers through the protocol.

The model is the tiny transformers Mixtral of tests/data/tiny_hf (it has a tokenizer), converted
with ``coli convert``. Shown here: greedy output with ``--ram-budget 0`` equals the output with no
limit, batched too; TIERS, EMAP and HITS describe the store's real tiers and routing; ``.coli_usage``
survives a restart and decides which experts are pinned at the next start.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
from engine_harness import EngineProcess, engine_args

from colibri.convert.writer import convert
from colibri.io.events import Done, ExpertMap, Hits, Perf, Tiers
from colibri.model.loader import Model
from colibri.sched import persist
from colibri.store.experts import PIN_SHARE, TIER_DISK, TIER_RAM

HF_DIR = Path(__file__).parent / "data" / "tiny_hf" / "mixtral"
N_LAYERS, N_EXPERTS = 2, 8
PROMPTS = ["<s>user: hello there</s>\n<s>assistant: ", "<s>user: the cat sat on</s>\n<s>assistant: "]
MAX_TOKENS = 20  # several HITS lines (one every 6 tokens)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "tiny-mixtral-q8_0.gguf"
    convert(HF_DIR, out, "q8_0")
    return out


@pytest.fixture(scope="module")
def expert_nbytes(moe_gguf: Path) -> int:
    return Model(moe_gguf, ram_budget=None).decoder.experts.expert_nbytes


def tiers_of(events: list) -> tuple[Tiers, ExpertMap]:
    tiers = [e for e in events if isinstance(e, Tiers)][-1]
    emap = [e for e in events if isinstance(e, ExpertMap)][-1]
    return tiers, emap


def emap_array(emap: ExpertMap) -> np.ndarray:
    assert (emap.rows, emap.cols) == (N_LAYERS, N_EXPERTS)
    return np.frombuffer(emap.data, np.uint8).reshape(emap.rows, emap.cols)


async def generate_both(nursery, gguf: Path, budget: str, *extra: str, prompts: list[str] = PROMPTS,
                        max_tokens: int = MAX_TOKENS) -> tuple[list[bytes], list]:
    """Both prompts at once (one batched decode), in two slots; their texts and events."""
    engine = await EngineProcess.start(
        nursery, "--model", str(gguf), "--ram-budget", budget, *engine_args(None, *extra, slots=2))
    for i, prompt in enumerate(prompts):
        await engine.submit(i + 1, prompt, slot=i, max_tokens=max_tokens)
    outs = [await engine.result(i + 1) for i in range(len(prompts))]
    assert await engine.close() == 0
    for out in outs:
        assert isinstance(out.final, Done), out.final
    return [o.text for o in outs], [e for o in outs for e in o.events] + engine.unsolicited


async def test_budget_zero_equals_unlimited_and_telemetry_shows_the_tiers(nursery, moe_gguf: Path):
    # one token a step (no drafts): HITS every 6 tokens, each with the routing of its steps
    texts_inf, events_inf = await generate_both(nursery, moe_gguf, "inf", "--speculative", "off")
    texts_zero, events_zero = await generate_both(nursery, moe_gguf, "0", "--speculative", "off")
    assert texts_zero == texts_inf
    assert all(texts_inf)

    tiers, emap = tiers_of(events_zero)
    assert (tiers.ram_experts, tiers.disk_experts, tiers.ram_gb) == (0, N_LAYERS * N_EXPERTS, 0.0)
    assert ((emap_array(emap) >> 6) == TIER_DISK).all()
    done = [e for e in events_zero if isinstance(e, Done)]
    assert all(d.hit_pct == 0.0 for d in done)  # nothing resident: every use is a miss
    perf = [e for e in events_zero if isinstance(e, Perf)]
    assert len(perf) == 2 and all(p.t_edisk > 0 and p.t_emm > 0 for p in perf)  # misses read, experts ran
    assert all(0 < p.t_attn < p.dt and 0 < p.t_head < p.dt for p in perf)  # a MoE layer's attention is timed

    tiers, emap = tiers_of(events_inf)
    grid = emap_array(emap)
    assert tiers.ram_experts == ((grid >> 6) == TIER_RAM).sum() > 0
    assert tiers.ram_experts + tiers.disk_experts == N_LAYERS * N_EXPERTS
    # (ram_gb has two decimals on the wire: a tiny model's kilobytes show as 0.00)
    assert ((grid & 63) > 0).sum() == tiers.ram_experts  # without a limit, every used expert stays
    assert any(d.hit_pct > 50.0 for d in events_inf if isinstance(d, Done))

    # (a HITS right after another stream's, in the same step, has nothing new: all zeros)
    hits = [e for e in events_inf if isinstance(e, Hits) and e.rows and any(e.data)]
    assert len(hits) >= MAX_TOKENS // 6
    for h in hits:
        bits = np.unpackbits(np.frombuffer(h.data, np.uint8), bitorder="little")[: N_LAYERS * N_EXPERTS]
        routed = bits.reshape(N_LAYERS, N_EXPERTS)
        assert routed.any(axis=1).all()  # every MoE layer routed somewhere
        assert not (routed.astype(bool) & ((grid & 63) == 0)).any()  # only experts with heat


async def test_speculative_decoding_on_experts_gives_plain_decodings_tokens(nursery, moe_gguf: Path):
    """Prompt lookup on a MoE, batched, every expert resident or read from the file at each use:
    drafts are verified (a draft's rows route to experts of their own) and the tokens are plain
    decoding's. (How many drafts are made follows the measured cost of the steps: over both
    budgets' 96 tokens a stream, some are.)"""
    copying = [p + " the cat sat on the mat, the cat sat on the mat, the cat sat on" for p in PROMPTS]
    accepted = 0
    for budget in ("inf", "0"):
        plain, _ = await generate_both(nursery, moe_gguf, budget, "--speculative", "off", prompts=copying,
                                       max_tokens=96)
        spec, events = await generate_both(nursery, moe_gguf, budget, "--speculative", "ngram",
                                           prompts=copying, max_tokens=96)
        assert spec == plain, budget
        accepted += sum(p.accepted_tokens for p in events if isinstance(p, Perf))
    assert accepted > 0


async def handshake_emap(nursery, gguf: Path, state: Path, budget_gb: str) -> tuple[Tiers, np.ndarray, list]:
    engine = await EngineProcess.start(
        nursery, "--model", str(gguf), "--ram-budget", budget_gb, *engine_args(state))
    with trio.fail_after(10):
        while not any(isinstance(e, ExpertMap) for e in engine.unsolicited):
            await trio.sleep(0.01)
    tiers, emap = tiers_of(engine.unsolicited)
    out = await engine.run(1, PROMPTS[0], max_tokens=MAX_TOKENS)
    assert isinstance(out.final, Done)
    assert await engine.close() == 0
    return tiers, emap_array(emap), out.events


async def test_usage_survives_restart_and_decides_the_pinning(nursery, tmp_path: Path, moe_gguf: Path,
                                                              expert_nbytes: int):
    budget_experts = 4
    budget_gb = repr(budget_experts * expert_nbytes / (1 << 30))
    pinned = int(budget_experts * expert_nbytes * PIN_SHARE) // expert_nbytes
    model_fp = Model(moe_gguf, ram_budget=0).gguf.fingerprint()

    tiers, grid, _ = await handshake_emap(nursery, moe_gguf, tmp_path, budget_gb)
    assert tiers.ram_experts == 0 and not (grid >> 6).any() and not (grid & 63).any()  # cold start
    heat = persist.load_usage(tmp_path, model_fp, (N_LAYERS, N_EXPERTS))
    assert heat is not None and (heat > 0).any()  # persisted at the turn's end

    tiers, grid, _ = await handshake_emap(nursery, moe_gguf, tmp_path, budget_gb)
    assert tiers.ram_experts == pinned > 0
    hottest = np.argsort(-heat, axis=None, kind="stable")[:pinned]
    pinned_now = np.flatnonzero((grid >> 6).reshape(-1) == TIER_RAM)
    assert sorted(pinned_now.tolist()) == sorted(hottest.tolist())
    assert ((grid & 63) > 0).sum() == (heat > 0).sum()  # the heat came back with the file

    # another heat on disk pins other experts
    flipped = (heat.max() - heat + 1.0).astype(np.float32)
    persist.save_usage(tmp_path, flipped, model_fp)
    tiers, grid, _ = await handshake_emap(nursery, moe_gguf, tmp_path, budget_gb)
    coldest = np.argsort(-flipped, axis=None, kind="stable")[:pinned]
    pinned_now = np.flatnonzero((grid >> 6).reshape(-1) == TIER_RAM)
    assert sorted(pinned_now.tolist()) == sorted(coldest.tolist())
    assert set(pinned_now.tolist()) != set(hottest.tolist())


def test_serve_moe_through_the_openai_sdk(moe_gguf: Path):
    """``coli serve`` in front of the MoE engine: a chat completion with the official SDK, then
    /experts shows the store's map, tiers and hit rate."""
    from serve_harness import ServerProcess

    srv = ServerProcess.start("--model", str(moe_gguf), "--ram-budget", "inf", "--ctx", "256")
    try:
        with srv.client() as client:
            reply = client.chat.completions.create(
                model=srv.model_id, messages=[{"role": "user", "content": "hello there"}],
                max_tokens=12, temperature=0,
            )
            assert reply.choices[0].message.content is not None
            assert reply.usage.completion_tokens > 0
        with srv.http() as http:
            e = http.get("/experts").json()
        assert (e["rows"], e["cols"]) == (N_LAYERS, N_EXPERTS)
        grid = np.frombuffer(bytes.fromhex(e["map"]), np.uint8).reshape(N_LAYERS, N_EXPERTS)
        assert e["tiers"]["ram_experts"] == ((grid >> 6) == TIER_RAM).sum() > 0
        assert e["hit_pct"] is not None and 0.0 <= e["hit_pct"] <= 100.0
    except BaseException:
        srv.kill()
        raise
    assert srv.stop() == 0, srv.log
