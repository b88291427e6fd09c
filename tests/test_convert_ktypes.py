"""``coli convert --type q4_k_m`` (and the other K-quant mixtures) against llama.cpp's own quantizer:
the same block type for every tensor, the same bytes, and the file loads and runs in llama.cpp.

llama.cpp quantizes ``coli convert``'s F32 file (``llama_model_quantize``, no importance matrix);
its output and ours are read back with gguf-py and compared name by name. The checkpoints are made
here, small but with llama.cpp's cases: rows that are whole 256-blocks and rows that are not (the
Q5_0 / Q8_0 / F16 fallbacks), tied and untied embeddings, the use_more_bits layers, and an
8-expert model (Mixtral's rules). Those need llama-cpp-python (skipped without it); the rules'
own cases below do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from convert_harness import ARCHS, TINY, write_safetensors

from colibri.cli import main
from colibri.convert.mixture import ModelFacts, mixture_type, use_more_bits
from colibri.store.formats import GGMLType

FT = gguf.LlamaFileType

FTYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
          "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
# name -> (tiny checkpoint whose config is the base, config changes)
MODELS = {
    # dense, tied embeddings; ffn_down rows of 320: Q5_0 / Q8_0 by fallback
    "llama": ("llama", dict(hidden_size=256, intermediate_size=320, num_hidden_layers=8, head_dim=64,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
    # 2 experts, 4 layers: ffn_down_exps by the layer in its name (use_more_bits: layers 2, 3)
    "moe2": ("qwen3moe", dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4,
                              head_dim=64, num_local_experts=2, num_experts_per_tok=2, vocab_size=320)),
    # 8 experts (Mixtral's rules: attn_v, attn_k Q8_0, attn_output Q5_K); expert rows of 200: F16
    "moe8": ("qwen3moe", dict(hidden_size=256, moe_intermediate_size=200, num_hidden_layers=3,
                              head_dim=64, num_local_experts=8, vocab_size=320)),
}
PROMPT = [1, 17, 42, 99, 7, 256, 3, 128, 64, 11, 5, 200]
LOGIT_TOLERANCE = 1e-5  # q4_k_m against llama.cpp's own q4_k_m: the same bytes, the same logits
MAX_RELATIVE_ERROR = 0.35  # rms(q4_k_m - f32) / rms(f32): ~0.22 on these random weights


def make_checkpoint(d: Path, model: str) -> Path:
    """A Hugging Face directory for ``model``: the base config with the changes, random weights."""
    base, changes = MODELS[model]
    cfg = {**json.loads((TINY / base / "config.json").read_text()), **changes}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(sum(map(ord, model)))
    h, hd, nl = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
                                          "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(nl):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if base == "llama":
            ff = cfg["intermediate_size"]
            shapes |= {p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff)}
            continue
        ff, n_exp = cfg["moe_intermediate_size"], cfg["num_local_experts"]
        shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate.weight": (n_exp, h)}
        for e in range(n_exp):
            shapes |= {f"{p}mlp.experts.{e}.gate_proj.weight": (ff, h),
                       f"{p}mlp.experts.{e}.up_proj.weight": (ff, h),
                       f"{p}mlp.experts.{e}.down_proj.weight": (h, ff)}
    tensors = {n: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.05 * rng.standard_normal(s))
               for n, s in shapes.items()}
    write_safetensors(d / "model.safetensors", {n: a.astype(np.float32) for n, a in tensors.items()})
    return d


def quantize_both(src: Path, root: Path, name: str,
                  mixtures: tuple[str, ...] = tuple(FTYPES)) -> dict[str, Path]:
    """``src`` converted by coli convert to f32 and the mixtures, and llama.cpp's quantization of
    the f32 file to them ("llama.cpp-" + mixture)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the reference) not installed")
    out: dict[str, Path] = {}
    for t in ("f32", *mixtures):
        out[t] = root / f"{name}-{t}.gguf"
        assert main(["convert", str(src), "-o", str(out[t]), "--type", t]) == 0
    for t in mixtures:
        out["llama.cpp-" + t] = root / f"{name}-llama.cpp-{t}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = getattr(llama_cpp, FTYPES[t]), 1, True
        rc = llama_cpp.llama_model_quantize(str(out["f32"]).encode(), str(out["llama.cpp-" + t]).encode(),
                                            params)
        assert rc == 0, f"llama.cpp could not quantize {name} to {t}"
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Per model of MODELS, and per tiny checkpoint ("tiny-" + arch): ``quantize_both``."""
    root = tmp_path_factory.mktemp("ktypes")
    out: dict[tuple[str, str], Path] = {}
    for model in MODELS:
        for t, path in quantize_both(make_checkpoint(root / model, model), root, model).items():
            out[model, t] = path
    for arch in ARCHS:  # rows of 64: every tensor by fallback, but every architecture's names
        for t, path in quantize_both(TINY / arch, root, "tiny-" + arch, ("q4_k_m",)).items():
            out["tiny-" + arch, t] = path
    return out


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """Every tensor of a GGUF file: its type's name and its bytes."""
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)))
            for t in reader.tensors}


