"""colibri keeps a step's freed temporaries in the heap (``colibri._keep_freed_memory``): a block of
a few MB comes from the heap, not from a fresh mapping, unless the user set glibc's thresholds."""

import os
import subprocess
import sys

import pytest

# Allocates a 4 MB block after importing colibri and says where glibc put it.
PROBE = """
import ctypes
import colibri
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
p = libc.malloc(4 << 20)
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= p < hi:
        print("heap" if line.rstrip().endswith("[heap]") else "mapping")
        break
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")


def _where(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_a_step_sized_block_comes_from_the_heap() -> None:
    assert _where() == "heap"


def test_other_malloc_settings_keep_the_heap() -> None:
    assert _where(MALLOC_ARENA_MAX="1") == "heap"


def test_the_users_threshold_wins() -> None:
    assert _where(MALLOC_MMAP_THRESHOLD_=str(128 << 10)) == "mapping"


def test_the_users_tunable_wins() -> None:
    assert _where(GLIBC_TUNABLES=f"glibc.malloc.mmap_threshold={128 << 10}") == "mapping"
