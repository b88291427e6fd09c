"""`coli` as a user runs it: a subprocess on the real default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from colibri import settings
from colibri.model.kv_cache import KV_TYPES


def coli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "colibri", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_run_json_reports_tokens_and_speed(golden):
    """The chat path renders the template to llama.cpp's prompt ids and generates what
    --prompt-ids generates from those ids."""
    gen = golden["generations"][2]
    out = json.loads(coli("run", "--output", "json", "--max-tokens", "6", "--system",
                          gen["messages"][0]["content"], gen["messages"][1]["content"]).stdout)
    assert out["prompt_tokens"] == len(gen["prompt_ids"])
    by_ids = coli("run", "--prompt-ids", ",".join(map(str, gen["prompt_ids"])), "--output", "ids",
                  "--max-tokens", "6").stdout.strip()
    assert out["ids"] == [int(x) for x in by_ids.split(",")]
    assert out["completion_tokens"] == 6
    assert out["text"].startswith("The list of prime numbers")
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0


def test_run_text_streams_and_stops_at_end_of_turn():
    out = coli("run", "--max-tokens", "200", "What is the capital of France?").stdout
    assert "Paris" in out
    assert "<|im_end|>" not in out


def test_run_prompt_ids_output_ids(golden):
    gen = golden["generations"][3]  # its first five greedy tokens are clear of near-ties
    assert min(e["logits"][0] - e["logits"][1] for e in gen["top10"][:5]) >= 0.3
    ids = ",".join(map(str, gen["prompt_ids"]))
    out = coli("run", "--prompt-ids", ids, "--output", "ids", "--max-tokens", "5").stdout.strip()
    assert [int(x) for x in out.split(",")] == gen["greedy_ids"][:5]


def test_seed_makes_sampling_reproducible():
    args = ("run", "--output", "ids", "--max-tokens", "12", "--temperature", "1.2", "--top-p", "0.95")
    a = coli(*args, "--seed", "7", "Tell me a story.").stdout
    b = coli(*args, "--seed", "7", "Tell me a story.").stdout
    c = coli(*args, "--seed", "8", "Tell me a story.").stdout
    assert a == b
    assert a != c


def test_logits_lines(golden):
    gen = golden["generations"][0]
    ids = gen["prompt_ids"]
    lines = coli("logits", "--prompt-ids", ",".join(map(str, ids)), "--top", "3").stdout.splitlines()
    assert len(lines) == len(ids)
    rows = [json.loads(line) for line in lines]
    assert [r["pos"] for r in rows] == list(range(len(ids)))
    last = rows[-1]["top"]
    assert len(last) == 3 and last[0][1] >= last[1][1] >= last[2][1]
    assert {t[0] for t in last} & set(gen["top10"][0]["ids"][:3])


def test_logits_top_zero_is_whole_vocabulary():
    rows = coli("logits", "--prompt-ids", "1,2", "--top", "0").stdout.splitlines()
    assert len(json.loads(rows[0])["top"]) == 49152


def test_tokenize(golden):
    entry = next(e for e in golden["tokenize"] if "<|im_start|>" in e["text"])
    assert coli("tokenize", entry["text"]).stdout.strip() == ",".join(map(str, entry["ids"]))
    special = coli("tokenize", "--special", entry["text"]).stdout.strip()
    assert special == ",".join(map(str, entry["ids_special"]))


def test_info():
    out = coli("info").stdout
    assert "architecture  llama" in out
    assert "layers        30" in out
    assert "Q4_1 x210" in out and "Q8_0 x1" in out
    assert "tensors       272" in out


@pytest.mark.parametrize("args, needle, status", [
    (("run", "--model", "/nonexistent.gguf", "hi"), "/nonexistent.gguf", 2),  # a path: configuration
    (("run", "--prompt-ids", "1,x"), "--prompt-ids", 1),
    (("run", "--prompt-ids", "999999"), "outside the vocabulary", 1),
    (("run", "--temperature", "-1", "hi"), "temperature", 1),
    (("run", "--top-p", "0", "hi"), "top_p", 1),
    (("run", "--kv-type", "f8", "hi"), "--kv-type", 2),
])
def test_bad_input_is_one_error_line(args, needle, status):
    proc = coli(*args, check=False)
    assert proc.returncode == status
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_kv_type_f32_and_f16_both_answer():
    """The KV cache's type is a setting: float32 keeps keys and values as computed, halves (the
    default) round them; the default model's greedy answer is the same words either way."""
    outs = {t: coli("run", "--kv-type", t, "--max-tokens", "12", "What is 2+2?").stdout
            for t in ("f32", "f16")}
    assert outs["f32"].strip() and outs["f32"] == outs["f16"], outs
    assert set(settings.KV_TYPE_CHOICES) == set(KV_TYPES)  # the flag's choices are the cache's types


def test_info_lists_each_block_type_with_its_tensors_and_bytes():
    lines = coli("info").stdout.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.startswith("  ")}
    assert set(rows) == {"F32", "Q4_1", "Q8_0"}
    assert rows["Q4_1"][:2] == ["210", "tensors"] and rows["Q8_0"][:2] == ["1", "tensor"]
    assert all(r[3] == "MiB" and float(r[2]) > 0 for r in rows.values())
    assert "unsupported" not in "\n".join(lines)


def test_info_names_a_block_type_the_kernels_cannot_compute_on(tmp_path):
    """A file with a type outside the kernels' table: ``coli info`` still describes it, and names
    the first such tensor, its type and the types the kernels do compute on."""
    import gguf
    import numpy as np

    from colibri.store.formats import FORMATS, SUPPORTED

    odd = next(t for t in sorted(FORMATS, key=lambda t: t.name)
               if t not in SUPPORTED and gguf.GGMLQuantizationType(int(t)) in gguf.GGML_QUANT_SIZES)
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(odd))]
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    for name in ("blk.0.ffn_down.weight", "blk.0.ffn_up.weight"):
        w.add_tensor(name, np.zeros((4, 256 // block * nbytes), np.uint8),
                     raw_dtype=gguf.GGMLQuantizationType(int(odd)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = coli("info", "--model", str(path)).stdout
    (line,) = [line for line in out.splitlines() if line.startswith(f"  {odd.name} ")]
    assert line.split()[1:3] == ["2", "tensors"]
    supported = ", ".join(sorted(t.name for t in SUPPORTED))
    assert f"tensor 'blk.0.ffn_down.weight' (and 1 more) has block type {odd.name}" in line
    assert line.endswith(f"(supported: {supported})")
    assert "unsupported" not in next(x for x in out.splitlines() if x.startswith("  F32 "))
