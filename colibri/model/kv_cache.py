"""The KV cache: keys and values for every slot, layer and position, in one pair of arrays.

One allocation for all slots lets a forward step mix rows of different slots (batched decode,
chunked prefill next to decode) and lets a slot be persisted as one contiguous region.
"""

from __future__ import annotations

import mmap

import numpy as np

from colibri.model.hparams import HParams


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros whose pages the kernel maps on first write, 4 KiB at a time.

    ``np.zeros`` is as lazy, but numpy asks for transparent huge pages on large arrays: then the
    first token of a slot faults in a 2 MiB page per layer for K and for V (120 MB for the default
    model's 30 layers, measured), and 16 short conversations cost gigabytes. An anonymous mapping
    with MADV_NOHUGEPAGE costs what is written."""
    nbytes = int(np.prod(shape)) * 4
    buf = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, np.float32, int(np.prod(shape))).reshape(shape)


class KVCache:
    def __init__(self, hp: HParams, n_slots: int, n_ctx: int) -> None:
        shape = (n_slots, hp.n_layers, n_ctx, hp.n_kv_heads, hp.head_dim)
        self.n_slots, self.n_ctx = n_slots, n_ctx
        # Pages are mapped as they are written: an idle slot costs no RAM, a used one what it holds.
        self.k = lazy_zeros(shape)
        self.v = lazy_zeros(shape)
