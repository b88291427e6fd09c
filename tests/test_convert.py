"""``coli convert``: the tiny Hugging Face checkpoints of every architecture to GGUF, checked three
ways: the file's names, shapes, types and metadata (llama.cpp's); its values against the
checkpoint's (exact where the format is, the llama.cpp rope permutation, expert stacking); and, when
llama-cpp-python is installed, llama.cpp's own logits and greedy tokens against transformers'.
Plus every error a bad checkpoint can cause, and a conversion of a model far larger than the
memory it is allowed.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from colibri.store.gguf import GGUFFile
from colibri.store.quant import GGMLType, dequantize

TINY = Path(__file__).parent / "data" / "tiny_hf"
ARCHS = ["llama", "mixtral", "qwen2moe", "qwen3moe", "glm4moe"]
TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}
LOGIT_TOLERANCE = 1e-3  # max |llama.cpp - transformers| over the prompt's logits (f32 file)
MIN_QUANT_AGREEMENT = 0.9  # llama.cpp's top-1 agreement with transformers for q8_0 and q4_0 files
Q8_ERROR = 0.5 / 127  # Q8_0 rounds to within half a step of a block's largest magnitude / 127


# --- helpers: an independent safetensors reader and writer ---------------------------------------

ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_checkpoint(d: Path) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) checkpoint as float32."""
    out = {}
    for path in sorted(d.glob("*.safetensors")):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for name, meta in json.loads(raw[8 : 8 + n]).items():
            if name == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            v = np.frombuffer(raw[8 + n + a : 8 + n + b], ST_DTYPES[meta["dtype"]])
            if meta["dtype"] == "BF16":
                v = (v.astype(np.uint32) << 16).view(np.float32)
            out[name] = v.astype(np.float32).reshape(meta["shape"])
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    header, offset = {}, 0
    for name, a in tensors.items():
        nbytes = a.size * (4 if dtype == "F32" else 2)
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for a in tensors.values():
            a = np.ascontiguousarray(a, dtype=np.float32)
            if dtype == "BF16":
                a = (a.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact for grid values
            elif dtype == "F16":
                a = a.astype(np.float16)
            f.write(np.ascontiguousarray(a).tobytes())


def copy_tiny(arch: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(TINY / arch, tmp_path / arch))


def coli_convert(capsys, src: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    rc = main(["convert", str(src), "-o", str(out), *extra])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every tiny checkpoint converted to every type, once for the module."""
    out_dir = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in ARCHS:
        for t in TYPES:
            out = out_dir / f"{arch}-{t}.gguf"
            assert main(["convert", str(TINY / arch), "-o", str(out), "--type", t]) == 0
            files[arch, t] = out
    return files


# --- the expected file, written out per architecture ---------------------------------------------

def expected_tensors(arch: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (numpy shape, stays F32) for each tiny checkpoint, from llama.cpp's names."""
    cfg = json.loads((TINY / arch / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    t: dict[str, tuple[tuple[int, ...], bool]] = {"token_embd.weight": ((v, h), False),
                                                  "output_norm.weight": ((h,), True)}
    if not cfg.get("tie_word_embeddings"):
        t["output.weight"] = ((v, h), False)
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = ((h,), True)
        t[b + "attn_q.weight"] = ((q, h), False)
        t[b + "attn_k.weight"] = ((kv, h), False)
        t[b + "attn_v.weight"] = ((kv, h), False)
        t[b + "attn_output.weight"] = ((h, q), False)
        if arch in ("qwen2moe", "glm4moe"):
            t[b + "attn_q.bias"] = ((q,), True)
            t[b + "attn_k.bias"] = t[b + "attn_v.bias"] = ((kv,), True)
        if arch in ("qwen3moe", "glm4moe"):
            t[b + "attn_q_norm.weight"] = t[b + "attn_k_norm.weight"] = ((hd,), True)
        t[b + ("post_attention_norm.weight" if arch == "glm4moe" else "ffn_norm.weight")] = ((h,), True)
        if arch == "llama" or (arch == "glm4moe" and i < cfg["first_k_dense_replace"]):
            ff = cfg["intermediate_size"]
            t[b + "ffn_gate.weight"] = t[b + "ffn_up.weight"] = ((ff, h), False)
            t[b + "ffn_down.weight"] = ((h, ff), False)
            continue
        ff = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        t[b + "ffn_gate_inp.weight"] = ((n_exp, h), True)
        t[b + "ffn_gate_exps.weight"] = t[b + "ffn_up_exps.weight"] = ((n_exp, ff, h), False)
        t[b + "ffn_down_exps.weight"] = ((n_exp, h, ff), False)
        sh = {"qwen2moe": cfg.get("shared_expert_intermediate_size"),
              "glm4moe": cfg.get("n_shared_experts", 0) * ff}.get(arch)
        if sh:
            t[b + "ffn_gate_shexp.weight"] = t[b + "ffn_up_shexp.weight"] = ((sh, h), False)
            t[b + "ffn_down_shexp.weight"] = ((h, sh), False)
        if arch == "qwen2moe":
            t[b + "ffn_gate_inp_shexp.weight"] = ((h,), True)
        if arch == "glm4moe":
            t[b + "exp_probs_b.bias"] = ((n_exp,), True)
    return t


EXPECTED_METADATA = {
    "llama": {"llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 96,
              "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
              "llama.rope.dimension_count": 16, "llama.attention.key_length": 16, "llama.vocab_size": 256,
              "llama.context_length": 256, "llama.rope.freq_base": 10000.0},
    "mixtral": {"llama.block_count": 2, "llama.feed_forward_length": 64, "llama.expert_count": 8,
                "llama.expert_used_count": 2, "llama.rope.dimension_count": 16, "llama.expert_gating_func": 1,
                "llama.expert_weights_norm": True},
    "qwen2moe": {"qwen2moe.expert_count": 8, "qwen2moe.expert_used_count": 2,
                 "qwen2moe.expert_feed_forward_length": 64, "qwen2moe.expert_shared_feed_forward_length": 96,
                 "qwen2moe.expert_gating_func": 1, "qwen2moe.expert_weights_norm": False,
                 "qwen2moe.rope.dimension_count": 16},
    "qwen3moe": {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2,
                 "qwen3moe.expert_feed_forward_length": 64, "qwen3moe.attention.key_length": 32,
                 "qwen3moe.attention.value_length": 32, "qwen3moe.rope.dimension_count": 32,
                 "qwen3moe.expert_weights_norm": True},
    "glm4moe": {"glm4moe.block_count": 3, "glm4moe.expert_count": 8, "glm4moe.expert_used_count": 2,
                "glm4moe.expert_shared_count": 1, "glm4moe.leading_dense_block_count": 1,
                "glm4moe.expert_feed_forward_length": 64, "glm4moe.feed_forward_length": 96,
                "glm4moe.expert_gating_func": 2, "glm4moe.expert_weights_norm": True,
                "glm4moe.expert_group_count": 2, "glm4moe.expert_group_used_count": 1,
                "glm4moe.nextn_predict_layers": 0, "glm4moe.attention.key_length": 32,
                "glm4moe.rope.dimension_count": 16},
}
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe",
             "glm4moe": "glm4moe"}


def values(g: GGUFFile, name: str) -> np.ndarray:
    """A tensor of the file as float32, numpy order."""
    ti = g.tensors[name]
    raw = np.frombuffer(g._map, np.uint8, ti.nbytes, ti.offset)
    return dequantize(raw, ti.gtype, ti.n_elements).reshape(ti.shape[::-1])


def llama_rope_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Source row of each GGUF row: per head, the halves (x0.., y0..) interleave to x0 y0 x1 y1."""
    hd = n_rows // n_heads
    return np.array([h * hd + (r % 2) * (hd // 2) + r // 2 for h in range(n_heads) for r in range(hd)])


# --- the converted files -------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("t", list(TYPES))
def test_names_shapes_types_metadata(converted, arch: str, t: str) -> None:
    g = GGUFFile(converted[arch, t])
    want = expected_tensors(arch)
    assert set(g.tensors) == set(want)
    for name, (shape, stays_f32) in want.items():
        ti = g.tensors[name]
        assert ti.shape == shape[::-1], name
        assert ti.gtype == (GGMLType.F32 if stays_f32 else TYPES[t]), name
    assert g.get("general.architecture") == GGUF_ARCH[arch]
    assert g.get("general.file_type") == FILE_TYPES[t]
    for key, value in EXPECTED_METADATA[arch].items():
        assert g.get(key) == pytest.approx(value), key
    prefix = GGUF_ARCH[arch]
    assert g.get(f"{prefix}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    if arch == "glm4moe":
        assert g.get("glm4moe.expert_weights_scale") == pytest.approx(2.5)
    if arch == "llama":
        assert g.get("llama.expert_count") is None


@pytest.mark.parametrize("arch", ARCHS)
def test_values_match_the_checkpoint(converted, arch: str) -> None:
    """f32 holds the checkpoint's values (rows permuted for llama's rope, experts stacked); the
    tiny weights lie on the Q4 grid, so f16 and q4_0 hold them exactly too, and q8_0 to its step."""
    hf = read_checkpoint(TINY / arch)
    cfg = json.loads((TINY / arch / "config.json").read_text())
    g32 = GGUFFile(converted[arch, "f32"])
    for name in ("token_embd.weight", "blk.1.attn_v.weight", "blk.1.attn_output.weight"):
        src = {"token_embd.weight": "model.embed_tokens.weight", "blk.1.attn_v.weight":
               "model.layers.1.self_attn.v_proj.weight", "blk.1.attn_output.weight":
               "model.layers.1.self_attn.o_proj.weight"}[name]
        np.testing.assert_array_equal(values(g32, name), hf[src])
    q_src, k_src = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    if GGUF_ARCH[arch] == "llama":  # NORM rope: rows interleaved per head
        q_src = q_src[llama_rope_rows(len(q_src), cfg["num_attention_heads"])]
        k_src = k_src[llama_rope_rows(len(k_src), cfg["num_key_value_heads"])]
    np.testing.assert_array_equal(values(g32, "blk.0.attn_q.weight"), q_src)
    np.testing.assert_array_equal(values(g32, "blk.0.attn_k.weight"), k_src)
    moe = {"mixtral": ("model.layers.1.block_sparse_moe.experts.{}.w3.weight", 1),
           "qwen2moe": ("model.layers.1.mlp.experts.{}.up_proj.weight", 1),
           "qwen3moe": ("model.layers.1.mlp.experts.{}.up_proj.weight", 1),
           "glm4moe": ("model.layers.2.mlp.experts.{}.up_proj.weight", 2)}.get(arch)
    if moe:
        stacked = values(g32, f"blk.{moe[1]}.ffn_up_exps.weight")
        for e in range(len(stacked)):
            np.testing.assert_array_equal(stacked[e], hf[moe[0].format(e)])
    for t in ("f16", "q4_0", "q8_0"):
        g = GGUFFile(converted[arch, t])
        for name in g.tensors:
            exact, got = values(g32, name), values(g, name)
            if t == "q8_0" and g.tensors[name].gtype == GGMLType.Q8_0:
                blocks = exact.reshape(-1, 32)
                err = np.abs(got.reshape(-1, 32) - blocks).max(axis=1)
                assert (err <= np.abs(blocks).max(axis=1) * Q8_ERROR * 1.01).all(), name
            else:
                np.testing.assert_array_equal(got, exact, err_msg=f"{t} {name}")


def test_tokenizer_and_placeholder_vocabulary(converted) -> None:
    from colibri.model.tokenizer import GGUFTokenizer

    g = GGUFFile(converted["mixtral", "q8_0"])
    assert g.get("tokenizer.ggml.model") == "gpt2"
    assert g.get("tokenizer.ggml.pre") == "gpt-2"
    tokens = g.get("tokenizer.ggml.tokens")
    assert len(tokens) == 256 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert g.get("tokenizer.ggml.token_type")[:4] == [3, 3, 3, 1]  # specials are control tokens
    assert len(g.get("tokenizer.ggml.merges")) > 0
    assert (g.get("tokenizer.ggml.bos_token_id"), g.get("tokenizer.ggml.eos_token_id")) == (1, 2)
    assert g.get("tokenizer.ggml.add_bos_token") is False
    assert "assistant" in g.get("tokenizer.chat_template")
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(TINY / "mixtral" / "tokenizer.json"))
    tok = GGUFTokenizer(g)
    for text in ("Hello world! How are you today?", "the sea is wide, 42 boats"):
        assert tok.encode(text) == hf.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    p = GGUFFile(converted["qwen3moe", "f16"])
    assert p.get("tokenizer.ggml.model") == "none"
    assert p.get("tokenizer.ggml.tokens") == [f"<tok_{i}>" for i in range(256)]
    assert p.get("tokenizer.ggml.eos_token_id") is None


def test_cli_output_and_placeholder_warning(capsys, tmp_path: Path) -> None:
    rc, out, err = coli_convert(capsys, TINY / "qwen3moe", tmp_path / "a.gguf")
    assert rc == 0
    assert out.strip().startswith(f"{tmp_path / 'a.gguf'}: qwen3moe, 27 tensors (F16 x")  # default f16
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: warning: ") and "placeholder vocabulary" in lines[0]
    rc, out, err = coli_convert(capsys, TINY / "mixtral", tmp_path / "b.gguf", "--type", "q4_0")
    assert rc == 0 and err == ""
    assert not list(tmp_path.glob("*.part"))


def test_other_tokenizers(capsys, tmp_path: Path) -> None:
    """A tokenizer convert does not write gets the placeholder with a warning; a broken one stops."""
    d = copy_tiny("mixtral", tmp_path)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["model"]["type"] = "WordPiece"
    (d / "tokenizer.json").write_text(json.dumps(tok))
    rc, _, err = coli_convert(capsys, d, tmp_path / "w.gguf")
    assert rc == 0 and "not a byte-level BPE" in err and len(err.splitlines()) == 1
    assert GGUFFile(tmp_path / "w.gguf").get("tokenizer.ggml.model") == "none"
    (d / "tokenizer.json").write_text("{")
    assert_one_error(capsys, d, tmp_path / "x.gguf", "tokenizer.json")


def test_progress_bar_on_a_terminal() -> None:
    from colibri.convert.writer import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = Progress(2, 2048, stream)
    bar.advance(1024, tensor_done=True)
    bar.advance(1024, tensor_done=True)
    bar.close()
    assert "\rconverting 100% [" in stream.getvalue() and "2/2 tensors" in stream.getvalue()


def test_bf16_and_f16_checkpoints(capsys, tmp_path: Path) -> None:
    """Half-precision checkpoints read as float32: the grid values survive either."""
    hf = read_checkpoint(TINY / "qwen3moe")
    ref = tmp_path / "ref.gguf"
    assert main(["convert", str(TINY / "qwen3moe"), "-o", str(ref), "--type", "f32"]) == 0
    for dtype in ("BF16", "F16"):
        d = tmp_path / dtype
        d.mkdir()
        shutil.copy(TINY / "qwen3moe" / "config.json", d)
        write_safetensors(d / "model.safetensors", hf, dtype)
        rc, _, _ = coli_convert(capsys, d, tmp_path / f"{dtype}.gguf", "--type", "f32")
        assert rc == 0
        a, b = GGUFFile(ref), GGUFFile(tmp_path / f"{dtype}.gguf")
        for name in ("blk.1.ffn_down_exps.weight", "token_embd.weight"):  # grid values: exact in both
            np.testing.assert_array_equal(values(a, name), values(b, name))
        norm = hf["model.norm.weight"]
        half = norm.astype(np.float16).astype(np.float32) if dtype == "F16" else \
            ((norm.view(np.uint32) >> 16) << 16).view(np.float32)
        np.testing.assert_array_equal(values(b, "output_norm.weight"), half)


def test_fused_expert_layout(capsys, tmp_path: Path) -> None:
    """transformers' fused ``experts.gate_up_proj`` / ``experts.down_proj`` convert to the same
    tensors as the per-expert checkpoint they came from."""
    hf = read_checkpoint(TINY / "qwen3moe")
    fused = {k: v for k, v in hf.items() if ".experts." not in k}
    for i in range(2):
        e = f"model.layers.{i}.mlp.experts"
        halves = [(hf[f"{e}.{x}.gate_proj.weight"], hf[f"{e}.{x}.up_proj.weight"]) for x in range(8)]
        fused[f"{e}.gate_up_proj"] = np.stack([np.concatenate(pair) for pair in halves])
        fused[f"{e}.down_proj"] = np.stack([hf[f"{e}.{x}.down_proj.weight"] for x in range(8)])
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(TINY / "qwen3moe" / "config.json", d)
    write_safetensors(d / "model.safetensors", fused)
    for t in ("f32", "q4_0"):
        assert coli_convert(capsys, TINY / "qwen3moe", tmp_path / f"a-{t}.gguf", "--type", t)[0] == 0
        assert coli_convert(capsys, d, tmp_path / f"b-{t}.gguf", "--type", t)[0] == 0
        a, b = GGUFFile(tmp_path / f"a-{t}.gguf"), GGUFFile(tmp_path / f"b-{t}.gguf")
        assert set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            np.testing.assert_array_equal(values(a, name), values(b, name), err_msg=name)


def test_llama_biases_are_permuted_like_their_rows(capsys, tmp_path: Path) -> None:
    d = copy_tiny("llama", tmp_path)
    edit_config(d, attention_bias=True)
    hf = read_checkpoint(d)
    rng = np.random.default_rng(0)
    for x, n in (("q", 64), ("k", 32), ("v", 32)):
        hf[f"model.layers.0.self_attn.{x}_proj.bias"] = rng.standard_normal(n).astype(np.float32)
        hf[f"model.layers.1.self_attn.{x}_proj.bias"] = rng.standard_normal(n).astype(np.float32)
    write_safetensors(d / "model.safetensors", hf)
    assert coli_convert(capsys, d, tmp_path / "b.gguf", "--type", "q8_0")[0] == 0
    g = GGUFFile(tmp_path / "b.gguf")
    for x, heads in (("q", 4), ("k", 2)):
        bias = hf[f"model.layers.0.self_attn.{x}_proj.bias"]
        permuted = bias[llama_rope_rows(len(bias), heads)]
        np.testing.assert_array_equal(values(g, f"blk.0.attn_{x}.bias"), permuted)
    np.testing.assert_array_equal(values(g, "blk.0.attn_v.bias"), hf["model.layers.0.self_attn.v_proj.bias"])


def test_glm4moe_nextn_layer(capsys, tmp_path: Path) -> None:
    """A GLM-4.5 multi-token-prediction layer is converted as llama.cpp expects it: counted in
    block_count and nextn_predict_layers, its own tensors under blk.N.nextn.*; llama.cpp loads the
    file and, skipping that layer, computes the same logits."""
    d = copy_tiny("glm4moe", tmp_path)
    hf = read_checkpoint(d)
    hf |= {k.replace("layers.2.", "layers.3."): v for k, v in hf.items() if k.startswith("model.layers.2.")}
    hf["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        hf[f"model.layers.3.{n}.weight"] = np.ones(64, np.float32)
    write_safetensors(d / "model.safetensors", hf)
    edit_config(d, num_nextn_predict_layers=1)
    out = tmp_path / "n.gguf"
    assert coli_convert(capsys, d, out, "--type", "f32")[0] == 0
    g = GGUFFile(out)
    assert (g.get("glm4moe.block_count"), g.get("glm4moe.nextn_predict_layers")) == (4, 1)
    assert g.tensors["blk.3.nextn.eh_proj.weight"].shape == (128, 64)
    assert {"blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight", "blk.3.nextn.shared_head_norm.weight",
            "blk.3.ffn_up_exps.weight"} <= set(g.tensors)
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = np.load(TINY / "glm4moe" / "reference.npz")
    llm = llama_cpp.Llama(str(out), n_ctx=256, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ref["prompt_ids"].tolist())
    assert np.abs(np.array(llm.scores[: len(ref["prompt_ids"])]) - ref["logits"]).max() <= LOGIT_TOLERANCE


# --- errors: one line, exit 1, nothing written -----------------------------------------------------

def assert_one_error(capsys, src: Path, out: Path, *needles: str) -> str:
    rc, stdout, err = coli_convert(capsys, src, out, "--type", "q8_0")
    lines = err.strip().splitlines()
    assert rc == 1 and stdout == ""
    assert len(lines) == 1 and lines[0].startswith("coli: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and not out.with_name(out.name + ".part").exists()
    return lines[0]


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


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


# --- llama.cpp: the proof that names, permutations and routing semantics are right ----------------

@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_agrees_with_transformers(converted, arch: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = np.load(TINY / arch / "reference.npz")
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()

    def load(t: str):
        # F32 KV cache: llama.cpp's default F16 cache alone moves logits by ~1e-2.
        return llama_cpp.Llama(str(converted[arch, t]), n_ctx=256, logits_all=True, verbose=False,
                               type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)

    llm = load("f32")
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)])
    assert np.abs(logits - ref["logits"]).max() <= LOGIT_TOLERANCE
    tokens = []
    for _ in greedy:
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    assert tokens == greedy
    for t in ("q8_0", "q4_0"):
        llm = load(t)
        llm.eval(prompt + greedy)
        top1 = np.array(llm.scores[: len(prompt) + len(greedy)]).argmax(-1)
        assert (top1 == ref["full_logits"].argmax(-1)).mean() >= MIN_QUANT_AGREEMENT, t


# --- streaming: converting a model never needs it in memory -----------------------------------------

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
