"""What memory costs: a KV slot costs what it holds, a loaded model about its file.

Each figure is measured in a fresh process (``RssAnon`` and ``VmHWM`` from /proc), so that what
other tests allocated does not count.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

MB = 1 << 20
_spec = importlib.util.spec_from_file_location(
    "make_synthetic_moe", Path(__file__).resolve().parent.parent / "tools" / "make_synthetic_moe.py")
make_synthetic_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_synthetic_moe)

_KV_PROBE = """
import json
from colibri.model.hparams import HParams
from colibri.model.kv_cache import KVCache

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

class HP:  # the default model's attention shape
    n_layers, n_kv_heads, head_dim, kv_lora_rank = 30, 3, 64, 0

kv = KVCache(HP, 8, 4096)
before = anon()
for layer in range(HP.n_layers):  # the first token of slot 0
    kv.k[0, layer, 0] = 1.0
    kv.v[0, layer, 0] = 1.0
print(json.dumps({"grew": anon() - before, "nbytes": kv.k.nbytes + kv.v.nbytes}))
"""


def _probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_slots_first_token_costs_pages_not_huge_pages():
    """numpy asks for transparent huge pages on large arrays; the first token of a slot then cost
    a 2 MiB page per layer for K and for V (120 MB here). The cache maps 4 KiB pages."""
    got = _probe(_KV_PROBE)
    assert got["nbytes"] > 500 * MB  # 8 slots of 4096 positions (halves): big enough to have had huge pages
    grew = got["grew"] / MB
    assert got["grew"] < 4 * MB, f"the first token of one slot grew anonymous memory by {grew:.1f} MB"


_MAPPING_PROBE = """
import json, mmap, struct, sys
import numpy as np
from colibri.model.loader import Model

model = Model(sys.argv[1])
gguf = model.gguf
base = np.frombuffer(gguf._map, np.uint8).ctypes.data  # the mapping's address
mapped = 0
with open("/proc/self/pagemap", "rb") as pagemap:  # bit 63 of a page's entry: mapped here
    for name in gguf.released:
        info = gguf.tensors[name]
        first = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (info.offset + info.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        for page in range(first, end, mmap.PAGESIZE):
            pagemap.seek((base + page) // mmap.PAGESIZE * 8)
            mapped += struct.unpack("<Q", pagemap.read(8))[0] >> 63
print(json.dumps({"mapped": mapped, "released": len(gguf.released)}))
"""


def test_a_loaded_model_maps_none_of_the_tensors_it_copied(tmp_path):
    """Packed copies are what is read, so their tensors' pages leave the file's mapping; but a
    read of a small tensor beside them (a norm, a router) maps the page cache's whole folio around
    it, up to 2 MB, and on a MoE file the attention weights came back that way (86 MB of a 2.25 GB
    file, 4% of the process's RSS). After loading, no page wholly inside a copied tensor is mapped."""
    path = make_synthetic_moe.write_synthetic_moe(tmp_path / "moe.gguf", arch="qwen3moe", n_layers=4,
                                                  n_experts=8, n_used=2, n_embd=1024, n_ff=768,
                                                  n_vocab=512, n_heads=16, head_dim=128)
    with open(path, "rb") as f:  # in the page cache as a file read before is: read from the disk
        os.fsync(f.fileno())  # in order, the kernel's readahead grows its folios
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while f.read(1 << 20):
            pass
    out = subprocess.run([sys.executable, "-c", _MAPPING_PROBE, str(path)], capture_output=True, text=True,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] > 4 * 4  # every layer's attention matrices and norms at least
    assert got["mapped"] == 0, f"{got['mapped']} pages of copied tensors still mapped after loading"


_CACHED_KERNEL = '''
import numba as nb
import numpy as np


@nb.njit(cache=True)
def scaled(x, k):
    return x * k
'''

_LOAD_THEN_LINK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import numba as nb
import numpy as np
from colibri.model.kernels import cache_loading
import kernel

x = np.arange(4.0)
assert (kernel.scaled(x, 2.0) == 2 * x).all()
library = kernel.scaled.overloads[kernel.scaled.signatures[0]].library
loaded = {"installed": cache_loading.INSTALLED, "hits": sum(kernel.scaled.stats.cache_hits.values()),
          "parsed": library._shared_module is not None}


@nb.njit
def twice(x):  # a new compile that links the loaded kernel
    return kernel.scaled(x, 2.0) + kernel.scaled(x, 1.0)


loaded["linked"] = twice(x).tolist()
loaded["parsed_after_link"] = library._shared_module is not None
print(json.dumps(loaded))
"""


def test_a_cached_kernel_loads_without_its_linking_module_until_a_compile_links_it(tmp_path):
    """``kernels/cache_loading.py``: a function loaded from numba's cache keeps its LLVM bitcode
    unparsed (the parsed modules of a MoE forward's kernels held ~31 MB for the process's life),
    and a later compile that calls it still links it, parsing it then. The first process compiles
    and saves the kernel; the second loads it, checks, and compiles a caller."""
    (tmp_path / "kernel.py").write_text(_CACHED_KERNEL)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _LOAD_THEN_LINK, str(tmp_path)], env=env,
                                      capture_output=True, text=True, check=True).stdout)
            for _ in range(2)]
    first, second = runs
    assert first["installed"] and first["hits"] == 0  # compiled here, and saved
    assert second["hits"] == 1 and not second["parsed"]  # loaded, its module not parsed
    assert second["linked"] == [0.0, 3.0, 6.0, 9.0] and second["parsed_after_link"]
