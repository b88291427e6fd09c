"""numba kernels. All are ``nogil`` (the scheduler runs them off the event loop) and ``cache``d.

- ``quant_matmul``: ``x @ W.T`` computed on W's packed blocks (``colibri.store.packed``).
- ``ops``: RMSNorm, RoPE, SwiGLU.
- ``attention``: grouped-query attention over a slotted KV cache.
- ``cache_loading``: cached kernels loaded without their linking modules parsed (installed here,
  before any is loaded).
"""

import numba

from colibri.model.kernels import cache_loading  # noqa: F401  (installs itself on import)

# OpenMP first: its threads start a parallel region in ~4 us (numba's workqueue takes ~80 us,
# too slow for a decode step of hundreds of regions). They spin between regions, so BLAS must
# not bring threads of its own: colibri/__init__ pins OpenBLAS to one thread and the tiled
# matmul splits its tiles across numba's threads instead.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

# Start the threading layer now, before any cached kernel is loaded. numba starts it when it
# compiles or loads a ``parallel=True`` function, but not when it loads from the cache a plain
# function with parallel code linked into it (``network.layers.dense_layer`` calling ``qmatmul``, which
# calls ``_direct``) whose callees were themselves loaded from the cache when it was compiled: that
# function then calls into a threading layer that was never started, and segfaults (numba issues
# #4807, #8578). Which cache entries are like that depends on the order in which earlier processes
# compiled what, so any process could hit it; starting the layer up front rules it out.
numba.get_num_threads()
