"""``coli convert`` of gpt-oss (tools/make_tiny_moe.py's tiny checkpoint, made with transformers'
``GptOssForCausalLM``): llama.cpp's names, shapes, types and metadata; the fused experts
de-interleaved and transposed; ``--type mxfp4_moe`` (llama.cpp's MXFP4_MOE: the experts MXFP4, bit
for bit on their grid, the rest Q8_0); the checkpoints it refuses; and llama.cpp on the files.

llama.cpp always rounds YaRN's blend range to whole pairs, where gpt-oss's config says
``truncate: false`` (transformers, and colibri, do not round it): on the tiny model its logits sit
~0.05 from transformers'. With the range rounded (the file saying ``yarn_truncate`` true), colibri's
logits are llama.cpp's to float rounding: the gap is that rounding and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from convert_harness import assert_one_error, copy_tiny, edit_config, read_checkpoint, values

from colibri.cli import main
from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.store.formats import GGMLType, quantize
from colibri.store.gguf import GGUFFile

SRC = Path(__file__).parent / "data" / "tiny_hf" / "gpt_oss"
TYPES = ("f32", "q8_0", "mxfp4_moe")
MXFP4_MOE_FILE_TYPE = 38  # llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE
FLOAT_TOLERANCE = 1e-4  # colibri against llama.cpp, both with the rounded YaRN range, f32 file
# llama.cpp's logits against transformers': the YaRN rounding alone (measured 0.046)
ROUNDED_YARN_GAP = 0.1
# llama.cpp's top-1 agreement with transformers on the quantized files: it rounds every matmul's
# input to 8 bits, and YaRN's range (test_convert_llama_cpp.py's floor; 0.86 measured on q8_0)
MIN_TOP1_AGREEMENT = 0.85


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gpt_oss")
    files = {}
    for t in TYPES:
        files[t] = out / f"gpt_oss-{t}.gguf"
        assert main(["convert", str(SRC), "-o", str(files[t]), "--type", t]) == 0
    return files


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(SRC / "reference.npz"))


def expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (numpy shape, stays F32)."""
    h, v, heads, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, kv = heads * hd, cfg["num_key_value_heads"] * hd
    ff, n_exp = cfg["intermediate_size"], cfg["num_local_experts"]
    t = {"token_embd.weight": ((v, h), False), "output_norm.weight": ((h,), True),
         "output.weight": ((v, h), False)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": ((h,), True), b + "post_attention_norm.weight": ((h,), True),
              b + "attn_q.weight": ((q, h), False), b + "attn_q.bias": ((q,), True),
              b + "attn_k.weight": ((kv, h), False), b + "attn_k.bias": ((kv,), True),
              b + "attn_v.weight": ((kv, h), False), b + "attn_v.bias": ((kv,), True),
              b + "attn_output.weight": ((h, q), False), b + "attn_output.bias": ((h,), True),
              b + "attn_sinks.weight": ((heads,), True),
              b + "ffn_gate_inp.weight": ((n_exp, h), True), b + "ffn_gate_inp.bias": ((n_exp,), True),
              b + "ffn_gate_exps.weight": ((n_exp, ff, h), False),
              b + "ffn_gate_exps.bias": ((n_exp, ff), True),
              b + "ffn_up_exps.weight": ((n_exp, ff, h), False), b + "ffn_up_exps.bias": ((n_exp, ff), True),
              b + "ffn_down_exps.weight": ((n_exp, h, ff), False),
              b + "ffn_down_exps.bias": ((n_exp, h), True)}
    return t


def matrix_type(t: str, name: str, shape: tuple[int, ...]) -> GGMLType:
    if t == "mxfp4_moe":
        return GGMLType.MXFP4 if len(shape) == 3 else GGMLType.Q8_0
    return {"f32": GGMLType.F32, "q8_0": GGMLType.Q8_0}[t]


