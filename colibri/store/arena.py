"""Memory for the weights a model keeps for its whole life, in 2 MiB pages where the kernel has them.

A decode step streams every weight once from RAM. In 4 KiB pages that is a TLB miss every 4 KiB,
~25,000 a token on the default model, and the hardware prefetchers stop at each page's end; in
2 MiB pages (transparent huge pages, given on ``madvise(MADV_HUGEPAGE)`` where the kernel's
``transparent_hugepage/enabled`` is ``madvise`` or ``always``) one in 512 of those. The default
model's decode step, its packed weights moved into such pages, alternating with the same weights
in NumPy's own 4 KiB pages in one process: 6.73 against 7.26 ms (median of 16 pairs, 15 won;
docs/performance.md).

Arrays are carved from CHUNK-sized anonymous mappings, one after the other, each aligned to ALIGN;
an array bigger than a chunk gets a mapping of its own. Nothing is freed alone: a mapping goes when
the last array carved from it does (each array holds its mapping), so an arena suits weights that
live as long as their model (the dense layers, attention, the output head), not the expert store's
recent tier, whose copies come and go. Fresh anonymous memory is zeros: ``empty`` is ``zeros``.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
# A mapping's size: 16 huge pages. The part of the last chunk no array reaches is never touched,
# so it costs address space, not memory (at most one huge page of it, the one the last array ends
# in, is resident).
CHUNK = 32 << 20
# Where each array starts: a cache line, the widest vector load the kernels make.
ALIGN = 64


def _mapping(nbytes: int) -> tuple[np.ndarray, int]:
    """A fresh anonymous mapping of at least ``nbytes`` as a uint8 array, and the offset in it of
    its first huge-page boundary (the kernel backs only aligned 2 MiB ranges with huge pages)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as NumPy's
            pass
    buf = np.frombuffer(mm, np.uint8)
    return buf, (-buf.ctypes.data) % HUGE_PAGE


class Arena:
    """Arrays in huge-page memory, allocated one after the other."""

    def __init__(self) -> None:
        self._chunk = np.zeros(0, np.uint8)
        self._at = 0

    def empty(self, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        """A zeroed C-contiguous array (``np.empty``'s and ``np.zeros``' signature)."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if nbytes > CHUNK:
            buf, start = _mapping(nbytes)
            return buf[start : start + nbytes].view(dt).reshape(shape)
        at = -(-self._at // ALIGN) * ALIGN
        if at + nbytes > self._chunk.size:
            buf, start = _mapping(CHUNK)
            self._chunk, at = buf[start : start + CHUNK], 0
        self._at = at + nbytes
        return self._chunk[at : at + nbytes].view(dt).reshape(shape)

    zeros = empty
