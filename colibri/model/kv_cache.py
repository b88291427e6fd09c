"""The KV cache: keys and values for every slot, layer and position, in one pair of arrays.

One allocation for all slots lets a forward step mix rows of different slots (batched decode,
chunked prefill next to decode) and lets a slot be persisted as one contiguous region.
"""

from __future__ import annotations

import mmap

import numpy as np

from colibri.model.hparams import HParams
from colibri.settings import KV_TYPE


def lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros whose pages the kernel maps on first write, 4 KiB at a time.

    ``np.zeros`` is as lazy, but numpy asks for transparent huge pages on large arrays: then the
    first token of a slot faults in a 2 MiB page per layer for K and for V (120 MB for the default
    model's 30 layers, measured), and 16 short conversations cost gigabytes. An anonymous mapping
    with MADV_NOHUGEPAGE costs what is written."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)


# The cache's element types (``--kv-type``). Halves by default (llama.cpp's default cache type):
# half float32's bytes, which bound decode attention at long contexts. numba has no float16 on the
# CPU, so the kernels see a cache of halves as their bits in uint16 (``colibri.store.halves``);
# persistence sees float16 (``KVCache.slot``). float32 keeps every key and value as computed: the
# forward pass compared with references that keep float32 caches (transformers, llama.cpp's F32).
KV_TYPES = {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
_STORED = {"f16": np.dtype(np.uint16), "f32": np.dtype(np.float32)}
DEFAULT_KV_TYPE = KV_TYPE.default  # the one default, with its reason: colibri.settings


def kv_type_name(kv_type: str) -> str:
    """``kv_type`` checked: one of KV_TYPES, else ValueError."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"KV cache type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    return kv_type


class KVBoundsError(ValueError):
    """Rows that would be written outside the cache: a caller's bug, caught before any kernel runs."""


class KVCache:
    def __init__(self, hp: HParams, n_slots: int, n_ctx: int, kv_type: str = DEFAULT_KV_TYPE,
                 n_layers: int = 0) -> None:
        """``n_layers``: the layers with K/V where they are not ``hp.n_layers`` (a NextN layer's).
        Multi-head latent attention (``hp.kv_lora_rank``) keeps keys only: a token's key is its
        latent and rope key, its value the latent, the key's first ``kv_lora_rank`` values (V is
        empty, 0 values wide)."""
        shape = (n_slots, n_layers or hp.n_layers, n_ctx, hp.n_kv_heads, hp.head_dim)
        self.n_slots, self.n_ctx = n_slots, n_ctx
        self.dtype = KV_TYPES[kv_type_name(kv_type)]
        # Pages are mapped as they are written: an idle slot costs no RAM, a used one what it holds.
        self.k = lazy_zeros(shape, _STORED[kv_type])
        self.v = lazy_zeros(shape[:-1] + (0 if hp.kv_lora_rank else hp.head_dim,), _STORED[kv_type])

    @property
    def bytes_per_token(self) -> int:
        """What a position of one slot holds, every layer's key and value."""
        per = self.k.shape[1] * self.k.shape[3] * (self.k.shape[4] + self.v.shape[4])
        return per * self.dtype.itemsize

    def slot(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """One slot's K and V as arrays of the cache's type ([n_layers, n_ctx, n_kv_heads,
        head_dim]): what persistence writes and fills."""
        return self.k[index].view(self.dtype), self.v[index].view(self.dtype)

    def check_rows(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """KVBoundsError unless every row's slot and position lie inside the cache. The callers that
        feed rows (the engine's step, the Channel's extend and probe) call it before the forward
        pass, so that a bad row is refused with its slot and position named; ``store_kv`` checks
        the rows again as the last line (an IndexError with no such detail)."""
        slots, positions = np.asarray(slots).reshape(-1), np.asarray(positions).reshape(-1)
        if slots.shape != positions.shape:
            raise KVBoundsError(f"{slots.size} slots for {positions.size} positions")
        bad = (slots < 0) | (slots >= self.n_slots) | (positions < 0) | (positions >= self.n_ctx)
        if bad.any():
            i = int(np.argmax(bad))
            raise KVBoundsError(f"row {i}: slot {int(slots[i])}, position {int(positions[i])} is outside the "
                                f"KV cache of {self.n_slots} slots x {self.n_ctx} positions")
