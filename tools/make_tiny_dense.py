"""Make the tiny random dense checkpoints in ``tests/data/tiny_hf/`` and what llama.cpp makes of them.

One checkpoint per dense architecture family people run (qwen2, qwen3, gemma3, phi3, and llama
with Llama 3's rope scaling), built with transformers' own model classes from fixed seeds,
float32, saved with ``save_pretrained``, each with a tiny SentencePiece tokenizer
(``tokenizer.model``, BPE with byte fallback, trained here) that llama.cpp's converter reads
without a network. Beside each: transformers' reference (``reference.npz``, ``reference.json``, as
``make_tiny_moe.py`` writes them) and, with ``--llama-cpp``, the GGUF llama.cpp's own converter
writes for it at f32 (``llama_cpp.gguf``), so that tests compare ``coli convert`` with it without
torch.

The weights follow ``make_tiny_moe.py``'s rules (matrices on the Q4 grid, soft q/k, norms about 1,
seeds that leave no near tie), with two differences of these families: Gemma stores a norm weight
``w`` and scales by ``1 + w``, so its norm weights are drawn about 0; phi3's fused ``qkv_proj``
gets the q/k scale on its q and k rows.

Needs torch, transformers, safetensors, sentencepiece and protobuf (``pip install -e '.[tools]'``);
``--llama-cpp`` the directory of llama.cpp's sources (``convert_hf_to_gguf.py``, ``conversion/``,
``gguf-py/``), as llama-cpp-python's source distribution ships them under ``vendor/llama.cpp``:

    python tools/make_tiny_dense.py [--out tests/data/tiny_hf] [--only NAME ...] [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch
import transformers
from make_tiny_moe import (
    BIAS_STD,
    EMBD_STD,
    MATRIX_GAIN,
    MIN_TOP1_MARGIN,
    N_GREEDY,
    NORM_JITTER,
    QK_GAIN,
    grid,
    save_reference,
    versions,
)
from tiny_rounding import MIN_QUANT_AGREEMENT, quant_agreement

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny_hf"
GGUF_NAME = "llama_cpp.gguf"  # llama.cpp's converter's output, f32, beside the checkpoint

# SentencePiece needs 256 byte pieces for its byte fallback, so the vocabulary is 256 + the
# specials + a few dozen pieces of the training text (each of its characters is one).
VOCAB = 320
HIDDEN = 64  # every matrix input width below is a multiple of 32 (whole Q8_0/Q4_0 blocks)
MAX_POSITIONS = 256
PROMPT_LEN = 12  # BOS then PROMPT_TEXT's 11 tokens
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# Chat markers, pieces of the SentencePiece model (ids 3-7) that tokenizer_config.json declares
# special, so both converters make them control tokens. llama.cpp's vocabulary loader requires
# "<|endoftext|>" in a model whose general.name says phi3 (Phi-3's own end of text).
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
FIRST_CHAT_ID = 3
IM_END_ID = 4  # qwen3's end of turn, its eos
PROMPT_TEXT = "the sea is wide, a fox"  # 11 tokens with the dummy prefix space
TOKENIZER_TEXT = [
    "the quick brown fox jumps over the lazy dog and the cat sleeps in the sun",
    "a small model is quick to test, and its logits fit on one page of numbers",
    "hello world! how are you today? i am fine, thank you. what is the answer? it is forty two.",
    "the sea is wide, the sea is deep; it rocks the boats and sings them to sleep.",
    "experts stay on disk until a token needs them, then the router sends it there.",
    "user: write a short poem about the sea. assistant: the sea is wide and deep.",
]
TOKENIZER_REPEAT = 20  # SentencePiece's BPE counts pairs over the corpus: repeat the few lines
# A ChatML template; qwen3's opens an empty thinking block when thinking is turned off.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% endif %}", "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")

GEMMA_WINDOW = 4  # local layers see 4 positions: the reference's 28 go well past it
GEMMA_LAYERS = 6  # llama.cpp's default pattern of 6: layers 0-4 local, layer 5 global
GEMMA_HEAD_DIM = 16
# Gemma scales its (tied) embedding by sqrt(hidden) = 8 on input, so the current token's own row
# dominates the last hidden state and its logit, and a random model repeats its input. A smaller
# embedding (logits of std about 2) and post-norms that scale each layer's output by about 4 put
# the layers' work in front of it (measured: 8 distinct greedy tokens of 16 instead of 3).
GEMMA_EMBD_STD = 0.25
GEMMA_POST_NORM_MEAN = 3.0  # stored w of the post-attention and post-FFN norms: a scale 1 + w
# llama.cpp rounds a context up to a multiple of 256 and takes the long factors for a context above
# the original one: an original context of 256 (extended to 512) leaves it the short factors at 256.
PHI3_ORIGINAL_CONTEXT = 256
PHI3_LONG_CONTEXT = 512  # an extension of 2: attention factor sqrt(1 + ln 2 / ln 256)
PHI3_PARTIAL_ROTARY = 0.75  # Phi-4-mini's: 12 of head_dim 16 rotated, 6 pairs
PHI3_LONGROPE = {  # per rotated pair; transformers uses the short factors up to the original context
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": PHI3_PARTIAL_ROTARY,
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.4, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
}
LLAMA3_ROPE = {  # wavelengths of head_dim 16 at theta 5e5: 6.3, 33, 169, ...: one kept, one
    # smoothed between the two wavelength bounds (16 and 64 positions), six divided by 8
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}


@dataclass
class Dense:
    """One tiny dense architecture: its transformers classes, config and draw."""

    config_cls: str
    model_cls: str
    config: dict[str, Any]
    seed: int
    gemma_norms: bool = False  # norm weights stored as w for a 1 + w scale
    add_dummy_prefix: bool = True  # SentencePiece puts a space in front of the text
    template: str = CHAT_TEMPLATE
    eos_id: int = EOS_ID
    prompt_text: str = PROMPT_TEXT  # 11 tokens
    what: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, num_hidden_layers=2,
    intermediate_size=96, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
)

SPECS: dict[str, Dense] = {
    "qwen2": Dense("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_theta=1000000.0, tie_word_embeddings=False), seed=19,
        what="q/k/v biases, untied output, rope theta 1e6"),
    "qwen3": Dense("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=IM_END_ID), seed=9,
        template=THINKING_TEMPLATE, eos_id=IM_END_ID,
        what="q/k norms, head_dim 32 (q width 128), tied, a thinking chat template"),
    "gemma3": Dense("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=GEMMA_LAYERS, num_attention_heads=2, num_key_value_heads=1,
        head_dim=GEMMA_HEAD_DIM, query_pre_attn_scalar=GEMMA_HEAD_DIM, intermediate_size=32,
        sliding_window=GEMMA_WINDOW, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        seed=10, gemma_norms=True, add_dummy_prefix=False, prompt_text="hello world, the sea",
        what="6 layers (5 local of window 4, 1 global), local rope base 1e4, global 1e5 with linear "
             "scaling 2, head_dim 16 (2 heads, 1 kv head), pre/post norms, GELU-tanh, tied"),
    "phi3": Dense("Phi3Config", "Phi3ForCausalLM", dict(
        rope_theta=10000.0, original_max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False),
        seed=20, what="fused qkv_proj and gate_up_proj, untied"),
    "phi3_longrope": Dense("Phi3Config", "Phi3ForCausalLM", dict(
        rope_parameters=PHI3_LONGROPE, partial_rotary_factor=PHI3_PARTIAL_ROTARY,
        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT, max_position_embeddings=PHI3_LONG_CONTEXT,
        tie_word_embeddings=True), seed=5,
        what="Phi-4-mini's shape: long-context rope (longrope, context 512 from 256; the short factors "
             "up to 256 positions, the long ones above), rotary over 3/4 of each head, tied"),
    "llama3": Dense("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True), seed=5,
        what="Llama 3's rope scaling (factor 8, original context 64), tied"),
}


# --- the tokenizer ----------------------------------------------------------------------------

def train_tokenizer(add_dummy_prefix: bool) -> bytes:
    """A SentencePiece BPE model of VOCAB pieces with byte fallback, as Llama 2 and Gemma ship."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT * TOKENIZER_REPEAT), model_writer=buf, vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, unk_id=UNK_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, pad_id=-1, user_defined_symbols=CHAT_TOKENS, num_threads=1, minloglevel=2,
    )
    model = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=model)
    chat = [sp.id_to_piece(FIRST_CHAT_ID + i) for i in range(len(CHAT_TOKENS))]
    if sp.vocab_size() != VOCAB or chat != CHAT_TOKENS:
        raise SystemExit("make_tiny_dense: the tokenizer's vocabulary is not as expected")
    return model


