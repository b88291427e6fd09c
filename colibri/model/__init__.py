"""The model layer: what the engine may use of a model (``interface``), loading (``loader``), the
text side without weights (``text``), tokenizer, chat template, sampling, the single-sequence
loop (``generate``); the network (``network/``) and its numba kernels (``kernels/``) inside."""
