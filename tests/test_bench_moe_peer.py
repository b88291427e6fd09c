"""The MoE benchmark against llama.cpp (``bench/bench_moe_peer.py``), its memory cap
(``bench/memcap.py``) and its slow disk (``bench/readcap.py``): the cap really caps (a process over
it is killed, and says so), a throttled process's reads are charged to the throttle, and the
benchmark runs both engines on one small synthetic file, capped and not, printing the table.
Speed is not asserted (the benchmark's figures are in docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_expert_store import make_synthetic_moe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_moe import drop_cache  # noqa: E402
from memcap import MemoryCap  # noqa: E402
from readcap import ReadCap  # noqa: E402

ALLOC = [sys.executable, "-c", "a = bytearray(300 << 20); a[::4096] = b'x' * len(a[::4096])"]


@pytest.fixture(scope="module")
def cap() -> MemoryCap:
    cap = MemoryCap.detect()
    if cap.method is None:
        pytest.skip(f"no way to cap a process's memory on this machine: {cap.why}")
    return cap


def test_a_process_over_the_cap_is_killed_and_one_under_it_is_not(cap: MemoryCap):
    over = cap.run(ALLOC, 150 << 20, timeout=120)
    assert over.returncode != 0 and over.oom_killed
    under = cap.run(ALLOC, 600 << 20, timeout=120)
    assert under.returncode == 0 and not under.oom_killed
    if under.peak_bytes is not None:  # the cgroup's peak saw the 300 MB
        assert 300 << 20 <= under.peak_bytes <= 600 << 20


def _read_bytes(stats: str, device: str) -> int:
    """The ``Read`` bytes of ``device`` in a ``blkio.throttle.io_service_bytes`` file."""
    return sum(int(n) for dev, op, n in (line.split() for line in stats.splitlines() if line.count(" ") == 2)
               if dev == device and op == "Read")


def test_a_throttled_process_reads_through_its_throttle(cap: MemoryCap, tmp_path: Path):
    """What a run under ``--read-mbps`` reads from the disk (its page-cache misses) is charged to its
    throttled group: the throttle sees the file's bytes, read after its cached pages are dropped."""
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * (64 << 12))  # 64 MiB
    reads = ReadCap.detect(data, 200_000_000)
    if reads.method is None or cap.method != "cgroup1":
        pytest.skip(f"no way to throttle reads beside the memory cap here: {reads.describe()} "
                    f"(memory cap: {cap.describe()})")
    subprocess.run(["sync"], check=True)
    drop_cache(data)
    with reads.group() as procs:
        run = cap.run([sys.executable, "-c", f"open({str(data)!r}, 'rb').read()"], None, 120, also_join=procs)
        charged = _read_bytes((procs.parent / "blkio.throttle.io_service_bytes").read_text(), reads.device)
    assert run.returncode == 0, run.stderr
    assert charged >= 60 << 20, charged


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return make_synthetic_moe.write_synthetic_moe(
        tmp_path_factory.mktemp("moe") / "moe.gguf", n_layers=2, n_experts=8, n_used=2, n_embd=256,
        n_ff=256, n_vocab=4096)


def _bench(gguf: Path, tmp_path: Path, *options: str) -> tuple[dict, str]:
    """The benchmark on ``gguf``, one run of 4 tokens, capped at 0.8 GB: its cases, its stdout."""
    out = tmp_path / "table.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_moe_peer.py"), "--gguf", str(gguf),
         "--caps", "0.8:0.001", "--runs", "1", "--tokens", "4", "--json", str(out), *options],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())["cases"], run.stdout


def test_the_benchmark_runs_both_engines_capped_and_not(cap: MemoryCap, tiny_moe: Path, tmp_path: Path):
    cases, stdout = _bench(tiny_moe, tmp_path)
    assert set(cases) == {"cap 0.8 GB (--ram-budget 0.001)", "no cap (--ram-budget inf)"}
    assert set(cases["no cap (--ram-budget inf)"]) == {"colibri", "llama.cpp", "llama.cpp repack"}
    for name, ways in cases.items():
        for way, r in ways.items():
            assert r["tok_s"] > 0 and r["oom"] == 0 and r["rss"] > 0, (name, way, r)
    assert "no cap (--ram-budget inf)" in stdout  # the table is printed


def test_the_read_ahead_ways_run_without_the_peer(cap: MemoryCap, tiny_moe: Path, tmp_path: Path):
    cases, _ = _bench(tiny_moe, tmp_path, "--no-uncapped", "--no-peer", "--readahead-ways")
    ways = cases["cap 0.8 GB (--ram-budget 0.001)"]
    assert set(ways) == {"colibri", "colibri, read-ahead on", "colibri, no read-ahead"}
    assert all(r["tok_s"] > 0 and r["oom"] == 0 for r in ways.values()), ways
