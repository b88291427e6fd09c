"""The KV cache: keys and values for every slot, layer and position, in one pair of arrays.

One allocation for all slots lets a forward step mix rows of different slots (batched decode,
chunked prefill next to decode) and lets a slot be persisted as one contiguous region.
"""

from __future__ import annotations

import numpy as np

from colibri.model.hparams import HParams


class KVCache:
    def __init__(self, hp: HParams, n_slots: int, n_ctx: int) -> None:
        shape = (n_slots, hp.n_layers, n_ctx, hp.n_kv_heads, hp.head_dim)
        self.n_slots, self.n_ctx = n_slots, n_ctx
        # np.zeros maps fresh pages lazily: an idle slot costs no RAM until it is written.
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
