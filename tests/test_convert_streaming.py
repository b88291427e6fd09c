"""``coli convert`` streams: converting a model never needs it in memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFFile

STREAM_HIDDEN, STREAM_EXPERTS, STREAM_LAYERS = 1024, 8, 2  # about 240 MB of float32
MAX_RSS_GROWTH = 0.25  # peak resident growth while converting, as a fraction of the checkpoint

RSS_PROBE = textwrap.dedent("""
    import sys
    from colibri.convert.writer import convert

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:  # restart the high-water mark (VmHWM) here
        f.write("5")
    convert(sys.argv[1], sys.argv[2], sys.argv[3])
    print(status("VmHWM:") - before)
""")


def write_big_mixtral(d: Path) -> int:
    """A mixtral-shaped checkpoint of random float32, written tensor by tensor; returns its size."""
    h, e = STREAM_HIDDEN, STREAM_EXPERTS
    shapes = {"model.embed_tokens.weight": (h, h), "model.norm.weight": (h,), "lm_head.weight": (h, h)}
    for i in range(STREAM_LAYERS):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.block_sparse_moe.gate.weight": (e, h)}
        shapes |= {f"{p}.self_attn.{x}_proj.weight": (h, h) for x in "qkvo"}
        shapes |= {f"{p}.block_sparse_moe.experts.{x}.{w}.weight": (h, h)
                   for x in range(e) for w in ("w1", "w2", "w3")}
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(0)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for shape in shapes.values():
            f.write(rng.random(shape, dtype=np.float32).tobytes())
    (d / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "hidden_size": h, "intermediate_size": h,
        "num_hidden_layers": STREAM_LAYERS, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_local_experts": e, "num_experts_per_tok": 2, "vocab_size": h, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    return offset


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_streaming_keeps_rss_far_below_the_model(tmp_path: Path) -> None:
    size = write_big_mixtral(tmp_path)
    out = tmp_path / "big.gguf"
    proc = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path), str(out), "q8_0"],
                          capture_output=True, text=True, check=True)
    growth = int(proc.stdout.strip())
    assert growth < MAX_RSS_GROWTH * size, f"peak RSS grew {growth >> 20} MiB for {size >> 20} MiB"
    g = GGUFFile(out)
    assert g.tensors["blk.1.ffn_down_exps.weight"].shape == (STREAM_HIDDEN, STREAM_HIDDEN, STREAM_EXPERTS)
    assert g.tensors["blk.1.ffn_down_exps.weight"].gtype == GGMLType.Q8_0
