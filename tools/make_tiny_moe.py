"""Make the tiny random Hugging Face checkpoints in ``tests/data/tiny_hf/`` and their references.

One checkpoint per architecture ``coli convert`` reads (llama, mixtral, qwen2moe, qwen3moe, glm4moe,
olmoe, gpt_oss; deepseek2 and deepseek3, DeepSeek's V2 and V3 layouts of the GGUF ``deepseek2``),
built with transformers' own model classes from fixed seeds, float32, saved with ``save_pretrained``
(config.json plus safetensors; qwen2moe in two shards with an index). Beside each, the reference
that transformers computes with eager attention: a fixed prompt of token ids, the logits at every
prompt position, the greedy continuation of ``N_GREEDY`` tokens, and the logits of one forward pass
over prompt plus continuation. The mixtral checkpoint also carries a small byte-level BPE tokenizer
(tokenizer.json, tokenizer_config.json with a chat template); the others have none.

Random weights are scaled so that mistakes show: matrices of std about MATRIX_GAIN / sqrt(fan_in)
on the Q4 grid (so Q4 and F16 conversions are exact, see BLOCK), norm weights around 1, decisive
routers, random score-correction biases. The script refuses a model whose routing or greedy
choice is a near tie (``MIN_ROUTING_MARGIN``, ``MIN_TOP1_MARGIN``), so that a converter or forward
pass right to float32 rounding reproduces every choice, or whose top-1 choices do not survive the
matrices rounded to Q8_0 and Q4_0 (``tiny_rounding``; gpt-oss's experts lie on MXFP4's grid instead).

Needs torch, transformers and safetensors (``pip install -e '.[tools]'``, best in a separate venv):

    python tools/make_tiny_moe.py [--out tests/data/tiny_hf] [--only ARCH ...]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from tiny_rounding import MIN_QUANT_AGREEMENT, ROUNDINGS, is_expert, is_router, mxfp4_grid, quant_agreement
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny_hf"

VOCAB = 256  # token ids; the output matrix has this many rows
HIDDEN = 64  # every matmul input width is a multiple of 32, so q4/q8 blocks fit whole rows
N_HEADS, N_KV_HEADS = 4, 2
MAX_POSITIONS = 256
ROPE_THETA = 10000.0
N_EXPERTS, TOP_K = 8, 2

PROMPT_LEN = 12  # prompt ids: BOS_ID, then random ids
BOS_ID = 1  # "<s>" in the mixtral tokenizer; an ordinary id for the others
N_GREEDY = 16  # greedy continuation length
PROMPT_SEED = 1234

# Weight scales. A gain of 1 or less gives a near-linear network whose greedy output repeats one
# id; 2 a mildly chaotic one (make_tiny_llama.py measured the same).
MATRIX_GAIN = 2.0
# Quantizable matrices are drawn on the Q4 grid: every block of BLOCK values along a row is
# k * 2^-n with integers k in [-8, 7], holding both -8 (its only largest magnitude) and 7. Q4_0,
# Q4_1 and F16 then store them exactly, so a quantized conversion differs from the reference only
# through Q8_0's rounding and the arithmetic; Gaussian weights lose so much to Q4 rounding that
# a random model's top-1 choice (gaps of a fraction of a logit among 256 tokens) flips at most
# positions. Routers and vectors stay Gaussian: they are F32 in every conversion.
BLOCK = 32
Q_MIN, Q_MAX = -8, 7
Q_INT_STD = 4.0  # about the std of uniform integers in [Q_MIN, Q_MAX]
# q and k projections: attention scores of std about 1. Sharper attention (std 4 at MATRIX_GAIN)
# switches its target on a rounding error, which makes Q8_0's 0.5% flip a quarter of the argmaxes.
QK_GAIN = 1.0
EMBD_STD = 0.3  # embedding and output rows: logits spread about 2-3
NORM_JITTER = 0.1  # norm weights are 1 + N(0, NORM_JITTER^2)
BIAS_STD = 0.2  # attention projection biases
SOFTMAX_ROUTER_GAIN = 4.0  # router logits std about 4: softmax top-k is decisive
SIGMOID_ROUTER_GAIN = 2.0  # sigmoid scores spread over (0.1, 0.9) instead of saturating at 1
SCORE_BIAS_STD = 0.1  # glm4moe e_score_correction_bias

# A routing choice closer than this (softmax: router logits; sigmoid: biased scores) or a greedy
# argmax closer than MIN_TOP1_MARGIN (logits) could go either way in float32 arithmetic.
MIN_ROUTING_MARGIN = {"softmax": 1e-3, "sigmoid": 1e-4}
MIN_TOP1_MARGIN = 1e-3

SHARDED = "qwen2moe"  # saved in two safetensors shards with model.safetensors.index.json
N_SHARDS = 2
WITH_TOKENIZER = "mixtral"

# Fixed text the tokenizer is trained on (its characters are the tokenizer's whole alphabet).
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few",
    "of its experts, and the router decides which ones. Experts that are not needed stay on disk.",
    "Hello world! How are you today? I am fine, thank you. What is the answer? It is 42, of course.",
    "Small models are fast to test: they load in a millisecond and their logits fit on one page.",
    "user: write a short poem about the sea\nassistant: the sea is wide, the sea is deep, it rocks",
    "the boats and sings them to sleep. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: ()[]{}<>",
]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@dataclass
class Spec:
    """One tiny architecture: the transformers classes and their config."""

    config_cls: str
    model_cls: str
    config: dict[str, Any]
    router: str = "softmax"  # "softmax" or "sigmoid" (glm4moe)
    seed: int = 0
    quant: tuple[str, ...] = tuple(ROUNDINGS)  # the simulated roundings it must survive (tiny_rounding)
    extra: dict[str, Any] = field(default_factory=dict)


COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS,
    max_position_embeddings=MAX_POSITIONS, rope_theta=ROPE_THETA, rms_norm_eps=1e-5,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

SPECS: dict[str, Spec] = {
    # Dense llama with tied embeddings: the checkpoint has no lm_head.
    "llama": Spec("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=True), seed=6),
    "mixtral": Spec("MixtralConfig", "MixtralForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=64, num_local_experts=N_EXPERTS, num_experts_per_tok=TOP_K,
        bos_token_id=1, eos_token_id=2), seed=12),
    # Softmax top-k without renormalisation, plus a sigmoid-gated shared expert; q/k/v biases.
    "qwen2moe": Spec("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, num_experts=N_EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=False, qkv_bias=True), seed=20),
    # q/k norms, head_dim 32 (q width 128, not the hidden size), renormalised top-k.
    "qwen3moe": Spec("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=64, head_dim=32,
        num_experts=N_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True), seed=7),
    # Sigmoid scores + correction bias, 2 groups of which 1 is used, routed scaling, one shared
    # expert, one leading dense layer, partial rotary (half of head_dim 32), q/k/v biases, q/k norm.
    "glm4moe": Spec("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=64, head_dim=32,
        n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0), router="sigmoid", seed=3),
    # OLMoE: q and k RMS-normalised over their whole width (not per head), softmax top-k not
    # renormalised. As many kv heads as heads, as OLMoE-1B-7B: llama.cpp's olmoe takes the k norm
    # to be n_embd wide (a GQA checkpoint, which transformers runs, it refuses to load).
    "olmoe": Spec("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=64, num_experts=N_EXPERTS, num_experts_per_tok=TOP_K,
        num_key_value_heads=N_HEADS, norm_topk_prob=False, clip_qkv=None), seed=3),
    # OLMoE's other shape: 16 experts top-4 (as they are: llama.cpp's olmoe never renormalises,
    # whatever the file says), 3 layers.
    "olmoe_wide": Spec("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=64, num_experts=16, num_experts_per_tok=4,
        num_key_value_heads=N_HEADS, norm_topk_prob=False, clip_qkv=None), seed=9),
    # DeepSeek-V2-Lite's layout: MLA with q straight from the hidden state (no q_lora), the latent of
    # kv_lora_rank plus a shared rope key, softmax top-k (greedy, not renormalised), one shared
    # expert, the first layer dense. Every width a multiple of 32 (q4/q8 blocks, the packed rows).
    "deepseek2": Spec("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=N_HEADS,
        n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0), seed=5),
    # DeepSeek-V3's: q through a low-rank q_lora with its norm; sigmoid scores plus the correction
    # bias, 2 groups of which 1 is used, renormalised, routed scaling 2.5; two shared experts.
    "deepseek3": Spec("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=N_HEADS,
        n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5), router="sigmoid", seed=137),
    # DeepSeek-V2's full layout without shared experts (transformers builds them 0 wide): q through a
    # low rank, softmax top-2 as they are (transformers' DeepseekV2 never renormalises, whatever
    # norm_topk_prob says), every layer's experts routed alone, no dense layer.
    "deepseek2_routed": Spec("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=N_HEADS,
        n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=0, first_k_dense_replace=0,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0), seed=37),
    # V3's layout with YaRN as DeepSeek's configs have it (factor, the original context, mscale and
    # mscale_all_dim: the attention's scale grows by mscale_all_dim's term, squared).
    "deepseek3_yarn": Spec("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=N_HEADS,
        n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=ROPE_THETA, factor=8.0,
                             original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                             mscale=0.707, mscale_all_dim=0.707)), router="sigmoid", seed=14),
    # gpt-oss: q/k/v/o biases, a sink per head, a sliding first layer (window 8, shorter than the
    # 28 positions) and a full second one, YaRN as the released config has it (factor 32 over 4096,
    # the blend range not rounded), a biased router, experts with biases and the clamped SwiGLU
    # (their gate/up drawn wider, so that the clamp at 7 binds). The experts lie on MXFP4's grid
    # (its own format, exact), so the q4_0 rounding is not one it is held to.
    "gpt_oss": Spec("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=2, intermediate_size=64, head_dim=16, num_local_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=8, attention_bias=True, tie_word_embeddings=False,
        rope_theta=150000.0, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)), seed=2, quant=("q8_0", "q8_0_x2", "mxfp4_moe")),
    # gpt-oss's other shape: three layers (sliding, full, sliding) over a window of 4, top-4, one kv
    # head for four, heads of 32, and RoPE without scaling.
    "gpt_oss_gqa": Spec("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=64, head_dim=32, num_key_value_heads=1,
        num_local_experts=N_EXPERTS, num_experts_per_tok=4, sliding_window=4, attention_bias=True,
        tie_word_embeddings=False, rope_theta=150000.0,
        rope_parameters=dict(rope_type="default", rope_theta=150000.0)),
        seed=18, quant=("q8_0", "q8_0_x2", "mxfp4_moe")),
}
SINK_STD = 1.0  # gpt-oss's sinks: logits as large as the scores they compete with
GATE_UP_GAIN = 4.0  # gpt-oss's experts' gate/up: wide enough that its SwiGLU's clamp at 7 binds


def grid(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    """Random values of about ``std`` on the Q4 grid (see BLOCK): per block of the last axis,
    uniform integers in (Q_MIN, Q_MAX) and one each of Q_MIN and Q_MAX, times a power of two.
    Uniform rather than Gaussian: Q8_0's step is a block's largest magnitude / 127, which is then
    the smallest fraction of the typical weight."""
    scale = 2.0 ** round(math.log2(std / Q_INT_STD))
    k = torch.randint(Q_MIN + 1, Q_MAX, shape, generator=gen).float()
    blocks = k.reshape(-1, BLOCK)
    for row in blocks:  # the block's extremes at two random places
        lo, hi = torch.randperm(BLOCK, generator=gen)[:2]
        row[lo], row[hi] = Q_MIN, Q_MAX
    return (blocks * scale).reshape(shape)


def gpt_oss_experts(t: torch.Tensor, name: str, gen: torch.Generator) -> None:
    """gpt-oss's fused experts, on MXFP4's grid along GGUF's rows (the checkpoint's columns)."""
    gain = GATE_UP_GAIN if name.endswith("gate_up_proj") else MATRIX_GAIN
    rows = (*t.shape[:-2], t.shape[-1], t.shape[-2])
    t.copy_(mxfp4_grid(rows, gain / t.shape[-2] ** 0.5, gen).transpose(-1, -2))


def keys_on_grid_both_ways(kv_b: torch.Tensor, nope: int, v_dim: int, gen: torch.Generator) -> None:
    """DeepSeek's kv_b_proj: each head's key rows are stored transposed (``attn_k_b``), so their
    blocks of BLOCK also run down the columns. In every BLOCK x BLOCK tile of those rows the
    extremes are moved so that each row and each column holds one Q_MIN and one Q_MAX: Q4_0 then
    stores both orientations exactly."""
    step = kv_b.abs().max() / -Q_MIN  # the grid's one power of two for the whole matrix
    for h in range(kv_b.shape[0] // (nope + v_dim)):
        for r0 in range(h * (nope + v_dim), h * (nope + v_dim) + nope, BLOCK):
            for c0 in range(0, kv_b.shape[1], BLOCK):
                k = torch.round(kv_b[r0 : r0 + BLOCK, c0 : c0 + BLOCK] / step)
                extreme = (k == Q_MIN) | (k == Q_MAX)
                k[extreme] = torch.randint(Q_MIN + 1, Q_MAX, (int(extreme.sum()),), generator=gen).float()
                lows = torch.randperm(BLOCK, generator=gen)
                highs = torch.roll(lows, 1)  # another column in every row, a permutation too
                k[torch.arange(BLOCK), lows], k[torch.arange(BLOCK), highs] = float(Q_MIN), float(Q_MAX)
                kv_b[r0 : r0 + BLOCK, c0 : c0 + BLOCK] = k * step


def init_weights(model: torch.nn.Module, spec: Spec) -> None:
    """Overwrite transformers' near-zero init with scales under which every weight matters."""
    gen = torch.Generator().manual_seed(spec.seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    def on_grid(t: torch.Tensor, std: float) -> None:
        t.copy_(grid(tuple(t.shape), std, gen))

    router_gain = SIGMOID_ROUTER_GAIN if spec.router == "sigmoid" else SOFTMAX_ROUTER_GAIN
    with torch.no_grad():
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in sorted(tensors, key=lambda item: item[0]):
            if "rotary_emb" in name or t.numel() == 0:  # (deepseek2_routed's 0-wide shared experts)
                continue
            if name.endswith("e_score_correction_bias"):
                normal(t, SCORE_BIAS_STD)
            elif name.endswith("norm.weight"):
                normal(t, NORM_JITTER, 1.0)
            elif name.endswith((".bias", "_bias")):
                normal(t, BIAS_STD)
            elif name.endswith("self_attn.sinks"):
                normal(t, SINK_STD)
            elif is_expert(name) and spec.model_cls == "GptOssForCausalLM":
                gpt_oss_experts(t, name, gen)
            elif is_router(name):
                normal(t, router_gain / HIDDEN**0.5)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                on_grid(t, EMBD_STD)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                on_grid(t, QK_GAIN / t.shape[-1] ** 0.5)
            elif name.endswith("kv_b_proj.weight"):
                on_grid(t, MATRIX_GAIN / t.shape[-1] ** 0.5)
                keys_on_grid_both_ways(t, spec.config["qk_nope_head_dim"], spec.config["v_head_dim"], gen)
            elif t.dim() >= 2:
                on_grid(t, MATRIX_GAIN / t.shape[-1] ** 0.5)
            else:
                raise SystemExit(f"make_tiny_moe: no init rule for {name} {tuple(t.shape)}")


def routing_margin(model: torch.nn.Module, spec: Spec, ids: torch.Tensor) -> float:
    """Smallest gap between the last chosen and the first rejected expert (or group), over every
    token and MoE layer of one forward pass over ``ids``."""
    cfg = model.config
    k = cfg.num_experts_per_tok  # the boundary between the chosen and the rest
    captured: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [
        module.register_forward_pre_hook(lambda mod, args: captured.append((mod, args[0].detach())))
        for name, module in model.named_modules() if name.endswith((".mlp.gate", ".mlp.router"))
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    margins = []
    for module, hidden in captured:
        h = hidden.reshape(-1, cfg.hidden_size).float()
        logits = h @ module.weight.float().T
        if isinstance(getattr(module, "bias", None), torch.Tensor):  # gpt-oss's router
            logits = logits + module.bias.float()
        if spec.router == "softmax":
            top = logits.sort(dim=-1, descending=True).values
            margins.append((top[:, k - 1] - top[:, k]).min().item())
            continue
        choice = logits.sigmoid() + module.e_score_correction_bias.float()
        groups = choice.view(len(h), cfg.n_group, -1).topk(2, dim=-1).values.sum(-1)
        gsort = groups.sort(dim=-1, descending=True)
        margins.append((gsort.values[:, cfg.topk_group - 1] - gsort.values[:, cfg.topk_group]).min().item())
        mask = torch.zeros_like(groups, dtype=torch.bool)
        mask.scatter_(1, gsort.indices[:, : cfg.topk_group], True)
        masked = choice.masked_fill(~mask.repeat_interleave(N_EXPERTS // cfg.n_group, dim=1), float("-inf"))
        top = masked.sort(dim=-1, descending=True).values
        margins.append((top[:, k - 1] - top[:, k]).min().item())
    return min(margins) if margins else float("inf")


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of exactly VOCAB tokens over TOKENIZER_TEXT, specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, initial_alphabet=[], show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"make_tiny_moe: the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB}")
    return tok


def save_tokenizer(out: Path) -> None:
    train_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def prompt_ids() -> list[int]:
    rng = np.random.default_rng(PROMPT_SEED)
    return [BOS_ID] + [int(i) for i in rng.integers(len(SPECIAL_TOKENS), VOCAB, PROMPT_LEN - 1)]


def build_model(spec: Spec) -> tuple[Any, torch.nn.Module]:
    """The architecture's config and model, eager attention, weights from ``init_weights``."""
    torch.manual_seed(spec.seed)
    config = getattr(transformers, spec.config_cls)(**COMMON | spec.config)
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.model_cls)(config).eval()
    init_weights(model, spec)
    return config, model


def run_reference(arch: str, model: torch.nn.Module,
                  config: Any) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """(prompt, its logits, greedy continuation, prompt plus continuation, that sequence's logits),
    the cached generation checked against one uncached forward pass."""
    prompt = torch.tensor([prompt_ids()])
    gen_config = transformers.GenerationConfig(
        max_new_tokens=N_GREEDY, do_sample=False, eos_token_id=config.eos_token_id, pad_token_id=0,
    )
    with torch.no_grad():
        logits = model(prompt).logits[0].float()
        generated = model.generate(prompt, generation_config=gen_config)[0, PROMPT_LEN:]
        sequence = torch.cat([prompt[0], generated])[None]
        full_logits = model(sequence).logits[0].float()
    greedy = [int(i) for i in generated]
    if len(greedy) != N_GREEDY:
        raise SystemExit(f"make_tiny_moe: {arch}: generation stopped after {len(greedy)} tokens (eos)")
    # The cached generation must agree with one uncached pass, and no choice may be a near tie.
    argmax = full_logits[PROMPT_LEN - 1 : -1].argmax(-1).tolist()
    if argmax != greedy:
        raise SystemExit(f"make_tiny_moe: {arch}: generate() {greedy} != forward argmax {argmax}")
    return prompt, logits, greedy, sequence, full_logits


def check_margins(arch: str, model: torch.nn.Module, spec: Spec, sequence: torch.Tensor,
                  full_logits: torch.Tensor) -> tuple[float, float, dict[str, float]]:
    """(top-1 margin, routing margin, quantized top-1 agreement); refuses near ties and a model
    whose choices do not survive quantization."""
    top2 = full_logits[:-1].topk(2, dim=-1).values
    top1_margin = float((top2[:, 0] - top2[:, 1]).min())
    route_margin = routing_margin(model, spec, sequence)
    if top1_margin < MIN_TOP1_MARGIN or route_margin < MIN_ROUTING_MARGIN[spec.router]:
        raise SystemExit(f"make_tiny_moe: {arch}: near tie (top-1 {top1_margin:.2e}, routing "
                         f"{route_margin:.2e}); change the seed")
    gpt_oss = spec.model_cls == "GptOssForCausalLM"
    agreement = quant_agreement(model, sequence, full_logits, spec.quant, gpt_oss)
    if min(agreement.values()) < MIN_QUANT_AGREEMENT:
        raise SystemExit(f"make_tiny_moe: {arch}: quantized top-1 agreement {agreement}; change the seed")
    return top1_margin, route_margin, agreement


def save_checkpoint(arch: str, model: torch.nn.Module, out: Path) -> None:
    """The model as ``save_pretrained`` writes it (SHARDED in N_SHARDS), plus the tokenizer for
    WITH_TOKENIZER."""
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    shard = f"{total // N_SHARDS // 1000 + 20}KB" if arch == SHARDED else "50MB"
    model.save_pretrained(out, max_shard_size=shard)
    (out / "generation_config.json").unlink(missing_ok=True)  # not part of what convert reads
    if arch == SHARDED and len(list(out.glob("*.safetensors"))) != N_SHARDS:
        raise SystemExit(f"make_tiny_moe: {arch}: expected {N_SHARDS} shards")
    if arch == WITH_TOKENIZER:
        save_tokenizer(out)


def save_reference(out: Path, ref: dict[str, Any], prompt: torch.Tensor, logits: torch.Tensor,
                   greedy: list[int], full_logits: torch.Tensor) -> None:
    """reference.npz (ids and logits) and reference.json (``ref``) beside the checkpoint."""
    np.savez_compressed(
        out / "reference.npz",
        prompt_ids=prompt[0].numpy().astype(np.int32),
        logits=logits.numpy().astype(np.float32),
        greedy_ids=np.array(greedy, dtype=np.int32),
        full_logits=full_logits.numpy().astype(np.float32),
    )
    # One key a line, each value compact: the ids read as the lists they are.
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in ref.items())
    (out / "reference.json").write_text("{\n" + body + "\n}\n")


def make(arch: str, out_root: Path) -> dict[str, Any]:
    spec = SPECS[arch]
    out = out_root / arch
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config, model = build_model(spec)
    prompt, logits, greedy, sequence, full_logits = run_reference(arch, model, config)
    top1_margin, route_margin, agreement = check_margins(arch, model, spec, sequence, full_logits)
    save_checkpoint(arch, model, out)
    ref = {
        "architecture": spec.model_cls,
        "prompt_ids": prompt[0].tolist(),
        "greedy_ids": greedy,
        "min_top1_margin": round(top1_margin, 6),
        "min_routing_margin": round(route_margin, 6),
        "simulated_top1_agreement": agreement,
        "versions": versions(),
    }
    save_reference(out, ref, prompt, logits, greedy, full_logits)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{arch:9s} {size / 1e6:.2f} MB  greedy {greedy}  margins: top-1 {top1_margin:.3f}, "
          f"routing {route_margin:.3f}  agreement {agreement}")
    return ref


def versions() -> dict[str, str]:
    import safetensors
    import tokenizers

    return {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--only", nargs="+", choices=sorted(SPECS), help="make only these architectures")
    a = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for arch in a.only or SPECS:
        make(arch, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
