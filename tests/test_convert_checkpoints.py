"""``coli convert`` on checkpoints as transformers saves them, not only as their authors publish
them: a GLM NextN layer the config counts but the file lacks, tied embeddings with or without
``lm_head.weight``, ``rope_scaling`` or ``rope_parameters``, ``torch_dtype`` or ``dtype``, BF16
shards, an index naming shards that are not there or missing one that is. Each converts, or stops
with one line that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from convert_harness import (
    LOGIT_TOLERANCE,
    TINY,
    assert_one_error,
    assert_same_tensors,
    coli_convert,
    copy_tiny,
    edit_config,
    plan_of,
    read_checkpoint,
    values,
    write_safetensors,
)

from colibri.store.gguf import GGUFFile

INDEX = "model.safetensors.index.json"


def without_keys(d: Path, *keys: str, **changes) -> None:
    """config.json without ``keys``, with ``changes``."""
    cfg = json.loads((d / "config.json").read_text())
    for k in keys:
        cfg.pop(k, None)
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def convert_ok(capsys, d: Path, out: Path, t: str = "f32") -> str:
    rc, _, err = coli_convert(capsys, d, out, "--type", t)
    assert rc == 0, err
    return err


# --- GLM-4.5's NextN layer: counted by the config, not saved by transformers ---------------------

def glm_without_nextn(tmp_path: Path) -> Path:
    """The tiny glm4moe, its config counting one NextN layer the checkpoint does not hold."""
    d = copy_tiny("glm4moe", tmp_path)
    edit_config(d, num_nextn_predict_layers=1)
    return d


def test_nextn_layer_not_saved_converts_without_it(capsys, tmp_path: Path) -> None:
    """block_count counts the layers the file has and nextn_predict_layers is 0, as llama.cpp's
    converter writes a model without its NextN layer: colibri and llama.cpp both run all three
    layers and compute transformers' logits."""
    d = glm_without_nextn(tmp_path)
    plan = plan_of(d)
    assert len(plan.warnings) == 1
    assert "num_nextn_predict_layers is 1" in plan.warnings[0] and "model.layers.3." in plan.warnings[0]
    out = tmp_path / "g.gguf"
    convert_ok(capsys, d, out)
    g = GGUFFile(out)
    assert (g.get("glm4moe.block_count"), g.get("glm4moe.nextn_predict_layers")) == (3, 0)
    assert not [n for n in g.tensors if n.startswith("blk.3.")]
    assert_same_tensors(out, convert_reference(capsys, tmp_path))
    ref = np.load(TINY / "glm4moe" / "reference.npz")
    prompt = ref["prompt_ids"].tolist()
    from colibri.model.generate import SingleSequence
    from colibri.model.loader import Model

    model = Model(out, kv_type="f32")  # transformers' float32 keys and values
    assert model.hp.n_layers == 3
    ours = SingleSequence(model, 256, 512).prefill(prompt, all_logits=True)
    assert np.abs(ours - ref["logits"]).max() <= LOGIT_TOLERANCE
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(out), n_ctx=256, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(prompt)
    assert np.abs(np.array(llm.scores[: len(prompt)]) - ref["logits"]).max() <= LOGIT_TOLERANCE


def convert_reference(capsys, tmp_path: Path) -> Path:
    out = tmp_path / "reference.gguf"
    if not out.exists():
        convert_ok(capsys, TINY / "glm4moe", out)
    return out


def test_nextn_layer_not_saved_prints_one_warning(capsys, tmp_path: Path) -> None:
    err = convert_ok(capsys, glm_without_nextn(tmp_path), tmp_path / "g.gguf")
    lines = err.strip().splitlines()
    warnings = [line for line in lines if line.startswith("coli: warning: ")]
    nextn = [line for line in warnings if "NextN" in line]
    assert len(nextn) == 1, err
    # the only other line: the tiny glm has no tokenizer
    assert len(lines) == 2 and any("placeholder vocabulary" in line for line in warnings), err


