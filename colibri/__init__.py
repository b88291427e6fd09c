"""colibri: a Python inference engine for large language models, Mixture-of-Experts first."""

import os

# BLAS runs inside numba's parallel regions, one tile per thread: its own thread pool would
# fight numba's spinning OpenMP threads for the cores (colibri/model/kernels/__init__.py).
# Set before numpy or scipy first load OpenBLAS.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS_BLAS"):
    os.environ.setdefault(_var, "1")

__version__ = "0.1.0"