@pytest.mark.parametrize("t", TYPES)
def test_names_shapes_types_metadata(converted, t: str) -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    g = GGUFFile(converted[t])
    want = expected(cfg)
    assert set(g.tensors) == set(want)
    for name, (shape, stays_f32) in want.items():
        ti = g.tensors[name]
        assert ti.shape == shape[::-1], name
        assert ti.gtype == (GGMLType.F32 if stays_f32 else matrix_type(t, name, shape)), name
    assert g.get("general.architecture") == "gpt-oss"
    if t == "mxfp4_moe":
        assert g.get("general.file_type") == MXFP4_MOE_FILE_TYPE
    meta = {"block_count": 2, "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64,
            "expert_gating_func": 3, "expert_weights_norm": False, "attention.sliding_window": 8,
            "attention.key_length": 16, "rope.freq_base": 150000.0, "rope.scaling.type": "yarn",
            "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
            "rope.scaling.yarn_truncate": False}
    for key, value in meta.items():
        assert g.get(f"gpt-oss.{key}") == pytest.approx(value), key
    assert g.get("gpt-oss.attention.sliding_window_pattern") is None  # the default: sliding, full, ...


def test_values_deinterleaved_transposed_and_exact(converted) -> None:
    """gate = gate_up[:, :, 0::2]ᵀ, up = gate_up[:, :, 1::2]ᵀ, down = down_projᵀ, their biases split
    the same way; the experts lie on MXFP4's grid: the mxfp4_moe file holds them bit for bit."""
    hf = read_checkpoint(SRC)
    g32, gmx = GGUFFile(converted["f32"]), GGUFFile(converted["mxfp4_moe"])
    for i in range(2):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        gate_up, bias = hf[p + "mlp.experts.gate_up_proj"], hf[p + "mlp.experts.gate_up_proj_bias"]
        for kind, first in (("gate", 0), ("up", 1)):
            want = gate_up[:, :, first::2].transpose(0, 2, 1)
            np.testing.assert_array_equal(values(g32, f"{b}ffn_{kind}_exps.weight"), want)
            np.testing.assert_array_equal(values(gmx, f"{b}ffn_{kind}_exps.weight"), want)
            np.testing.assert_array_equal(values(g32, f"{b}ffn_{kind}_exps.bias"), bias[:, first::2])
        down = hf[p + "mlp.experts.down_proj"].transpose(0, 2, 1)
        np.testing.assert_array_equal(values(g32, f"{b}ffn_down_exps.weight"), down)
        np.testing.assert_array_equal(values(gmx, f"{b}ffn_down_exps.weight"), down)
        np.testing.assert_array_equal(values(g32, f"{b}ffn_down_exps.bias"),
                                      hf[p + "mlp.experts.down_proj_bias"])
        np.testing.assert_array_equal(values(g32, f"{b}attn_sinks.weight"), hf[p + "self_attn.sinks"])
        np.testing.assert_array_equal(values(g32, f"{b}ffn_gate_inp.bias"), hf[p + "mlp.router.bias"])
        np.testing.assert_array_equal(values(g32, f"{b}attn_output.bias"), hf[p + "self_attn.o_proj.bias"])


def test_another_layer_order_is_written_out(capsys, tmp_path: Path) -> None:
    src = copy_tiny("gpt_oss", tmp_path)
    edit_config(src, layer_types=["full_attention", "sliding_attention"])
    assert main(["convert", str(src), "-o", str(tmp_path / "o.gguf")]) == 0
    assert GGUFFile(tmp_path / "o.gguf").get("gpt-oss.attention.sliding_window_pattern") == [False, True]


