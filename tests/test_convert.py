"""``coli convert``: the tiny Hugging Face checkpoints of every architecture to GGUF, checked two
ways: the file's names, shapes, types and metadata (llama.cpp's); and its values against the
checkpoint's (exact where the format is, the llama.cpp rope permutation, expert stacking). Plus the
tokenizer, the command's output, and the checkpoint layouts and variants it reads. The errors, the
comparison with llama.cpp and the streaming of a large model have their own test_convert_*.py.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from convert_harness import (
    ARCHS,
    LOGIT_TOLERANCE,
    TINY,
    TYPES,
    assert_one_error,
    coli_convert,
    convert_every_type,
    copy_tiny,
    edit_config,
    llama_rope_rows,
    read_checkpoint,
    values,
    write_safetensors,
)

from colibri.cli import main
from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFFile

FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}
Q8_ERROR = 0.5 / 127  # Q8_0 rounds to within half a step of a block's largest magnitude / 127


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every tiny checkpoint converted to every type, once for the module."""
    return convert_every_type(tmp_path_factory.mktemp("gguf"))


# --- the expected file, written out per architecture ---------------------------------------------

def expected_tensors(arch: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (numpy shape, stays F32) for each tiny checkpoint, from llama.cpp's names."""
    cfg = json.loads((TINY / arch / "config.json").read_text())
    if arch.startswith("deepseek"):
        return expected_deepseek(cfg)
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
        if arch.startswith("olmoe"):  # over the whole width of q and of k
            t[b + "attn_q_norm.weight"], t[b + "attn_k_norm.weight"] = ((q,), True), ((kv,), True)
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


def expected_deepseek(cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """DeepSeek's layout: latent attention with kv_b_proj split per head into k_b (transposed) and
    v_b, the first layer dense, experts with shared ones (and V3's correction bias)."""
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    lora, nope = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"]
    rope, vd = cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    n_exp, ff, sh = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    t = {"token_embd.weight": ((v, h), False), "output_norm.weight": ((h,), True),
         "output.weight": ((v, h), False)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = t[b + "ffn_norm.weight"] = ((h,), True)
        if cfg["q_lora_rank"]:
            t[b + "attn_q_a.weight"] = ((cfg["q_lora_rank"], h), False)
            t[b + "attn_q_a_norm.weight"] = ((cfg["q_lora_rank"],), True)
            t[b + "attn_q_b.weight"] = ((heads * (nope + rope), cfg["q_lora_rank"]), False)
        else:
            t[b + "attn_q.weight"] = ((heads * (nope + rope), h), False)
        t[b + "attn_kv_a_mqa.weight"] = ((lora + rope, h), False)
        t[b + "attn_kv_a_norm.weight"] = ((lora,), True)
        t[b + "attn_k_b.weight"] = ((heads, lora, nope), False)
        t[b + "attn_v_b.weight"] = ((heads, vd, lora), False)
        t[b + "attn_output.weight"] = ((h, heads * vd), False)
        if i < cfg["first_k_dense_replace"]:
            t[b + "ffn_gate.weight"] = t[b + "ffn_up.weight"] = ((cfg["intermediate_size"], h), False)
            t[b + "ffn_down.weight"] = ((h, cfg["intermediate_size"]), False)
            continue
        t[b + "ffn_gate_inp.weight"] = ((n_exp, h), True)
        t[b + "ffn_gate_exps.weight"] = t[b + "ffn_up_exps.weight"] = ((n_exp, ff, h), False)
        t[b + "ffn_down_exps.weight"] = ((n_exp, h, ff), False)
        t[b + "ffn_gate_shexp.weight"] = t[b + "ffn_up_shexp.weight"] = ((sh * ff, h), False)
        t[b + "ffn_down_shexp.weight"] = ((h, sh * ff), False)
        if cfg["model_type"] == "deepseek_v3":
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
    "olmoe": {"olmoe.block_count": 2, "olmoe.expert_count": 8, "olmoe.expert_used_count": 2,
              "olmoe.feed_forward_length": 64, "olmoe.expert_gating_func": 1,
              "olmoe.expert_weights_norm": False, "olmoe.rope.dimension_count": 16},
    "olmoe_wide": {"olmoe.block_count": 3, "olmoe.expert_count": 16, "olmoe.expert_used_count": 4,
                   "olmoe.expert_gating_func": 1, "olmoe.expert_weights_norm": False},
    # one kv head: the latent (32) and the rope key (16); a query head's key 32 + 16, value 32
    "deepseek2": {"deepseek2.block_count": 3, "deepseek2.attention.head_count_kv": 1,
                  "deepseek2.attention.key_length": 48, "deepseek2.attention.value_length": 32,
                  "deepseek2.attention.key_length_mla": 48, "deepseek2.attention.value_length_mla": 32,
                  "deepseek2.attention.q_lora_rank": 0, "deepseek2.attention.kv_lora_rank": 32,
                  "deepseek2.rope.dimension_count": 16, "deepseek2.expert_count": 8,
                  "deepseek2.expert_used_count": 2, "deepseek2.expert_shared_count": 1,
                  "deepseek2.expert_feed_forward_length": 64, "deepseek2.leading_dense_block_count": 1,
                  "deepseek2.expert_gating_func": 1, "deepseek2.expert_weights_norm": False},
    "deepseek3": {"deepseek2.attention.key_length": 80, "deepseek2.attention.value_length": 64,
                  "deepseek2.attention.q_lora_rank": 32, "deepseek2.attention.kv_lora_rank": 64,
                  "deepseek2.expert_gating_func": 2, "deepseek2.expert_weights_norm": True,
                  "deepseek2.expert_weights_scale": 2.5, "deepseek2.expert_group_count": 2,
                  "deepseek2.expert_group_used_count": 1, "deepseek2.expert_shared_count": 2},
    # YaRN as llama.cpp's converter writes it: 0.1 * mscale_all_dim for the attention's scale
    "deepseek3_yarn": {"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 8.0,
                       "deepseek2.rope.scaling.original_context_length": 32,
                       "deepseek2.rope.scaling.yarn_beta_fast": 32.0,
                       "deepseek2.rope.scaling.yarn_beta_slow": 1.0,
                       "deepseek2.rope.scaling.yarn_log_multiplier": 0.0707},
}
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe",
             "glm4moe": "glm4moe", "olmoe": "olmoe", "olmoe_wide": "olmoe", "deepseek2": "deepseek2",
             "deepseek3": "deepseek2",
             "deepseek3_yarn": "deepseek2"}


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
    if arch.startswith("deepseek"):
        assert_latent_split(hf, cfg, g32)
    else:
        for name in ("token_embd.weight", "blk.1.attn_v.weight", "blk.1.attn_output.weight"):
            src = {"token_embd.weight": "model.embed_tokens.weight", "blk.1.attn_v.weight":
                   "model.layers.1.self_attn.v_proj.weight", "blk.1.attn_output.weight":
                   "model.layers.1.self_attn.o_proj.weight"}[name]
            np.testing.assert_array_equal(values(g32, name), hf[src])
        q_src = hf["model.layers.0.self_attn.q_proj.weight"]
        k_src = hf["model.layers.0.self_attn.k_proj.weight"]
        if GGUF_ARCH[arch] == "llama":  # NORM rope: rows interleaved per head
            q_src = q_src[llama_rope_rows(len(q_src), cfg["num_attention_heads"])]
            k_src = k_src[llama_rope_rows(len(k_src), cfg["num_key_value_heads"])]
        np.testing.assert_array_equal(values(g32, "blk.0.attn_q.weight"), q_src)
        np.testing.assert_array_equal(values(g32, "blk.0.attn_k.weight"), k_src)
    moe = {"mixtral": ("model.layers.1.block_sparse_moe.experts.{}.w3.weight", 1),
           "qwen2moe": ("model.layers.1.mlp.experts.{}.up_proj.weight", 1),
           "qwen3moe": ("model.layers.1.mlp.experts.{}.up_proj.weight", 1),
           "glm4moe": ("model.layers.2.mlp.experts.{}.up_proj.weight", 2),
           "olmoe": ("model.layers.1.mlp.experts.{}.up_proj.weight", 1),
           "olmoe_wide": ("model.layers.2.mlp.experts.{}.up_proj.weight", 2),
           "deepseek2": ("model.layers.1.mlp.experts.{}.up_proj.weight", 1),
           "deepseek3": ("model.layers.2.mlp.experts.{}.up_proj.weight", 2),
           "deepseek3_yarn": ("model.layers.2.mlp.experts.{}.up_proj.weight", 2)}.get(arch)
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


def assert_latent_split(hf: dict[str, np.ndarray], cfg: dict, g32: GGUFFile) -> None:
    """kv_b_proj per head: its key rows transposed into attn_k_b, its value rows into attn_v_b."""
    nope, vd = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv_b = hf["model.layers.1.self_attn.kv_b_proj.weight"].reshape(cfg["num_attention_heads"], nope + vd, -1)
    np.testing.assert_array_equal(values(g32, "blk.1.attn_k_b.weight"), kv_b[:, :nope].transpose(0, 2, 1))
    np.testing.assert_array_equal(values(g32, "blk.1.attn_v_b.weight"), kv_b[:, nope:])
    np.testing.assert_array_equal(values(g32, "blk.1.attn_kv_a_mqa.weight"),
                                  hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])


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
