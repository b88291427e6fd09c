"""colibri: a Python inference engine for large language models, Mixture-of-Experts first."""

import ctypes
import hashlib
import os
from pathlib import Path

__version__ = "0.1.0"

# The process settings colibri sets unless the environment has its own, before numpy, scipy or
# numba first load OpenBLAS and libgomp. ``ENV_SET``: the names this import set, so that a
# benchmark can run a peer (llama.cpp) at its own defaults.
ENV_DEFAULTS = {
    # BLAS runs inside numba's parallel regions, one tile per thread: its own thread pool would
    # fight numba's spinning OpenMP threads for the cores (colibri/model/kernels/__init__.py).
    "OPENBLAS_NUM_THREADS": "1",
    # OpenMP's threads spin ~300k rounds after each parallel region before they sleep. With the
    # cores to ourselves that spin is free; with any other busy process (a test suite, a second
    # engine) the spinning threads steal the cores the work needs: a loaded 2-core machine ran 15x
    # slower. A short spin costs nothing measurable when idle (bench/bench_forward.py).
    "GOMP_SPINCOUNT": "2000",
    # Once more threads have ever started OpenMP regions than there are cores (each has a pool of
    # its own), libgomp spins only its "throttled" count, 100 rounds (~1 us), and the pools'
    # threads fall asleep between the regions of one step, each region then waiting on a futex
    # wake-up: one stream through `coli engine` ran at half `coli run`'s speed (50 against ~100
    # tok/s). ACTIVE raises that count to 1000 (the spin itself stays GOMP_SPINCOUNT's); the
    # engine also runs every step on one thread (colibri/sched/compute.py; docs/performance.md).
    "OMP_WAIT_POLICY": "ACTIVE",
}
ENV_SET = tuple(name for name in ENV_DEFAULTS if name not in os.environ)
for _name, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

# glibc's malloc gives freed memory back: a block above its mmap threshold (128 KB, rising with the
# blocks freed) is unmapped when freed, and the heap's free top is trimmed. A forward step
# allocates and frees the same few-MB temporaries every step (a MoE layer's expert rows: ~15 MB at
# 128 prompt rows), so every step faulted them in again: a 512-token qwen3moe prefill spent ~0.5 s
# of 3.1 there, and decode 8% (docs/performance.md). Below MALLOC_MMAP_THRESHOLD every block comes
# from the heap, which keeps its high-water mark (the peak is the same; what the step frees stays
# the process's, for the next step). The environment's own MALLOC_*_ settings win.
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value
MALLOC_TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
# The variables by which a user sets these two thresholds; glibc's other MALLOC_* settings (a
# checking level, arena counts) are no reason to leave them at glibc's defaults.
_MALLOC_OWN_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TUNABLES = ("mmap_threshold", "trim_threshold")  # the same two as GLIBC_TUNABLES glibc.malloc.*


def _keep_freed_memory() -> None:
    if any(name in os.environ for name in _MALLOC_OWN_SETTINGS):
        return
    if any(f"malloc.{name}" in os.environ.get("GLIBC_TUNABLES", "") for name in _TUNABLES):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: its allocator's own policy
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
        libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)


_keep_freed_memory()


def _numba_cache_dir() -> str:
    """numba checks a cached function against its own file only, not the files of the functions it
    calls: after an edit to a kernel, a caller's stale machine code can crash. So the cache lives in
    a folder named for a hash of the sources the compiled code comes from; an edit starts afresh."""
    digest = hashlib.sha256(__version__.encode())
    here = Path(__file__).parent
    for path in sorted([*here.glob("model/**/*.py"), *here.glob("store/*.py")]):
        digest.update(path.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri"
    return str(base / f"numba-{digest.hexdigest()[:16]}")


os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache_dir())