@pytest.mark.parametrize(("model", "ftype"), [*((m, t) for m in MODELS for t in FTYPES),
                                              *((f"tiny-{a}", "q4_k_m") for a in ARCHS)])
def test_types_and_bytes_are_llama_cpps(files, model: str, ftype: str) -> None:
    ours, theirs = tensors(files[model, ftype]), tensors(files[model, "llama.cpp-" + ftype])
    assert sorted(ours) == sorted(theirs)
    types = {n: ours[n][0] for n in ours}
    assert types == {n: theirs[n][0] for n in theirs}
    assert [n for n in ours if ours[n][1] != theirs[n][1]] == []


def test_the_models_cover_llama_cpps_cases(files) -> None:
    """The comparison above is only as good as the types it meets: every rule shows up."""
    seen = {(m, t, n): typ for m in MODELS for t in FTYPES for n, (typ, _) in tensors(files[m, t]).items()}
    assert seen["llama", "q4_k_m", "token_embd.weight"] == "Q6_K"  # tied: the output's type
    assert seen["llama", "q4_k_m", "blk.0.attn_v.weight"] == "Q6_K"  # use_more_bits
    assert seen["llama", "q4_k_m", "blk.1.attn_v.weight"] == "Q4_K"
    assert seen["llama", "q4_k_m", "blk.0.ffn_down.weight"] == "Q8_0"  # Q6_K's fallback (320 cols)
    assert seen["llama", "q4_k_m", "blk.1.ffn_down.weight"] == "Q5_0"  # Q4_K's fallback
    assert seen["llama", "q5_k_m", "blk.1.ffn_down.weight"] == "Q5_1"  # Q5_K's fallback
    assert seen["llama", "q4_k_s", "blk.3.attn_v.weight"] == "Q5_K"
    assert seen["moe2", "q4_k_m", "blk.2.ffn_down_exps.weight"] == "Q6_K"
    assert seen["moe2", "q4_k_m", "blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert seen["moe2", "q4_k_m", "output.weight"] == "Q6_K"
    assert seen["moe2", "q4_k_m", "token_embd.weight"] == "Q4_K"  # untied: the mixture's type
    assert seen["moe8", "q4_k_m", "blk.1.attn_v.weight"] == "Q8_0"  # 8 experts
    assert seen["moe8", "q4_k_m", "blk.1.attn_k.weight"] == "Q8_0"
    assert seen["moe8", "q4_k_m", "blk.1.attn_output.weight"] == "Q5_K"
    assert seen["moe8", "q4_k_m", "blk.1.ffn_down_exps.weight"] == "F16"  # 200 cols: no 32-blocks
    assert seen["moe8", "q4_k_m", "blk.1.ffn_gate_inp.weight"] == "F32"  # routers stay F32


def _logits(path: Path) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(PROMPT)
    return np.array(llm.scores[: len(PROMPT)])


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


@pytest.mark.parametrize("model", MODELS)
def test_q4_k_m_runs_in_llama_cpp(files, model: str) -> None:
    """Our q4_k_m file loads in llama.cpp and gives the logits of llama.cpp's own q4_k_m file,
    near the f32 file's."""
    ours, theirs, f32 = (_logits(files[model, t]) for t in ("q4_k_m", "llama.cpp-q4_k_m", "f32"))
    assert np.isfinite(ours).all()
    assert np.abs(ours - theirs).max() <= LOGIT_TOLERANCE
    assert _rms(ours - f32) / _rms(f32) <= MAX_RELATIVE_ERROR


# -- the rules' own cases, llama.cpp or not -------------------------------------------------------


def test_use_more_bits_is_llama_cpps_schedule() -> None:
    """32 layers: the first and last four, and every third from layer 6."""
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                             28, 29, 30, 31]


