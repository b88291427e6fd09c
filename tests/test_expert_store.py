"""The expert store's tiers on a real (synthetic) MoE file: a budget changes residency, never bits.

The model is ``tools/make_synthetic_moe.py``'s mixtral-style file at a small size: random Q4_0
experts, skewed routing. Greedy generation through the real forward pass must give the same ids
with a budget of 0 (every expert packed from the file at every use), a small one (pinned + recent)
and no limit (everything used stays resident), while the tiers and counters show the difference.
"""

from __future__ import annotations

import gc
import importlib.util
import mmap
import re
from pathlib import Path

import numpy as np
import pytest

from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.model.sampling import Sampler, SamplingParams
from colibri.settings import DEFAULT_PREFILL_CHUNK, MOE_PREFILL_CHUNK, prefill_chunks
from colibri.store.experts import HEAT_BUCKET_MAX, PIN_SHARE, TIER_DISK, TIER_RAM, ExpertStore
from colibri.store.readahead import Mode, ReadAheadPolicy

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_synthetic_moe", ROOT / "tools" / "make_synthetic_moe.py")
make_synthetic_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_synthetic_moe)

N_LAYERS, N_EXPERTS, N_USED = 3, 16, 2
PROMPT = [5, 17, 99, 250, 3, 42, 7, 300]
N_TOKENS = 12


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "synthetic.gguf"
    return make_synthetic_moe.write_synthetic_moe(
        path, n_layers=N_LAYERS, n_experts=N_EXPERTS, n_used=N_USED, n_embd=128, n_ff=128, n_vocab=512,
    )


def greedy(model: Model) -> list[int]:
    seq = SingleSequence(model, 64, 16)
    sampler = Sampler(SamplingParams(temperature=0.0))
    return list(seq.generate(PROMPT, sampler, N_TOKENS, frozenset()))


def open_with_budget(path: Path, budget: int | None) -> Model:
    return Model(path, ram_budget=budget)


def test_budget_changes_residency_never_tokens(moe_path: Path):
    unlimited = open_with_budget(moe_path, None)
    reference = greedy(unlimited)
    assert len(reference) == N_TOKENS
    store = unlimited.decoder.experts
    ram, disk, resident = store.tier_counts()
    assert ram > 0 and ram + disk == N_LAYERS * N_EXPERTS
    assert resident == ram * store.expert_nbytes
    first = store.counters()
    assert first.misses == ram  # each expert packed once, then served resident
    greedy(unlimited)
    again = store.counters()
    assert again.misses == first.misses and again.hits > first.hits

    zero = open_with_budget(moe_path, 0)
    assert greedy(zero) == reference
    z = zero.decoder.experts
    assert z.tier_counts() == (0, N_LAYERS * N_EXPERTS, 0)
    c = z.counters()
    assert c.hits == 0 and c.misses > 0 and c.missed_bytes == c.misses * z.expert_file_bytes

    small_budget = 3 * z.expert_nbytes
    small = open_with_budget(moe_path, small_budget)
    assert greedy(small) == reference
    ram, _, resident = small.decoder.experts.tier_counts()
    assert 0 < ram <= 3 and resident <= small_budget