@pytest.mark.parametrize(("change", "needle"), [
    ({"swiglu_limit": 10.0}, "swiglu_limit 10.0"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_what_it_refuses(capsys, tmp_path: Path, change: dict, needle: str) -> None:
    src = copy_tiny("gpt_oss", tmp_path)
    edit_config(src, **change)
    assert_one_error(capsys, src, tmp_path / "o.gguf", needle)


def test_llama_cpp_on_our_files(converted, reference, tmp_path: Path) -> None:
    """llama.cpp loads every type; its f32 logits are colibri's with YaRN's range rounded (as it
    always rounds), within ROUNDED_YARN_GAP of transformers' and with the same greedy choices;
    the quantized files keep MIN_TOP1_AGREEMENT of transformers' choices."""
    llama_cpp = pytest.importorskip("llama_cpp")
    seq = reference["prompt_ids"].tolist() + reference["greedy_ids"].tolist()

    def theirs(path: Path) -> np.ndarray:
        llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
        llm.eval(seq)
        return np.array(llm.scores[: len(seq)])

    logits = theirs(converted["f32"])
    assert np.abs(logits - reference["full_logits"]).max() <= ROUNDED_YARN_GAP
    assert (logits.argmax(-1) == reference["full_logits"].argmax(-1)).all()
    rounded = copy_tiny("gpt_oss", tmp_path)
    cfg = json.loads((rounded / "config.json").read_text())
    edit_config(rounded, rope_parameters={**cfg["rope_parameters"], "truncate": True})
    assert main(["convert", str(rounded), "-o", str(tmp_path / "rounded.gguf"), "--type", "f32"]) == 0
    model = Model(tmp_path / "rounded.gguf", kv_type="f32")
    ours = SingleSequence(model, 256, 512).prefill(seq, all_logits=True)
    assert np.abs(ours - logits).max() <= FLOAT_TOLERANCE
    for t in ("q8_0", "mxfp4_moe"):
        top1 = theirs(converted[t]).argmax(-1)
        assert (top1 == reference["full_logits"].argmax(-1)).mean() >= MIN_TOP1_AGREEMENT, t


def test_llama_cpp_on_the_other_shape(tmp_path: Path) -> None:
    """gpt_oss_gqa (RoPE unscaled, one kv head for four, a window of 4): llama.cpp's f32 logits are
    transformers' and colibri's to float rounding, nothing rounded apart."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src, out = SRC.parent / "gpt_oss_gqa", tmp_path / "gpt_oss_gqa-f32.gguf"
    assert main(["convert", str(src), "-o", str(out), "--type", "f32"]) == 0
    ref = np.load(src / "reference.npz")
    seq = ref["prompt_ids"].tolist() + ref["greedy_ids"].tolist()
    llm = llama_cpp.Llama(str(out), n_ctx=256, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(seq)
    theirs = np.array(llm.scores[: len(seq)])
    ours = SingleSequence(Model(out, kv_type="f32"), 256, 512).prefill(seq, all_logits=True)
    assert np.abs(theirs - ref["full_logits"]).max() <= FLOAT_TOLERANCE  # (measured 2.1e-5)
    assert np.abs(theirs - ours).max() <= FLOAT_TOLERANCE  # (2.6e-5)


def released_layout(tmp_path: Path) -> Path:
    """The tiny gpt_oss as OpenAI released gpt-oss: the experts as MXFP4 ``_blocks`` (value 2i in the
    low nibble of byte i) and ``_scales`` (uint8), under ``quant_method: mxfp4``; exact, as the
    tiny experts lie on MXFP4's grid."""
    out = copy_tiny("gpt_oss", tmp_path)
    tensors: dict[str, np.ndarray] = {}
    for name, a in read_checkpoint(SRC).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = a
            continue
        rows = np.ascontiguousarray(a.transpose(0, 2, 1))  # [expert, output, input]: GGUF's rows
        ggml = quantize(rows, GGMLType.MXFP4).reshape(*rows.shape[:2], -1, 17)
        codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-1)  # value order
        tensors[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        tensors[name + "_scales"] = np.ascontiguousarray(ggml[..., 0])
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        dtype = "U8" if a.dtype == np.uint8 else "F32"
        blob = np.ascontiguousarray(a if dtype == "U8" else a.astype(np.float32)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (out / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    edit_config(out, quantization_config={"quant_method": "mxfp4"})
    return out


def test_the_released_mxfp4_layout_converts_byte_for_byte(converted, tmp_path: Path) -> None:
    """The blocks go into the file as they are: the experts' bytes are the ones ``mxfp4_moe``
    quantizes from the float checkpoint, whatever ``--type`` says of the rest, and so are the logits."""
    src = released_layout(tmp_path)
    out = tmp_path / "released.gguf"
    assert main(["convert", str(src), "-o", str(out), "--type", "q8_0"]) == 0
    ours, want = GGUFFile(out), GGUFFile(converted["mxfp4_moe"])
    for i in range(2):
        for part in ("gate", "up", "down"):
            name = f"blk.{i}.ffn_{part}_exps.weight"
            assert ours.tensors[name].gtype == GGMLType.MXFP4
            assert np.array_equal(ours.raw(name), want.raw(name)), name
    ref = np.load(SRC / "reference.npz")
    seq = ref["prompt_ids"].tolist() + ref["greedy_ids"].tolist()
    a, b = (SingleSequence(Model(p), 256, 512).prefill(seq, all_logits=True)
            for p in (out, converted["mxfp4_moe"]))
    assert np.array_equal(a, b)