@pytest.mark.parametrize(("name", "shape", "ftype", "facts", "want"), [
    ("blk.20.attn_v.weight", (1024, 8192), FT.MOSTLY_Q4_K_M, ModelFacts(80, llama_70b=True), GGMLType.Q5_K),
    ("blk.12.attn_v.weight", (1024, 8192), FT.MOSTLY_Q4_K_M, ModelFacts(80, llama_70b=True), GGMLType.Q6_K),
    ("blk.3.attn_v.weight", (512, 4096), FT.MOSTLY_Q4_K_S, ModelFacts(32), GGMLType.Q5_K),
    ("blk.4.attn_v.weight", (512, 4096), FT.MOSTLY_Q4_K_S, ModelFacts(32), GGMLType.Q4_K),
    ("blk.3.ffn_down.weight", (4096, 11008), FT.MOSTLY_Q4_K_S, ModelFacts(32), GGMLType.Q5_K),
    ("blk.4.ffn_down.weight", (4096, 11008), FT.MOSTLY_Q4_K_S, ModelFacts(32), GGMLType.Q4_K),
    ("blk.1.ffn_down_exps.weight", (8, 4096, 14336), FT.MOSTLY_Q5_K_M, ModelFacts(32, 8), GGMLType.Q6_K),
    ("blk.9.attn_output.weight", (4096, 4096), FT.MOSTLY_Q5_K_M, ModelFacts(32, 8), GGMLType.Q5_K),
    ("token_embd.weight", (49152, 576), FT.MOSTLY_Q4_K_M, ModelFacts(30, tied=True), GGMLType.Q8_0),
    ("token_embd.weight", (49152, 576), FT.MOSTLY_Q4_K_M, ModelFacts(30), GGMLType.Q5_0),
    ("output.weight", (32000, 4096), FT.MOSTLY_Q6_K, ModelFacts(32), GGMLType.Q6_K),
    ("blk.0.ffn_down.weight", (576, 1540), FT.MOSTLY_Q6_K, ModelFacts(30), GGMLType.F16),
    ("blk.0.attn_q.weight", (576, 576), FT.MOSTLY_Q5_K_M, ModelFacts(30), GGMLType.Q5_1),
])
def test_rules(name: str, shape: tuple[int, ...], ftype: FT, facts: ModelFacts, want: GGMLType) -> None:
    assert mixture_type(name, shape, ftype, facts) == want


def test_other_mixtures_and_layerless_names_are_refused() -> None:
    with pytest.raises(ValueError, match="MOSTLY_Q3_K_M"):
        mixture_type("blk.0.attn_q.weight", (256, 256), FT.MOSTLY_Q3_K_M, ModelFacts(1))
    with pytest.raises(ValueError, match="no layer"):
        mixture_type("blk.9.ffn_down.weight", (256, 256), FT.MOSTLY_Q4_K_M, ModelFacts(4))
