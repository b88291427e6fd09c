"""colibri: a Python inference engine for large language models, Mixture-of-Experts first."""

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
