"""numba kernels. All are ``nogil`` (the scheduler runs them off the event loop) and ``cache``d.

- ``quant_matmul``: ``x @ W.T`` computed on W's quantized blocks.
- ``ops``: RMSNorm, RoPE, SwiGLU.
- ``attention``: grouped-query attention over a slotted KV cache.
"""

import numba

# OpenMP first: its threads start a parallel region in ~4 us (numba's workqueue takes ~80 us,
# too slow for a decode step of hundreds of regions). They spin between regions, so BLAS must
# not bring threads of its own: colibri/__init__ pins OpenBLAS to one thread and the tiled
# matmul splits its tiles across numba's threads instead.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
