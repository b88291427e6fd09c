"""``coli convert`` refuses every bad checkpoint it can meet with one line: exit 1, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from convert_harness import TINY, assert_one_error, copy_tiny, edit_config, read_checkpoint, write_safetensors


def test_unsupported_architecture(capsys, tmp_path: Path) -> None:
    d = copy_tiny("llama", tmp_path)
    edit_config(d, architectures=["GPT2LMHeadModel"])
    assert_one_error(capsys, d, tmp_path / "o.gguf", "unsupported architecture 'GPT2LMHeadModel'",
                     "Qwen3MoeForCausalLM")


def test_missing_tensor(capsys, tmp_path: Path) -> None:
    d = copy_tiny("qwen2moe", tmp_path)  # sharded: drop a tensor from the index
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_error(capsys, d, tmp_path / "o.gguf",
                     "missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'")
    d = copy_tiny("llama", tmp_path)  # single file: rewrite it without a norm
    hf = read_checkpoint(d)
    del hf["model.layers.0.post_attention_layernorm.weight"]
    write_safetensors(d / "model.safetensors", hf)
    assert_one_error(capsys, d, tmp_path / "o.gguf",
                     "missing tensor 'model.layers.0.post_attention_layernorm.weight'")


def test_wrong_shape_and_unexpected_tensor(capsys, tmp_path: Path) -> None:
    d = copy_tiny("glm4moe", tmp_path)
    edit_config(d, intermediate_size=128)
    assert_one_error(capsys, d, tmp_path / "o.gguf",
                     "'model.layers.0.mlp.gate_proj.weight' has shape [96, 64]", "[128, 64]")
    d = copy_tiny("llama", tmp_path / "x")
    hf = read_checkpoint(d)
    hf["model.layers.0.self_attn.extra.weight"] = np.zeros((4, 4), np.float32)
    write_safetensors(d / "model.safetensors", hf)
    assert_one_error(capsys, d, tmp_path / "o.gguf",
                     "unexpected tensor 'model.layers.0.self_attn.extra.weight'")


def test_truncated_and_malformed_safetensors(capsys, tmp_path: Path) -> None:
    d = copy_tiny("llama", tmp_path)
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    assert_one_error(capsys, d, tmp_path / "o.gguf", str(st), "runs past the end of the file")
    st.write_bytes(data[:5])
    assert_one_error(capsys, d, tmp_path / "o.gguf", str(st), "truncated file")
    st.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    assert_one_error(capsys, d, tmp_path / "o.gguf", str(st), "malformed header", "header length")
    n = int.from_bytes(data[:8], "little")
    st.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    assert_one_error(capsys, d, tmp_path / "o.gguf", str(st), "malformed header", "not JSON")
    bad = json.loads(data[8 : 8 + n])
    bad["model.norm.weight"]["data_offsets"][1] += 4
    head = json.dumps(bad).encode().ljust(n)
    st.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n :])
    assert_one_error(capsys, d, tmp_path / "o.gguf", str(st), "'model.norm.weight'")


def test_bad_directories(capsys, tmp_path: Path) -> None:
    assert_one_error(capsys, tmp_path / "nowhere", tmp_path / "o.gguf", "not a directory")
    (tmp_path / "empty").mkdir()
    assert_one_error(capsys, tmp_path / "empty", tmp_path / "o.gguf", "no config.json")
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(TINY / "llama" / "config.json", d)
    assert_one_error(capsys, d, tmp_path / "o.gguf", "no safetensors weights")
    d = copy_tiny("qwen2moe", tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    assert_one_error(capsys, d, tmp_path / "o.gguf", "model-00002-of-00002.safetensors", "missing")
    assert_one_error(capsys, TINY / "llama", tmp_path / "no" / "dir" / "o.gguf", "cannot write")
