"""The one thread the engine's model computes on: its load, every step, prefill and probe.

numba's parallel kernels run on OpenMP (libgomp), which gives every thread that starts a parallel
region a pool of worker threads of its own. Once it manages more threads than there are cores, its
workers stop spinning between regions after a few rounds and sleep, and each of a step's ~150
regions then waits on a wake-up. trio's worker threads are a cache (any of them may run the next
call) and the model loads before trio starts: run wherever it landed, the model would have two or
more pools on two cores, and one stream runs at half ``coli run``'s speed then
(``docs/performance.md``). On this thread the process has one pool, as ``coli run`` has.

The thread is a resource with a ``with``: started on entry, asked to finish and joined on exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")
_Job = Callable[[], None]


class ComputeThread:
    """Runs callables one at a time, in order, on one long-lived thread."""

    def __init__(self, name: str = "colibri-compute") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # daemon: an interpreter leaving on an unhandled error does not wait for it
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def __enter__(self) -> ComputeThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._jobs.put(None)
        self._thread.join()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, waited for here: from plain code (the model's load, before
        trio runs). Its exception is raised here."""
        done, box = threading.Event(), []

        def job() -> None:
            box.append(outcome.capture(fn, *args))
            done.set()

        self._jobs.put(job)
        done.wait()
        return box[0].unwrap()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, awaited from trio, as ``trio.to_thread.run_sync``: a caller
        cancelled meanwhile still waits for the call to end (a step is never abandoned halfway),
        then sees its result or exception."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token, task = trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()

        def job() -> None:
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the run ended under us: nobody is waiting
                pass

        self._jobs.put(job)
        # the outcome is unwrapped by the wait: its value returned, its exception raised
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
