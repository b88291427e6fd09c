"""What memory costs: a KV slot costs what it holds, a loaded model about its file.

Each figure is measured in a fresh process (``RssAnon`` and ``VmHWM`` from /proc), so that what
other tests allocated does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys

MB = 1 << 20

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
