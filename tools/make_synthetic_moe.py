"""Write a synthetic MoE GGUF (random quantized experts) of any size, streaming.

For the expert-store benchmark (``bench/bench_moe.py``) and the store's tests: a complete
"llama"-architecture file with expert tensors, as llama.cpp writes Mixtral, whose experts can be
made several times larger than a RAM budget. The weights are random but the routing is not
uniform: every token embedding shares a common direction ``c``, and each router row leans towards
``c`` by a Zipf-distributed amount, so a few experts per layer are hot, as in real MoE models.
Experts are random Q4_0 blocks written tensor by tensor (one layer's experts at a time in RAM).
The vocabulary is a placeholder SentencePiece one (``<unk> <s> </s>``, the 256 byte tokens, then
``▁t<i>`` pieces; none below 259 tokens): no text means anything to a random model, so drive it
with ``--prompt-ids``; it is there because llama.cpp will not load a file without one
(``bench/bench_moe_peer.py`` runs both engines on this same file).

Three shapes: ``--arch llama`` (mixtral's layout, every matrix Q4_0: the default, the MoE
headline's file), ``--arch qwen3moe`` (Qwen3-30B-A3B's layout scaled down: per-head q/k norms, NEOX RoPE, a
head size of its own, top-8 of many narrow experts) and ``--arch glm4moe`` (GLM-4.5-Air's: q/k/v
biases, NEOX RoPE on half of each head, a leading dense layer, sigmoid routing steered by a
selection bias, an ungated shared expert beside the routed ones) and ``--arch deepseek2``
(DeepSeek-V2-Lite's: latent attention, two shared experts, softmax routing, a leading dense
layer), all quantized as llama.cpp's
Q4_K_M mix has it (Q4_K, with Q6_K for ``attn_v`` and every ``ffn_down`` in the layers its
``use_more_bits`` picks, and for ``output``). Random K-quant blocks are drawn directly in their
byte layout (a reference quantizer would take minutes per GB); the embedding is quantized from
real values. ``--arch gpt-oss`` (gpt-oss-20b's, MXFP4 experts: ``synthetic_gpt_oss.py``).

    python tools/make_synthetic_moe.py OUT.gguf [--arch llama|qwen3moe|glm4moe|deepseek2|gpt-oss]
        [--layers 24] [--experts 64] [--used 4] [--embd 1024] [--ff 1024] [--vocab 4096] [--heads 8]
        [--kv-heads 4] [--head-dim D] [--nextn]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

from colibri.store.formats import FORMATS, GGMLType, quantize, row_nbytes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (loaded by path too: its sibling below)
import synthetic_gpt_oss  # noqa: E402

Q4_0_BLOCK_BYTES = 18  # f16 scale + 16 bytes of nibbles, per 32 weights
# The experts' scale: nibbles are uniform in 1..15 (value d*(q-8)), so d sets the output's size;
# small, so the residual stream stays led by the token and each layer's routing varies with it
# (larger outputs drive every token towards the same experts after a few layers).
EXPERT_SCALE = 0.03
ZIPF_EXPONENT = 1.1  # routing skew: expert rank r gets lean ~ 1/r^s
ROUTER_LEAN = 1.0  # how strongly the hottest expert's router row leans towards c
COMMON_SHARE = 0.2  # share of each token embedding that is the common direction c
BIAS_SCALE = 0.02  # glm4moe's q/k/v biases: small beside the projections' outputs
# glm4moe's selection bias (exp_probs_b): about a sigmoid score's own spread, so that it changes
# some choices without deciding them all
SELECTION_BIAS_SCALE = 0.1
# glm4moe's shape beside the routed experts, after GLM-4.5-Air: one leading dense layer whose FFN
# is ~7.8x an expert's (10944 / 1408) and one shared expert
GLM_DENSE_LEAD = 1
GLM_DENSE_FF_PER_EXPERT_FF = 7.8
GLM_SHARED = 1
# deepseek2's, after DeepSeek-V2-Lite (27 layers, the first dense with an FFN 7.8x an expert's, two
# shared experts, 64 experts of 1408 x 2048 top-6, 16 heads, latent attention: kv_lora_rank 512,
# nope 128, rope 64, value 128, q straight from the hidden state), its attention at half its width
DEEPSEEK_SHARED = 2
DEEPSEEK_MLA = dict(kv_lora=256, nope=64, mla_rope=32, v_dim=64)


def _random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 rows (uint8, [rows, cols/32*18]) with the scale EXPERT_SCALE/sqrt(cols)."""
    blocks = np.empty((rows, cols // 32, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    # nibbles 1..15 (values d*(q-8) in -7d..7d): zero mean, so that layer after layer of random
    # experts does not push every token's hidden state towards one direction (and one routing)
    nibbles = rng.integers(1, 16, (2, rows, cols // 32, 16), dtype=np.uint8)
    blocks[:, :, 2:] = nibbles[0] | (nibbles[1] << 4)
    d = np.float16(EXPERT_SCALE / np.sqrt(cols))
    blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


QK_K = FORMATS[GGMLType.Q4_K].block  # values per K-quant super-block
# The spread of one random Q4_0 weight, d*(q-8) with q uniform in 1..15: the K-quant experts are
# drawn with the same spread, so that both files' hidden states (and routing) behave alike.
Q4_0_SPREAD = 4.32


def _spread(cols: int) -> float:
    return EXPERT_SCALE / np.sqrt(cols) * Q4_0_SPREAD


def _random_q4_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K rows (uint8, [rows, cols/256*144]). A value is ``d sc q - dmin m`` per
    32-value sub-block; ``m`` is drawn so that ``dmin m`` is ``d sc 7.5`` to the nearest step, so
    each sub-block is centred near zero (nibbles uniform in 0..15)."""
    n = rows * (cols // QK_K)
    blocks = np.empty((n, FORMATS[GGMLType.Q4_K].nbytes), dtype=np.uint8)
    sc = rng.integers(16, 64, (n, 8), dtype=np.uint8)  # 6-bit scales, not tiny
    d = np.float16(_spread(cols) / (float(np.mean(np.arange(16, 64))) * 4.61))  # 4.61: std of 0..15
    dmin = np.float16(float(d) * 8.0)
    m = np.minimum(np.rint(sc * 7.5 * float(d) / float(dmin)), 63).astype(np.uint8)
    blocks[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    blocks[:, 2:4] = np.frombuffer(dmin.tobytes(), np.uint8)
    # ggml's get_scale_min_k4 layout: bytes 0-3 sc[0..3] | (sc[4..7] >> 4) << 6, bytes 4-7 the same
    # for m, bytes 8-11 sc[4..7] & 15 | (m[4..7] & 15) << 4
    blocks[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    blocks[:, 16:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _random_q6_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q6_K rows (uint8, [rows, cols/256*210]): a value is ``d sc (q - 32)`` per 16-value
    sub-block, q uniform in 0..63 (centred), the int8 scales of either sign."""
    n = rows * (cols // QK_K)
    blocks = np.empty((n, FORMATS[GGMLType.Q6_K].nbytes), dtype=np.uint8)
    blocks[:, :192] = rng.integers(0, 256, (n, 192), dtype=np.uint8)
    sc = rng.integers(16, 64, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
    blocks[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    d = np.float16(_spread(cols) / (float(np.mean(np.arange(16, 64))) * 18.47))  # 18.47: std of 0..63
    blocks[:, 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


Make = Callable[[], np.ndarray]
Q4 = gguf.GGMLQuantizationType.Q4_0
Q4_K = gguf.GGMLQuantizationType.Q4_K
Q6_K = gguf.GGMLQuantizationType.Q6_K
F32 = gguf.GGMLQuantizationType.F32
# Each block type's random rows.
_RANDOM = {Q4: _random_q4_0, Q4_K: _random_q4_k, Q6_K: _random_q6_k,
           synthetic_gpt_oss.Q8: lambda rng, rows, cols: synthetic_gpt_oss.random_q8_0(rng, rows, cols,
                                                                                      _spread(cols))}


def _row_bytes(qtype: gguf.GGMLQuantizationType, cols: int) -> int:
    return row_nbytes(GGMLType(int(qtype)), cols)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose ``attn_v`` and ``ffn_down`` get Q6_K: the
    first and last eighth, and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


class _Weights:
    """The tensors' random values, all from one generator: drawn in the order they are written,
    so that the file is a function of the seed."""

    def __init__(self, rng: np.random.Generator, n_vocab: int, n_embd: int, n_experts: int,
                 router_lean: float, common_share: float):
        self.rng, self.n_vocab, self.n_embd, self.n_experts = rng, n_vocab, n_embd, n_experts
        self.common_share = common_share
        self.common = rng.standard_normal(n_embd).astype(np.float32)
        self.common /= np.linalg.norm(self.common)
        self.lean = router_lean / np.arange(1, n_experts + 1) ** ZIPF_EXPONENT

    def matrix(self, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> Make:
        return lambda: _RANDOM[qtype](self.rng, rows, cols)

    def experts(self, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> Make:
        """[n_expert, rows, cols] as n_expert*rows raw rows; gguf-py derives the 3-D shape."""
        make = _RANDOM[qtype]
        return lambda: make(self.rng, self.n_experts * rows, cols).reshape(self.n_experts, rows, -1)

    def embedding(self, qtype: gguf.GGMLQuantizationType) -> Make:
        def make() -> np.ndarray:
            n_vocab, n_embd = self.n_vocab, self.n_embd
            table = self.rng.standard_normal((n_vocab, n_embd)).astype(np.float32) / np.sqrt(n_embd)
            table *= 1.0 - self.common_share
            table += self.common_share * self.common
            return quantize(table, GGMLType(int(qtype))).reshape(n_vocab, -1)
        return make

    def router(self) -> np.ndarray:
        n_experts, n_embd = self.n_experts, self.n_embd
        rows = self.rng.standard_normal((n_experts, n_embd)).astype(np.float32) / np.sqrt(n_embd)
        order = self.rng.permutation(n_experts)  # which experts are hot differs per layer
        return (rows + self.lean[order][:, None] * self.common[None, :]).astype(np.float32)

    def ones_ish(self) -> np.ndarray:
        return (1.0 + 0.05 * self.rng.standard_normal(self.n_embd)).astype(np.float32)

    def ones_head(self, n: int) -> Make:
        return lambda: (1.0 + 0.05 * self.rng.standard_normal(n)).astype(np.float32)

    def small(self, n: int, scale: float) -> Make:
        """Biases: centred, ``scale`` their spread."""
        return lambda: (scale * self.rng.standard_normal(n)).astype(np.float32)


class Shape(NamedTuple):
    """The file's architecture, sizes and block types."""

    arch: str  # "llama" (mixtral's layout, Q4_0), "qwen3moe" or "glm4moe" (Q4_K_M)
    n_layers: int
    n_embd: int
    n_ff: int  # one expert's gate (and up) rows
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_dense_lead: int = 0  # leading layers with a dense FFN (glm4moe)
    n_ff_dense: int = 0  # their FFN's gate (and up) rows
    n_shared: int = 0  # shared experts beside the routed ones (glm4moe: their FFN is n_shared n_ff)
    kv_lora: int = 0  # deepseek2's latent attention: the latent's width
    nope: int = 0  # a query head's part without rope
    mla_rope: int = 0  # its rope part, and the shared rope key's
    v_dim: int = 0  # a head's value

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def k_quants(self) -> bool:
        return self.arch != "llama"

    @property
    def rope_dim(self) -> int:
        """glm4moe rotates half of each head (GLM-4.5's ``partial_rotary_factor``), deepseek2 its
        rope part, the others all."""
        if self.arch == "deepseek2":
            return self.mla_rope
        return self.head_dim // 2 if self.arch == "glm4moe" else self.head_dim

    def types(self, layer: int) -> tuple[gguf.GGMLQuantizationType, gguf.GGMLQuantizationType]:
        """A layer's block type for most matrices, and for ``attn_v`` and ``ffn_down``."""
        if not self.k_quants:
            return Q4, Q4
        return Q4_K, Q6_K if use_more_bits(layer, self.n_layers) else Q4_K


class _Plan:
    """Every tensor's name, shape, type and maker, in file order: the header needs every shape
    before the first tensor's data is made."""

    def __init__(self, weights: _Weights):
        self.weights = weights
        self.entries: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, Make]] = []

    def matrix(self, name: str, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> None:
        make = self.weights.matrix(qtype, rows, cols)
        self.entries.append((name, (rows, _row_bytes(qtype, cols)), qtype, make))

    def f32_tensor(self, name: str, shape: tuple[int, ...], make: Make) -> None:
        self.entries.append((name, shape, F32, make))

    def latent_attention(self, p: str, shape: Shape, base: gguf.GGMLQuantizationType) -> None:
        """deepseek2's: q from the hidden state, the latent and rope key, k_b (its rows of ``nope``,
        Q4_0: no whole K-quant super-block) and v_b a head each, the output."""
        w, n_embd, heads = self.weights, shape.n_embd, shape.n_heads
        self.matrix(p + "attn_q.weight", base, heads * (shape.nope + shape.mla_rope), n_embd)
        self.matrix(p + "attn_kv_a_mqa.weight", base, shape.kv_lora + shape.mla_rope, n_embd)
        self.f32_tensor(p + "attn_kv_a_norm.weight", (shape.kv_lora,), w.ones_head(shape.kv_lora))
        for name, qtype, rows, cols in (("attn_k_b", Q4, shape.kv_lora, shape.nope),
                                        ("attn_v_b", base, shape.v_dim, shape.kv_lora)):
            make = _RANDOM[qtype]
            self.entries.append((p + name + ".weight", (heads, rows, _row_bytes(qtype, cols)), qtype,
                                 lambda m=make, r=rows, c=cols: m(w.rng, heads * r, c).reshape(heads, r, -1)))
        self.matrix(p + "attn_output.weight", base, n_embd, heads * shape.v_dim)

    def layer(self, i: int, shape: Shape) -> None:
        p, w, n_embd, n_ff = f"blk.{i}.", self.weights, shape.n_embd, shape.n_ff
        if shape.arch == "gpt-oss":
            synthetic_gpt_oss.layer(self, i, shape, _spread)
            return
        base, more = shape.types(i)
        self.f32_tensor(p + "attn_norm.weight", (n_embd,), w.ones_ish)
        if shape.arch == "deepseek2":
            self.latent_attention(p, shape, base)
        else:
            self.gqa_attention(p, shape, base, more)
        norm = "post_attention_norm" if shape.arch == "glm4moe" else "ffn_norm"
        self.f32_tensor(p + norm + ".weight", (n_embd,), w.ones_ish)
        if i < shape.n_dense_lead:
            self.swiglu(p, "", base, more, shape.n_ff_dense, n_embd)
            return
        self.f32_tensor(p + "ffn_gate_inp.weight", (w.n_experts, n_embd), w.router)
        if shape.arch == "glm4moe":
            bias = w.small(w.n_experts, SELECTION_BIAS_SCALE)
            self.f32_tensor(p + "exp_probs_b.bias", (w.n_experts,), bias)
        for part, qtype, rows, cols in (("gate", base, n_ff, n_embd), ("up", base, n_ff, n_embd),
                                        ("down", more, n_embd, n_ff)):
            shape3 = (w.n_experts, rows, _row_bytes(qtype, cols))
            self.entries.append((f"{p}ffn_{part}_exps.weight", shape3, qtype, w.experts(qtype, rows, cols)))
        if shape.n_shared:
            self.swiglu(p, "_shexp", base, more, shape.n_shared * n_ff, n_embd)

    def gqa_attention(self, p: str, shape: Shape, base: gguf.GGMLQuantizationType,
                      more: gguf.GGMLQuantizationType) -> None:
        w, n_embd = self.weights, shape.n_embd
        self.matrix(p + "attn_q.weight", base, shape.q_dim, n_embd)
        self.matrix(p + "attn_k.weight", base, shape.kv_dim, n_embd)
        self.matrix(p + "attn_v.weight", more, shape.kv_dim, n_embd)
        self.matrix(p + "attn_output.weight", base, n_embd, shape.q_dim)
        if shape.arch == "qwen3moe":
            self.f32_tensor(p + "attn_q_norm.weight", (shape.head_dim,), w.ones_head(shape.head_dim))
            self.f32_tensor(p + "attn_k_norm.weight", (shape.head_dim,), w.ones_head(shape.head_dim))
        if shape.arch == "glm4moe":
            for x, n in (("q", shape.q_dim), ("k", shape.kv_dim), ("v", shape.kv_dim)):
                self.f32_tensor(p + f"attn_{x}.bias", (n,), w.small(n, BIAS_SCALE))

    def swiglu(self, p: str, suffix: str, base: gguf.GGMLQuantizationType,
               more: gguf.GGMLQuantizationType, n_ff: int, n_embd: int) -> None:
        """A 2-D SwiGLU FFN: a dense layer's (``suffix`` "") or the shared expert's ("_shexp")."""
        self.matrix(f"{p}ffn_gate{suffix}.weight", base, n_ff, n_embd)
        self.matrix(f"{p}ffn_up{suffix}.weight", base, n_ff, n_embd)
        self.matrix(f"{p}ffn_down{suffix}.weight", more, n_embd, n_ff)


def _add_metadata(w: gguf.GGUFWriter, shape: Shape, *, n_experts: int, n_used: int, n_vocab: int,
                  n_nextn: int = 0) -> None:
    w.add_name(f"synthetic-moe-{shape.arch}")
    w.add_block_count(shape.n_layers + n_nextn)
    w.add_context_length(4096)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff_dense if shape.n_dense_lead else shape.n_ff)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_layer_norm_rms_eps(1e-6 if shape.arch == "qwen3moe" else 1e-5)
    w.add_rope_freq_base({"llama": 10000.0, "gpt-oss": synthetic_gpt_oss.ROPE_BASE}.get(shape.arch, 1e6))
    w.add_rope_dimension_count(shape.rope_dim)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(n_used)
    if shape.arch == "deepseek2":  # the latent as one kv head (llama.cpp's converter's metadata)
        w.add_key_length(shape.kv_lora + shape.mla_rope)
        w.add_value_length(shape.kv_lora)
        w.add_key_length_mla(shape.nope + shape.mla_rope)
        w.add_value_length_mla(shape.v_dim)
        w.add_kv_lora_rank(shape.kv_lora)
        w.add_q_lora_rank(0)
        w.add_expert_feed_forward_length(shape.n_ff)
        w.add_leading_dense_block_count(shape.n_dense_lead)
        w.add_expert_shared_count(shape.n_shared)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_weights_norm(False)  # V2-Lite's norm_topk_prob
        w.add_expert_weights_scale(1.0)
    elif shape.arch == "gpt-oss":
        synthetic_gpt_oss.metadata(w, shape)
    elif shape.arch != "llama":
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_expert_feed_forward_length(shape.n_ff)
    if shape.arch == "glm4moe":
        w.add_leading_dense_block_count(shape.n_dense_lead)
        w.add_expert_shared_count(shape.n_shared)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)  # GLM-4.5's norm_topk_prob
        w.add_expert_weights_scale(1.0)  # GLM-4.5-Air's routed_scaling_factor
        w.add_nextn_predict_layers(n_nextn)
    w.add_vocab_size(n_vocab)
    # MOSTLY_Q4_K_M, MOSTLY_Q4_0, MOSTLY_MXFP4_MOE
    w.add_file_type(synthetic_gpt_oss.FILE_TYPE if shape.arch == "gpt-oss" else 15 if shape.k_quants else 2)
    _add_placeholder_vocab(w, n_vocab)


# llama.cpp's token types (llama-vocab.h): a placeholder vocabulary's control, byte and plain pieces.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6
SPECIALS = ("<unk>", "<s>", "</s>")  # SentencePiece's ids 0, 1, 2


def _add_placeholder_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A SentencePiece vocabulary of ``n_vocab`` pieces: the specials, the byte fallbacks, fillers;
    none in a file too small to hold them (colibri needs none, llama.cpp does)."""
    if n_vocab < len(SPECIALS) + 256:
        return
    pieces = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    pieces += [f"\u2581t{i}" for i in range(n_vocab - len(pieces))]
    types += [TOKEN_NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * len(SPECIALS) + [0.0] * 256 + [-float(i) for i in range(n_vocab - 259)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _write_plan(w: gguf.GGUFWriter, plan: _Plan) -> None:
    """Tensor infos first, data after, one tensor at a time."""
    for name, shape, qtype, _ in plan.entries:
        dtype = np.float32 if qtype == F32 else np.uint8
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=None if qtype == F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in plan.entries:
        w.write_tensor_data(np.ascontiguousarray(make()))
    w.close()


def write_synthetic_moe(
    path: str | Path, *, arch: str = "llama", n_layers: int = 24, n_experts: int = 64, n_used: int = 4,
    n_embd: int = 1024, n_ff: int = 1024, n_vocab: int = 4096, n_heads: int = 8, n_kv_heads: int = 4,
    head_dim: int | None = None, seed: int = 0, router_lean: float = ROUTER_LEAN,
    common_share: float = COMMON_SHARE, nextn: bool = False,
) -> Path:
    """``nextn``: a glm4moe file with a NextN (MTP) layer after its layers, as GLM-4.5's have:
    random like the rest, so its drafts are wrong (what MTP costs where it does not pay)."""
    path = Path(path)
    if arch not in ARCHES:
        raise ValueError(f"--arch must be one of {', '.join(ARCHES)}")
    if nextn and arch != "glm4moe":
        raise ValueError("--nextn: a NextN layer is glm4moe's")
    shape = Shape(arch, n_layers, n_embd, n_ff, n_heads, n_kv_heads, head_dim or n_embd // n_heads)
    block = QK_K if shape.k_quants else 32
    if arch in ("glm4moe", "deepseek2"):
        dense_ff = int(round(n_ff * GLM_DENSE_FF_PER_EXPERT_FF / block)) * block
        shape = shape._replace(n_dense_lead=min(GLM_DENSE_LEAD, n_layers - 1), n_ff_dense=dense_ff,
                               n_shared=GLM_SHARED if arch == "glm4moe" else DEEPSEEK_SHARED)
    if arch == "deepseek2":
        shape = shape._replace(n_kv_heads=1, **DEEPSEEK_MLA)
    if n_embd % block or n_ff % block or shape.q_dim % block:
        raise ValueError(f"n_embd, n_ff and heads x head size must be multiples of {block} "
                         f"(whole {'K-quant super-' if shape.k_quants else 'Q4_0 '}blocks)")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    _add_metadata(w, shape, n_experts=n_experts, n_used=n_used, n_vocab=n_vocab, n_nextn=int(nextn))
    weights = _Weights(rng, n_vocab, n_embd, n_experts, router_lean, common_share)
    plan = _Plan(weights)
    embd_type, out_type = (Q4_K, Q6_K) if shape.k_quants else (Q4, Q4)
    if arch == "gpt-oss":
        embd_type, out_type = synthetic_gpt_oss.Q8, synthetic_gpt_oss.Q8
    embd_shape = (n_vocab, _row_bytes(embd_type, n_embd))
    plan.entries.append(("token_embd.weight", embd_shape, embd_type, weights.embedding(embd_type)))
    for i in range(n_layers):
        plan.layer(i, shape)
    if nextn:
        plan.layer(n_layers, shape)
        p = f"blk.{n_layers}.nextn."
        plan.matrix(p + "eh_proj.weight", shape.types(n_layers)[0], n_embd, 2 * n_embd)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            plan.f32_tensor(p + norm + ".weight", (n_embd,), weights.ones_ish)
    plan.f32_tensor("output_norm.weight", (n_embd,), weights.ones_ish)
    plan.matrix("output.weight", out_type, n_vocab, n_embd)
    _write_plan(w, plan)
    return path


ARCHES = ("llama", "qwen3moe", "glm4moe", "deepseek2", "gpt-oss")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, metavar="OUT.gguf")
    p.add_argument("--arch", choices=ARCHES, default="llama",
                   help="llama: mixtral's layout, Q4_0; qwen3moe, glm4moe, deepseek2: those layouts, Q4_K_M; "
                        "gpt-oss: MXFP4 experts")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--used", type=int, default=4)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--ff", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=None, help="default: embd / heads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lean", type=float, default=ROUTER_LEAN, help="routing skew (0: uniform)")
    p.add_argument("--nextn", action="store_true", help="glm4moe: a NextN (MTP) layer at the end")
    a = p.parse_args(argv)
    try:
        out = write_synthetic_moe(a.out, arch=a.arch, n_layers=a.layers, n_experts=a.experts,
                                  n_used=a.used, n_embd=a.embd, n_ff=a.ff, n_vocab=a.vocab,
                                  n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.head_dim,
                                  seed=a.seed, router_lean=a.lean, nextn=a.nextn)
    except ValueError as e:
        print(f"make_synthetic_moe: error: {e}", file=sys.stderr)
        return 1
    print(f"{out} ({out.stat().st_size / (1 << 30):.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