def test_heat_pins_the_hottest_within_the_budget(moe_path: Path):
    model = open_with_budget(moe_path, None)
    greedy(model)
    heat = model.decoder.experts.heat.copy()
    assert heat.shape == (N_LAYERS, N_EXPERTS)
    # every step routes each MoE layer to between 1 and N_USED * rows experts
    assert (heat.sum(axis=1) > 0).all()

    budget = 8 * model.decoder.experts.expert_nbytes
    fresh = open_with_budget(moe_path, budget)
    store: ExpertStore = fresh.decoder.experts
    pinned = store.pin_hottest(heat)
    assert pinned == int(budget * PIN_SHARE) // store.expert_nbytes
    hottest = np.argsort(-heat, axis=None, kind="stable")[:pinned]
    for flat in hottest.tolist():
        row, e = divmod(flat, N_EXPERTS)
        assert store.tier(store.layers[row], e) == TIER_RAM
    emap = np.frombuffer(store.expert_map(), np.uint8).reshape(N_LAYERS, N_EXPERTS)
    assert ((emap >> 6) == TIER_RAM).sum() == pinned
    assert ((emap >> 6) == TIER_DISK).sum() == N_LAYERS * N_EXPERTS - pinned
    assert (emap & 63).max() <= HEAT_BUCKET_MAX
    assert ((emap & 63) > 0).sum() == (heat > 0).sum()  # every used expert shows some heat

    # a different heat pins different experts
    flipped = heat.max() - heat + 1.0
    store.pin_hottest(flipped)
    coldest = np.argsort(-flipped, axis=None, kind="stable")[:pinned]
    assert {store.tier(store.layers[f // N_EXPERTS], f % N_EXPERTS) for f in coldest.tolist()} == {TIER_RAM}


def mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mapping resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            key = line.split(None, 1)[0]
            if not key.endswith(":"):  # a mapping's header line: "start-end perms offset dev inode path"
                inside = line.rstrip().endswith(str(path))
            elif inside and key == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="module")
def wide_moe_path(tmp_path_factory) -> Path:
    """Experts of many pages each (512 x 512 Q4_0: 36 pages a matrix), so that the pages an expert
    shares with its neighbours do not hide what its copy releases."""
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    return make_synthetic_moe.write_synthetic_moe(
        path, n_layers=1, n_experts=8, n_used=N_USED, n_embd=512, n_ff=512, n_vocab=512,
    )


@pytest.mark.parametrize("fits", ["no_budget", "budget_holds_all"])
def test_a_model_that_fits_is_loaded_whole_at_start_and_costs_its_copy(wide_moe_path: Path, fits: str):
    """Where every expert fits, pinning makes all of them resident (no token waits on a miss), and
    the file pages copied leave this process's RSS: the model costs its copy, not that and the file."""
    budget = None if fits == "no_budget" else open_with_budget(wide_moe_path, 0).decoder.experts.all_nbytes()
    gc.collect()  # other models of this file (their mappings count in smaps too) are gone
    model = open_with_budget(wide_moe_path, budget)
    store = model.decoder.experts
    n = len(store.layers) * store.n_experts
    assert store.pin_hottest(None) == n
    assert store.tier_counts() == (n, 0, store.all_nbytes())
    assert mapped_rss(wide_moe_path) < n * store.expert_file_bytes / 4
    first = store.counters()
    assert greedy(model) == greedy(open_with_budget(wide_moe_path, 0))
    assert store.counters().misses == first.misses  # every use a hit


def test_a_budget_short_of_the_model_pins_only_what_has_heat(moe_path: Path):
    store = open_with_budget(moe_path, open_with_budget(moe_path, 0).decoder.experts.all_nbytes() - 1
                             ).decoder.experts
    assert store.pin_hottest(None) == 0


def test_a_moe_model_prefills_in_larger_steps_with_the_same_bits(moe_path: Path):
    """A MoE step reads every expert it routes to once: a budget short of the experts streams
    them, and every prompt step grows to MOE_PREFILL_CHUNK; resident, only a prompt alone (no
    stream decoding beside it) takes it; a given --prefill-chunk wins. The steps' size changes the
    speed, never the logits."""
    all_bytes = open_with_budget(moe_path, 0).decoder.experts.all_nbytes()
    fits, short = open_with_budget(moe_path, all_bytes), open_with_budget(moe_path, all_bytes - 1)
    assert not fits.streams_experts and not open_with_budget(moe_path, None).streams_experts
    assert short.streams_experts and open_with_budget(moe_path, 0).streams_experts
    assert prefill_chunks(None, True, fits.streams_experts) == (DEFAULT_PREFILL_CHUNK, MOE_PREFILL_CHUNK)
    assert prefill_chunks(None, True, short.streams_experts) == (MOE_PREFILL_CHUNK, MOE_PREFILL_CHUNK)
    assert prefill_chunks(None, False, False) == (DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK)
    assert MOE_PREFILL_CHUNK > DEFAULT_PREFILL_CHUNK
    assert prefill_chunks(64, True, short.streams_experts) == (64, 64)
    prompt = np.random.default_rng(3).integers(0, 512, MOE_PREFILL_CHUNK + 40).tolist()
    logits = [SingleSequence(short, len(prompt), chunk).prefill(prompt, all_logits=True)
              for chunk in (DEFAULT_PREFILL_CHUNK, MOE_PREFILL_CHUNK)]
    np.testing.assert_array_equal(*logits)


def test_hits_bitmap_reports_routed_experts_once(moe_path: Path):
    model = open_with_budget(moe_path, 0)
    store = model.decoder.experts
    greedy(model)
    bits = np.unpackbits(np.frombuffer(store.take_hits(), np.uint8), bitorder="little")
    routed = bits[: N_LAYERS * N_EXPERTS].reshape(N_LAYERS, N_EXPERTS).astype(bool)
    assert (routed == (store.heat > 0)).all()
    assert not np.unpackbits(np.frombuffer(store.take_hits(), np.uint8)).any()  # consumed


def test_prefetch_skips_resident_and_reads_ahead(moe_path: Path):
    model = open_with_budget(moe_path, None)
    store = model.decoder.experts
    store.prefetch(store.layers[0], np.arange(N_EXPERTS))  # nothing resident yet: only advice
    assert store.tier_counts()[0] == 0
    greedy(model)
    store.prefetch(store.layers[-1], np.arange(N_EXPERTS))
    assert store.counters().misses == store.tier_counts()[0]


def test_a_step_asks_for_all_its_misses_at_once_whatever_the_read_ahead_policy(moe_path: Path, monkeypatch):
    """``queue_reads``: the pages of every expert a step misses are asked of the kernel before the
    first is read (the disk then reads them together), even where the measured policy has turned
    guessing ahead off; never a resident expert's, never for the mmap baseline. The advice itself
    is recorded here (the syscall's effect is the benchmark's to show)."""
    model = open_with_budget(moe_path, 0)
    store = model.decoder.experts
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(store.gguf, "advise_willneed", lambda start, length: asked.append((start, length)))
    store.readahead = ReadAheadPolicy(Mode.OFF)
    layer = store.layers[0]
    spans = {e: [store._slice_span(name, e) for name in store._tensors[layer]] for e in range(N_EXPERTS)}
    store.prefetch(layer, np.array([1, 2]))  # a guess: the policy says no
    assert asked == []
    store.queue_reads(layer, np.array([1, 2]))
    assert asked == spans[1] + spans[2]
    asked.clear()
    greedy(model)  # every MoE layer of every step asks for what it routes to, before reading it
    assert len(asked) == 3 * store.counters().misses
    store.mapped_reads = True
    asked.clear()
    store.queue_reads(layer, np.array([1, 2]))
    assert asked == []
    fits = open_with_budget(moe_path, None).decoder.experts
    fits.pin_hottest(None)
    monkeypatch.setattr(fits.gguf, "advise_willneed", lambda start, length: asked.append((start, length)))
    fits.queue_reads(layer, np.arange(N_EXPERTS))
    assert asked == []


@pytest.mark.parametrize("n_used", [0, N_EXPERTS + 1])
def test_impossible_routing_metadata_is_one_clear_error(tmp_path: Path, n_used: int):
    """The routing kernels index without bounds checks: a top-k the experts cannot satisfy is
    refused at load, as one ``coli: error:`` line, not garbage or a crash."""
    import subprocess
    import sys

    path = make_synthetic_moe.write_synthetic_moe(
        tmp_path / "bad.gguf", n_layers=1, n_experts=N_EXPERTS, n_used=n_used, n_embd=64, n_ff=64,
        n_vocab=128,
    )
    cmd = [sys.executable, "-m", "colibri", "run", "--model", str(path), "--prompt-ids", "1,2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.startswith("coli: error:") and "expert_used_count" in run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


def _backing(a: np.ndarray) -> object:
    """What an array's memory finally belongs to: an anonymous mapping (the arena's) or None (NumPy's
    own allocation)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base.obj if isinstance(a.base, memoryview) else a.base


def test_a_model_that_fits_is_pinned_in_huge_page_memory_and_a_short_budget_is_not(moe_path: Path):
    """Pinned for good, every expert of a model that fits goes to memory advised for huge pages
    (the dense weights' arena); a budget short of the model pins into NumPy's own allocations
    (whose VmFlags may say ``hg`` too where NumPy advised a big neighbour: not asserted)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip(f"this kernel gives no transparent huge pages ({thp}: "
                    f"{thp.read_text().strip() if thp.exists() else 'absent'})")
    whole = open_with_budget(moe_path, None).decoder.experts
    whole.pin_hottest(None)
    q = whole.get(whole.layers[0], 0).gate_up.q
    assert isinstance(_backing(q), mmap.mmap)
    assert "hg" in _vm_flags(q.ctypes.data)
    short = open_with_budget(moe_path, whole.all_nbytes() - 1).decoder.experts
    heat = np.zeros_like(short.heat)
    heat[0, 0] = 1.0
    assert short.pin_hottest(heat) == 1
    assert not isinstance(_backing(short.get(short.layers[0], 0).gate_up.q), mmap.mmap)


def test_a_resident_layer_is_one_stack_that_gives_every_expert_s_own_bits(moe_path: Path):
    """Where every expert is resident, a layer's experts are one stacked matrix per weight (the
    forward pass applies a token's top-k in one parallel region); each expert handed out is its
    part of the stack, and a row's output is the same bits as through experts packed one by one
    (budget 0), for decode and prompt rows mixed in a step, and for a decode row alone."""
    whole = open_with_budget(moe_path, None).decoder
    store = whole.experts
    store.pin_hottest(None)
    layer = store.layers[0]
    resident = store.resident_layer(layer)
    assert resident is not None
    pool = resident.pool
    assert pool.gate_up.n_rows == N_EXPERTS * store.get(layer, 0).gate_up.n_rows
    for e in (0, 5, N_EXPERTS - 1):
        one = store.get(layer, e)
        assert np.shares_memory(one.gate_up.q, pool.gate_up.q) and np.shares_memory(one.down.q, pool.down.q)
    alone = open_with_budget(moe_path, 0).decoder
    assert alone.experts.resident_layer(layer) is None
    h = np.random.default_rng(3).standard_normal((9, 128)).astype(np.float32)
    hits, heat = store.counters().hits, resident.heat.copy()
    stacked = whole.moe[layer](h, 4)
    assert store.counters().hits > hits  # the stack's uses count as hits, and heat the layer's row
    assert (resident.heat > heat).any() and np.array_equal(np.nonzero(resident.heat > heat)[0],
                                                             np.nonzero(resident.hits)[0])
    assert np.array_equal(stacked, alone.moe[layer](h, 4))
    assert np.array_equal(whole.moe[layer](h[:1], 1)[0], stacked[0])


def test_mapped_reads_are_never_stacked_and_give_the_same_tokens(moe_path: Path):
    """The mmap baseline's copies come from the mapping, outside the stacking allocator: a model
    read that way is pinned expert by expert, never as a stack."""
    mapped = open_with_budget(moe_path, None)
    store = mapped.decoder.experts
    store.mapped_reads = True
    store.pin_hottest(None)
    assert store.resident_layer(store.layers[0]) is None
    assert greedy(mapped) == greedy(open_with_budget(moe_path, 0))
