"""Shared by the ``coli convert`` tests: the tiny Hugging Face checkpoints, an independent
safetensors reader and writer, running the conversion, and reading a converted file's values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from colibri.cli import main
from colibri.store.blocks import dequantize
from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFFile

TINY = Path(__file__).parent / "data" / "tiny_hf"
ARCHS = ["llama", "mixtral", "qwen2moe", "qwen3moe", "glm4moe", "olmoe", "olmoe_wide",
         "deepseek2", "deepseek3", "deepseek3_yarn"]
TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
LOGIT_TOLERANCE = 1e-3  # max |llama.cpp - transformers| over the prompt's logits (f32 file)


# --- an independent safetensors reader and writer --------------------------------------------------

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


def convert_every_type(out_dir: Path) -> dict[tuple[str, str], Path]:
    """Every tiny checkpoint converted to every type, into ``out_dir``."""
    files = {}
    for arch in ARCHS:
        for t in TYPES:
            out = out_dir / f"{arch}-{t}.gguf"
            assert main(["convert", str(TINY / arch), "-o", str(out), "--type", t]) == 0
            files[arch, t] = out
    return files


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def assert_one_error(capsys, src: Path, out: Path, *needles: str) -> str:
    """Errors: one line, exit 1, nothing written."""
    rc, stdout, err = coli_convert(capsys, src, out, "--type", "q8_0")
    lines = err.strip().splitlines()
    assert rc == 1 and stdout == ""
    assert len(lines) == 1 and lines[0].startswith("coli: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and not out.with_name(out.name + ".part").exists()
    return lines[0]


def values(g: GGUFFile, name: str) -> np.ndarray:
    """A tensor of the file as float32, numpy order."""
    ti = g.tensors[name]
    raw = np.frombuffer(g._map, np.uint8, ti.nbytes, ti.offset)
    return dequantize(raw, ti.gtype, ti.n_elements).reshape(ti.shape[::-1])


def llama_rope_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Source row of each GGUF row: per head, the halves (x0.., y0..) interleave to x0 y0 x1 y1."""
    hd = n_rows // n_heads
    return np.array([h * hd + (r % 2) * (hd // 2) + r // 2 for h in range(n_heads) for r in range(hd)])


# --- checkpoints as transformers saves them (tests/test_convert_checkpoints.py) -------------------

def plan_of(d: Path):
    """The conversion plan of the checkpoint in ``d`` (its warnings, metadata, tensors), no file."""
    from colibri.convert.architectures import make_plan
    from colibri.convert.safetensors import Checkpoint

    ckpt = Checkpoint(d)
    try:
        return make_plan(json.loads((d / "config.json").read_text()),
                         {n: e.shape for n, e in ckpt.entries.items()})
    finally:
        ckpt.close()


def assert_same_tensors(a: Path, b: Path) -> None:
    """Two GGUF files hold the same tensors: names, types and values."""
    ga, gb = GGUFFile(a), GGUFFile(b)
    assert set(ga.tensors) == set(gb.tensors)
    for name, ti in ga.tensors.items():
        assert gb.tensors[name].gtype == ti.gtype, name
        np.testing.assert_array_equal(values(ga, name), values(gb, name), err_msg=name)


# --- a wider random MoE checkpoint (tests/test_kquants_wide.py) ----------------------------------

# qwen2moe (routed experts and a sigmoid-gated shared expert) whose every matrix row length is a
# multiple of 256, so that llama.cpp's K-quant mixtures give real K-quant blocks to every matrix.
WIDE_MOE = dict(hidden_size=512, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                moe_intermediate_size=256, shared_expert_intermediate_size=512, intermediate_size=512,
                num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, vocab_size=640,
                max_position_embeddings=512)


def make_wide_moe(d: Path, seed: int = 0, layer_std: float = 0.75, output_std: float = 0.5,
                  **changes) -> Path:
    """A Hugging Face qwen2moe directory: tiny_hf/qwen2moe's config with ``WIDE_MOE`` (and
    ``changes``), Gaussian weights. Matrices have std ``layer_std / sqrt(fan_in)`` (q and k
    ``1 / sqrt(fan_in)``: soft attention); the output matrix ``output_std``, so that the logits
    are confident (logit std about ``output_std * sqrt(hidden)``); routers give logits of std 4."""
    cfg = {**json.loads((TINY / "qwen2moe" / "config.json").read_text()), **WIDE_MOE, **changes}
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    h, hd, n_exp = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(rows: int, cols: int, std: float | None = None) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * (layer_std / cols**0.5 if std is None else std)

    def vec(n: int, mean: float, std: float) -> np.ndarray:  # norm weights, biases
        return mean + std * rng.standard_normal(n)

    def swiglu(prefix: str, n_ff: int) -> dict[str, np.ndarray]:
        return {prefix + "gate_proj.weight": w(n_ff, h), prefix + "up_proj.weight": w(n_ff, h),
                prefix + "down_proj.weight": w(h, n_ff)}

    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], h, 1.0), "model.norm.weight": vec(h, 1, 0.1),
         "lm_head.weight": w(cfg["vocab_size"], h, output_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}{norm}.weight"] = vec(h, 1, 0.1)
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            t[f"{p}self_attn.{x}_proj.weight"] = w(rows, h, None if x == "v" else h**-0.5)
            t[f"{p}self_attn.{x}_proj.bias"] = vec(rows, 0, 0.2)
        t |= {p + "self_attn.o_proj.weight": w(h, q), p + "mlp.gate.weight": w(n_exp, h, 4 * h**-0.5),
              p + "mlp.shared_expert_gate.weight": w(1, h, h**-0.5),
              **swiglu(p + "mlp.shared_expert.", cfg["shared_expert_intermediate_size"])}
        for e in range(n_exp):
            t |= swiglu(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
    write_safetensors(d / "model.safetensors", {n: a.astype(np.float32) for n, a in t.items()})
    return d


# --- the dense checkpoints and llama.cpp's own conversion of each (tools/make_tiny_dense.py) -------

# Made by tools/make_tiny_dense.py, each with llama.cpp's converter's f32 output beside it.
DENSE = ["qwen2", "qwen3", "gemma3", "phi3", "phi3_longrope", "llama3"]
LLAMA_CPP_GGUF = "llama_cpp.gguf"
# max |logits - reference| / max |reference|: what an f32 file computed in float32 must meet.
DENSE_LOGIT_TOLERANCE = 1e-4


def logit_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest logit error relative to the reference's scale (its largest magnitude)."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def dense_conversions(out_dir: Path) -> list[tuple[str, Path, Path, dict[str, np.ndarray]]]:
    """For each dense checkpoint: (name, ``coli convert``'s f32 output written into ``out_dir``,
    llama.cpp's converter's f32 output, the reference arrays of reference.npz).

    The arrays: ``prompt_ids``, ``logits`` (the prompt's), ``greedy_ids``, ``full_logits`` (prompt
    plus greedy continuation, one pass), all transformers' in float32. Two checkpoints add what a
    peer computes differently: gemma3's ``full_logits_gelu_f16``, with the GELU rounded as ggml's
    CPU table rounds it (llama.cpp meets it within 1e-5, but ``full_logits`` only within ~3e-4), and
    phi3_longrope's ``full_logits_long``, with the long rope factors, which transformers uses past
    the original context (256) and llama.cpp in a context above it (``full_logits`` holds the short
    ones: llama.cpp uses them in a context of up to 256)."""
    out = []
    for name in DENSE:
        path = out_dir / f"{name}.gguf"
        assert main(["convert", str(TINY / name), "-o", str(path), "--type", "f32"]) == 0
        with np.load(TINY / name / "reference.npz") as npz:
            out.append((name, path, TINY / name / LLAMA_CPP_GGUF, dict(npz)))
    return out
