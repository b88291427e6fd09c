"""colibri: a Python inference engine for large language models, Mixture-of-Experts first."""

import hashlib
import os
from pathlib import Path

__version__ = "0.1.0"

# BLAS runs inside numba's parallel regions, one tile per thread: its own thread pool would
# fight numba's spinning OpenMP threads for the cores (colibri/model/kernels/__init__.py).
# Set before numpy or scipy first load OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# OpenMP's threads spin ~300k rounds after each parallel region before they sleep. With the cores
# to ourselves that spin is free; with any other busy process (a test suite, a second engine) the
# spinning threads steal the cores the work needs: a loaded 2-core machine ran 15x slower. A short
# spin costs nothing measurable when idle (bench/bench_forward.py) and keeps loaded runs sane.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")
# Once more threads have ever started OpenMP regions than there are cores (the engine: the main
# thread loads the model, a trio worker thread runs the steps, each with its own pool), libgomp
# spins only its "throttled" count, 100 rounds (~1 us), and the pool's threads fall asleep between
# the regions of one step: every region then waits on a futex wake-up. One stream through `coli
# engine` ran at half `coli run`'s speed (50 against ~100 tok/s, 2 threads). ACTIVE raises that
# count to 1000 (the spin itself stays GOMP_SPINCOUNT's): 93-118 tok/s (docs/performance.md).
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")


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