def test_nextn_layer_partly_saved_is_refused(capsys, tmp_path: Path) -> None:
    """Some of a NextN layer's tensors saved: the rest are missing tensors, an error (no warning path)."""
    d = glm_without_nextn(tmp_path)
    hf = read_checkpoint(d)
    hf["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
    write_safetensors(d / "model.safetensors", hf)
    assert_one_error(capsys, d, tmp_path / "o.gguf", "missing tensor 'model.layers.3.input_layernorm.weight'")


def test_nextn_count_under_its_other_name(tmp_path: Path) -> None:
    d = copy_tiny("glm4moe", tmp_path)
    without_keys(d, "num_nextn_predict_layers", num_mtp_layers=2)
    (warning,) = plan_of(d).warnings
    assert "num_mtp_layers is 2" in warning


# --- tied embeddings ------------------------------------------------------------------------------

def test_tied_with_lm_head_saved(capsys, tmp_path: Path) -> None:
    """tie_word_embeddings true: the head is the embedding (transformers ties them on load), so
    a saved lm_head.weight, equal or not, is not read and the file has no output.weight."""
    ref = tmp_path / "ref.gguf"
    convert_ok(capsys, TINY / "llama", ref)
    d = copy_tiny("llama", tmp_path)
    hf = read_checkpoint(d)
    for head in (hf["model.embed_tokens.weight"], np.zeros_like(hf["model.embed_tokens.weight"])):
        write_safetensors(d / "model.safetensors", hf | {"lm_head.weight": head})
        out = tmp_path / "tied.gguf"
        convert_ok(capsys, d, out)
        assert "output.weight" not in GGUFFile(out).tensors
        assert_same_tensors(ref, out)


def test_tied_with_only_lm_head_saved(capsys, tmp_path: Path) -> None:
    ref = tmp_path / "ref.gguf"
    convert_ok(capsys, TINY / "llama", ref)
    d = copy_tiny("llama", tmp_path)
    hf = read_checkpoint(d)
    hf["lm_head.weight"] = hf.pop("model.embed_tokens.weight")
    write_safetensors(d / "model.safetensors", hf)
    out = tmp_path / "head.gguf"
    convert_ok(capsys, d, out)
    assert_same_tensors(ref, out)


def test_untied_without_lm_head_is_refused(capsys, tmp_path: Path) -> None:
    d = copy_tiny("llama", tmp_path)
    edit_config(d, tie_word_embeddings=False)
    assert_one_error(capsys, d, tmp_path / "o.gguf", "missing tensor 'lm_head.weight'",
                     "tie_word_embeddings is false")
    edit_config(d, tie_word_embeddings="yes")
    assert_one_error(capsys, d, tmp_path / "o.gguf", "tie_word_embeddings is 'yes'")


def test_untied_with_lm_head_keeps_it(capsys, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    convert_ok(capsys, TINY / "mixtral", out)
    hf = read_checkpoint(TINY / "mixtral")
    np.testing.assert_array_equal(values(GGUFFile(out), "output.weight"), hf["lm_head.weight"])


# --- rope settings: rope_scaling (transformers 4) and rope_parameters (transformers 5) -----------

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def rope_metadata(capsys, tmp_path: Path, name: str, **config) -> dict:
    d = copy_tiny("llama", tmp_path / name)
    without_keys(d, *ROPE_KEYS, **config)
    out = tmp_path / f"{name}.gguf"
    convert_ok(capsys, d, out)
    g = GGUFFile(out)
    return {k: v for k, v in g.metadata.items() if k.startswith("llama.rope.")}


def test_rope_theta_at_the_top_or_inside(capsys, tmp_path: Path) -> None:
    old = rope_metadata(capsys, tmp_path, "old", rope_theta=500000.0, rope_scaling=None)
    new = rope_metadata(capsys, tmp_path, "new", rope_parameters={"rope_type": "default",
                                                                  "rope_theta": 500000.0})
    assert old == new and new["llama.rope.freq_base"] == pytest.approx(500000.0)
    none = rope_metadata(capsys, tmp_path, "none")
    assert none["llama.rope.freq_base"] == pytest.approx(10000.0)


def test_yarn_in_either_key(capsys, tmp_path: Path) -> None:
    yarn = {"factor": 4.0, "original_max_position_embeddings": 64}
    old = rope_metadata(capsys, tmp_path, "old", rope_theta=1e6, rope_scaling={"type": "yarn", **yarn})
    new = rope_metadata(capsys, tmp_path, "new",
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **yarn})
    assert old == new
    assert new["llama.rope.scaling.type"] == "yarn"
    assert new["llama.rope.scaling.factor"] == pytest.approx(4.0)
    assert new["llama.rope.scaling.original_context_length"] == 64
    # Without the original length transformers and llama.cpp take the context length: not written.
    bare = rope_metadata(capsys, tmp_path, "bare", rope_parameters={"rope_type": "yarn", "factor": 2.0})
    assert "llama.rope.scaling.original_context_length" not in bare


@pytest.mark.parametrize("config, needle", [
    ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_parameters and rope_scaling disagree on rope_type"),
    ({"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e4}}, "rope_theta is 1000000.0, but 10000.0"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "rope scaling 'yarn' needs a number factor"),
    ({"rope_scaling": "linear"}, "rope_scaling is 'linear', not an object"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "settings per layer type"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is not supported"),
])
def test_rope_settings_that_cannot_be_read(capsys, tmp_path: Path, config: dict, needle: str) -> None:
    d = copy_tiny("llama", tmp_path)
    without_keys(d, *ROPE_KEYS, **config)
    assert_one_error(capsys, d, tmp_path / "o.gguf", needle)


def test_partial_rotary_factor_at_the_top_or_inside(tmp_path: Path) -> None:
    d = copy_tiny("glm4moe", tmp_path)
    params = json.loads((d / "config.json").read_text())["rope_parameters"]
    without_keys(d, "rope_parameters", rope_theta=params["rope_theta"],
                 partial_rotary_factor=params["partial_rotary_factor"])
    def rope(src: Path) -> dict:
        return {key: value for key, value, _ in plan_of(src).metadata if key.startswith("glm4moe.rope.")}

    assert rope(d) == rope(TINY / "glm4moe") and rope(d)["glm4moe.rope.dimension_count"] == 16


# --- dtypes: the config's key, the shards' own ----------------------------------------------------

@pytest.mark.parametrize("config", [{"torch_dtype": "bfloat16"}, {"dtype": "float16"}, {}])
def test_config_dtype_key_is_not_what_is_read(capsys, tmp_path: Path, config: dict) -> None:
    """transformers < 4.56 writes torch_dtype, later ones dtype; either may differ from what the
    shards hold (here F32): the shards' headers decide, and the file is the same."""
    ref = tmp_path / "ref.gguf"
    convert_ok(capsys, TINY / "qwen3moe", ref)
    d = copy_tiny("qwen3moe", tmp_path)
    without_keys(d, "dtype", "torch_dtype", **config)
    out = tmp_path / "d.gguf"
    convert_ok(capsys, d, out)
    assert_same_tensors(ref, out)


def test_bf16_shards(capsys, tmp_path: Path) -> None:
    """A sharded checkpoint, one shard BF16 and one F32: the same file as its values in F32."""
    d = copy_tiny("qwen2moe", tmp_path)
    shard = d / "model-00001-of-00002.safetensors"
    write_safetensors(shard, read_checkpoint_file(shard), "BF16")
    widened = copy_tiny("qwen2moe", tmp_path / "widened")
    write_safetensors(widened / shard.name, read_checkpoint_file(shard))
    for t in ("f32", "q8_0"):
        convert_ok(capsys, d, tmp_path / f"bf16-{t}.gguf", t)
        convert_ok(capsys, widened, tmp_path / f"f32-{t}.gguf", t)
        assert_same_tensors(tmp_path / f"bf16-{t}.gguf", tmp_path / f"f32-{t}.gguf")


def read_checkpoint_file(path: Path) -> dict[str, np.ndarray]:
    """One safetensors file's tensors as float32 (read_checkpoint reads a directory)."""
    one = path.parent / "one"
    one.mkdir(exist_ok=True)
    (one / path.name).write_bytes(path.read_bytes())
    return read_checkpoint(one)


def write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file of any dtype: name -> (dtype, shape, the bytes)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(t[2] for t in tensors.values()))


def test_quantized_checkpoints_are_refused_up_front(capsys, tmp_path: Path) -> None:
    """FP8 (as GLM-4.5-FP8 is published) and other pre-quantized weights: refused when the
    checkpoint is opened, naming the tensor and its dtype, not when the writer reaches it."""
    d = copy_tiny("llama", tmp_path)
    hf = read_checkpoint(d)
    del hf["model.layers.1.mlp.down_proj.weight"]
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model-rest.safetensors", hf)
    write_raw_safetensors(d / "model-fp8.safetensors", {
        "model.layers.1.mlp.down_proj.weight": ("F8_E4M3", [64, 96], bytes(64 * 96))})
    assert_one_error(capsys, d, tmp_path / "o.gguf", "'model.layers.1.mlp.down_proj.weight' is F8_E4M3",
                     "quantized")
    d = copy_tiny("llama", tmp_path / "q")
    edit_config(d, quantization_config={"quant_method": "fp8"})
    assert_one_error(capsys, d, tmp_path / "o.gguf", "quant_method 'fp8'", "unquantized")


# --- the index and the shards it names ------------------------------------------------------------

def test_index_naming_absent_shards(capsys, tmp_path: Path) -> None:
    """Shards the index names but the directory lacks: one line listing them all, before any
    tensor is looked for."""
    d = copy_tiny("qwen2moe", tmp_path)
    index = json.loads((d / INDEX).read_text())
    moved = [n for n in index["weight_map"] if n.startswith("model.layers.1.mlp.experts.")]
    for n in moved:
        index["weight_map"][n] = "model-00003-of-00003.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    (d / "model-00002-of-00002.safetensors").unlink()
    line = assert_one_error(capsys, d, tmp_path / "o.gguf", "2 of its 3 shards are missing",
                            "'model-00002-of-00002.safetensors'", "'model-00003-of-00003.safetensors'")
    assert "missing tensor" not in line
    index["weight_map"][moved[0]] = "../elsewhere.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    assert_one_error(capsys, d, tmp_path / "o.gguf", "'../elsewhere.safetensors' is not a file name in")


def test_shard_the_index_does_not_name_is_not_read(capsys, tmp_path: Path) -> None:
    """A .safetensors file beside the shards (a consolidated copy, a leftover) is ignored, as
    transformers ignores it; the index says what the model is."""
    ref = tmp_path / "ref.gguf"
    convert_ok(capsys, TINY / "qwen2moe", ref)
    d = copy_tiny("qwen2moe", tmp_path)
    (d / "consolidated.safetensors").write_bytes(b"not a safetensors file")
    out = tmp_path / "x.gguf"
    convert_ok(capsys, d, out)
    assert_same_tensors(ref, out)