def prompt_ids(model: bytes, text: str) -> list[int]:
    ids = spm.SentencePieceProcessor(model_proto=model).encode(text)
    if len(ids) != PROMPT_LEN - 1:
        raise SystemExit(f"make_tiny_dense: {text!r} is {len(ids)} tokens, not {PROMPT_LEN - 1}")
    return [BOS_ID, *ids]


def save_tokenizer(out: Path, model: bytes, spec: Dense) -> None:
    (out / "tokenizer.model").write_bytes(model)
    config = {
        "tokenizer_class": "LlamaTokenizer",  # phi3's converter reads it
        "bos_token": "<s>", "eos_token": "<|im_end|>" if spec.eos_id == IM_END_ID else "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "model_max_length": MAX_POSITIONS, "chat_template": spec.template,
        "added_tokens_decoder": {
            str(FIRST_CHAT_ID + i): {"content": t, "special": True} for i, t in enumerate(CHAT_TOKENS)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- the model ----------------------------------------------------------------------------------

def init_weights(model: torch.nn.Module, spec: Dense) -> None:
    """Overwrite transformers' near-zero init with scales under which every weight matters."""
    gen = torch.Generator().manual_seed(spec.seed)
    cfg = model.config

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    def on_grid(t: torch.Tensor, std: float) -> None:
        t.copy_(grid(tuple(t.shape), std, gen))

    with torch.no_grad():
        for name, t in sorted(model.named_parameters(), key=lambda item: item[0]):
            fan_in = t.shape[-1]
            if spec.gemma_norms and name.endswith(("post_attention_layernorm.weight",
                                                   "post_feedforward_layernorm.weight")):
                normal(t, NORM_JITTER, GEMMA_POST_NORM_MEAN)
            elif name.endswith("norm.weight"):
                normal(t, NORM_JITTER, 0.0 if spec.gemma_norms else 1.0)
            elif name.endswith(".bias"):
                normal(t, BIAS_STD)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                on_grid(t, GEMMA_EMBD_STD if spec.gemma_norms else EMBD_STD)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                on_grid(t, QK_GAIN / fan_in**0.5)
            elif name.endswith("qkv_proj.weight"):  # phi3: q and k rows soft, v rows as any matrix
                head_dim = cfg.hidden_size // cfg.num_attention_heads
                qk_rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * head_dim
                on_grid(t[:qk_rows], QK_GAIN / fan_in**0.5)
                on_grid(t[qk_rows:], MATRIX_GAIN / fan_in**0.5)
            elif t.dim() == 2:
                on_grid(t, MATRIX_GAIN / fan_in**0.5)
            else:
                raise SystemExit(f"make_tiny_dense: no init rule for {name} {tuple(t.shape)}")


def build_model(spec: Dense) -> torch.nn.Module:
    torch.manual_seed(spec.seed)
    config = getattr(transformers, spec.config_cls)(**COMMON | spec.config)
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.model_cls)(config).eval()
    init_weights(model, spec)
    return model


def run_reference(name: str, model: torch.nn.Module, ids: list[int]) -> dict[str, Any]:
    """The prompt's logits, the greedy continuation (generate(), with its cache) and the logits of
    one uncached pass over both, which must choose the same tokens."""
    prompt = torch.tensor([ids])
    gen_config = transformers.GenerationConfig(max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY,
                                               do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        logits = model(prompt).logits[0].float()
        greedy = [int(i) for i in model.generate(prompt, generation_config=gen_config)[0, PROMPT_LEN:]]
        sequence = torch.tensor([ids + greedy])
        full_logits = model(sequence).logits[0].float()
    argmax = full_logits[PROMPT_LEN - 1 : -1].argmax(-1).tolist()
    if argmax != greedy:
        raise SystemExit(f"make_tiny_dense: {name}: generate() {greedy} != forward argmax {argmax}")
    top2 = full_logits[:-1].topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    agreement = quant_agreement(model, sequence, full_logits)
    if margin < MIN_TOP1_MARGIN or min(agreement.values()) < MIN_QUANT_AGREEMENT:
        raise SystemExit(f"make_tiny_dense: {name}: top-1 margin {margin:.2e}, quantized agreement "
                         f"{agreement}; change the seed")
    return dict(prompt=prompt, logits=logits, greedy=greedy, full_logits=full_logits, margin=margin,
                agreement=agreement, sequence=sequence)


# ggml's CPU GELU looks its value up in a table of float16 inputs and outputs (inputs beyond +-10
# taken as 0 or x): llama.cpp's logits of a GELU model then differ from transformers' by a few 1e-4.
GGML_GELU_LIMIT = 10.0


class GgmlGelu(torch.nn.Module):
    """The tanh GELU as ggml's CPU backend computes it (GGML_GELU_FP16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -GGML_GELU_LIMIT, 0.0 * x, torch.where(x >= GGML_GELU_LIMIT, x, y))


def extra_references(spec: Dense, model: torch.nn.Module, sequence: torch.Tensor) -> dict[str, np.ndarray]:
    """Logits over the whole sequence under a variant a peer computes: gemma3's with ggml's GELU
    (``full_logits_gelu_f16``), a longrope model's with its long factors (``full_logits_long``,
    what transformers computes past the original context and llama.cpp in a longer one)."""
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        if spec.gemma_norms:
            acts = [layer.mlp.act_fn for layer in model.model.layers]
            for layer in model.model.layers:
                layer.mlp.act_fn = GgmlGelu()
            out["full_logits_gelu_f16"] = model(sequence).logits[0].float().numpy()
            for layer, act in zip(model.model.layers, acts, strict=True):
                layer.mlp.act_fn = act
        rope = model.config.rope_parameters
        if rope.get("rope_type") == "longrope":  # an original context of 0: every position is past it
            orig, rope["original_max_position_embeddings"] = rope["original_max_position_embeddings"], 0
            out["full_logits_long"] = model(sequence).logits[0].float().numpy()
            rope["original_max_position_embeddings"] = orig
    return out


def llama_cpp_convert(ckpt: Path, llama_cpp: Path) -> None:
    """``llama_cpp.gguf``: llama.cpp's own converter's f32 output for the checkpoint in ``ckpt``."""
    env = {**os.environ, "PYTHONPATH": f"{llama_cpp / 'gguf-py'}{os.pathsep}{llama_cpp}",
           "NO_LOCAL_GGUF": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / GGUF_NAME
        run = subprocess.run(
            [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(ckpt), "--outfile", str(out),
             "--outtype", "f32"], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"make_tiny_dense: llama.cpp's converter refused {ckpt}:\n{run.stderr[-3000:]}")
        shutil.move(out, ckpt / GGUF_NAME)


def make(name: str, out_root: Path, llama_cpp: Path | None) -> None:
    spec = SPECS[name]
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer = train_tokenizer(spec.add_dummy_prefix)
    model = build_model(spec)
    r = run_reference(name, model, prompt_ids(tokenizer, spec.prompt_text))
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)  # not part of what convert reads
    save_tokenizer(out, tokenizer, spec)
    ref = {
        "architecture": spec.model_cls, "what": spec.what, "prompt_text": spec.prompt_text,
        "prompt_ids": r["prompt"][0].tolist(), "greedy_ids": r["greedy"],
        "min_top1_margin": round(r["margin"], 6), "simulated_top1_agreement": r["agreement"],
        "versions": versions() | {"sentencepiece": spm.__version__},
    }
    save_reference(out, ref, r["prompt"], r["logits"], r["greedy"], r["full_logits"])
    extra = extra_references(spec, model, r["sequence"])
    if extra:  # beside make_tiny_moe's arrays
        with np.load(out / "reference.npz") as npz:
            arrays = dict(npz)
        arrays |= {k: v.astype(np.float32) for k, v in extra.items()}
        np.savez_compressed(out / "reference.npz", **arrays)
    if llama_cpp is not None:
        llama_cpp_convert(out, llama_cpp)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name:7s} {size / 1e6:.2f} MB  greedy {r['greedy']}  top-1 margin {r['margin']:.3f}  "
          f"agreement {r['agreement']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--only", nargs="+", choices=sorted(SPECS), help="make only these")
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's source directory: also write llama_cpp.gguf")
    a = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for name in a.only or SPECS:
        make(name, a.out, a.llama_cpp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
