"""The engine's compute thread (colibri/sched/compute.py): one thread for every model call, so
that libgomp manages one pool; and the OpenMP defaults colibri sets for it."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from colibri.sched.compute import ComputeThread


def test_every_call_runs_on_the_one_thread_in_order_and_returns_its_result():
    seen: list[int] = []

    def where(i: int) -> int:
        seen.append(i)
        return threading.get_ident()

    with ComputeThread() as compute:
        first = compute.call(where, 0)

        async def main() -> list[int]:
            return [await compute.run(where, i) for i in range(1, 6)]

        idents = trio.run(main)
        assert {first, *idents} == {compute.ident}
        assert compute.ident != threading.get_ident()
    assert seen == list(range(6))


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    def fail() -> None:
        raise ValueError("bad step")

    with ComputeThread() as compute:
        with pytest.raises(ValueError, match="bad step"):
            compute.call(fail)

        async def main() -> int:
            with pytest.raises(ValueError, match="bad step"):
                await compute.run(fail)
            return await compute.run(lambda: 7)

        assert trio.run(main) == 7


def test_a_cancelled_caller_waits_for_the_call_to_end():
    """As trio.to_thread.run_sync: a step is never abandoned halfway (its KV writes, its sampling)."""
    ended = threading.Event()

    def step() -> str:
        time.sleep(0.3)
        ended.set()
        return "done"

    async def main() -> tuple[bool, float, bool]:
        start = time.perf_counter()
        with trio.move_on_after(0.05) as scope:
            await compute.run(step)
        return scope.cancelled_caught, time.perf_counter() - start, ended.is_set()

    with ComputeThread() as compute:
        cancelled, waited, finished = trio.run(main)
    assert finished and waited >= 0.3
    assert not cancelled  # the result came back; the deadline passed while it ran


def test_exit_joins_the_thread():
    compute = ComputeThread()
    with compute:
        compute.call(lambda: None)
    assert not compute._thread.is_alive()


def test_colibris_openmp_defaults_keep_what_the_environment_sets():
    """``colibri``'s import sets its OpenMP and BLAS defaults only where the environment has none,
    and says which it set (``ENV_SET``: what a benchmark drops to run llama.cpp at its own)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS")}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    code = ("import json, os, colibri; print(json.dumps([colibri.ENV_SET, "
            "[os.environ[k] for k in ('GOMP_SPINCOUNT', 'OMP_WAIT_POLICY', 'OPENBLAS_NUM_THREADS')]]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    env_set, values = json.loads(out.stdout)
    assert env_set == ["OPENBLAS_NUM_THREADS", "GOMP_SPINCOUNT"]
    assert values == ["2000", "PASSIVE", "1"]
