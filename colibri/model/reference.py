"""A plain-numpy forward pass of every architecture the engine runs: the test oracle, and the math
written down once, readable top to bottom (in the manner of nanoGPT and llama2.c).

Nothing here shares code with the engine: the ``gguf`` package reads the file (metadata, tensors)
and dequantizes the blocks, numpy computes in float64 over the whole sequence at once (no KV cache,
no batching, no quantized activations but the experts' inputs where asked: ``Weights``). What it
gives is what the file's weights mean, so a test holds the engine's logits against it, and it
against transformers' where a test has those.

    logits = forward(Weights(path), token_ids)  # [len(token_ids), n_vocab], every position

Tensor names and metadata keys are llama.cpp's. A matrix ``w[name]`` is [rows, row length]: a
layer computes ``h @ w[name].T``. Slow and memory-hungry by design: every matrix is dequantized
again each time it is used (a 135M-parameter model: seconds).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

_REQUIRED = object()  # a metadata key without a default

# -- the file --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The hyperparameters the forward passes read, under llama.cpp's keys (``{arch}.<key>``)."""

    arch: str
    n_layers: int  # block_count less next-token-prediction layers (glm4moe's, not run)
    n_heads: int
    n_kv_heads: int
    head_dim: int  # attention.key_length, else embedding_length / head_count
    rope_dim: int  # rope.dimension_count: the rotated leading dimensions of a head
    rope_base: float
    eps: float
    n_used: int  # expert_used_count: experts per token
    norm_topk: bool | None  # expert_weights_norm; None when the file does not say
    scale: float  # expert_weights_scale (glm4moe's routed scaling factor); 0: none
    n_groups: int  # expert_group_count
    n_groups_used: int  # expert_group_used_count
    n_dense_lead: int  # leading_dense_block_count
    window: int  # attention.sliding_window: positions a local layer sees (0: no local layers)
    swa_pattern: object  # attention.sliding_window_pattern: a period, a per-layer list, or None
    rope_base_swa: float  # rope.freq_base_swa: the local layers' base
    rope_linear: float  # rope.scaling.factor of a "linear" scaling, llama.cpp's default type (1: none)
    attn_scale: float  # of q·k (0: 1/sqrt(head_dim)); Gemma 3's 27B has its own
    rope_attn: float  # rope.scaling.attn_factor: q and k times it, after RoPE (Phi's long RoPE)
    n_ctx_orig: int  # rope.scaling.original_context_length: longer sequences take the long factors


class Weights:
    """A GGUF file's metadata and tensors, dequantized to float64 by the ``gguf`` package whenever
    asked for (nothing is kept: a real model does not fit in memory as float64). ``expert_levels``:
    round the experts' inputs (routed and shared) to that many 8-bit levels per 32 values first,
    as a quantized file's experts in the engine are (``rounded``); 0, the default, leaves them
    exact."""

    def __init__(self, path: Path | str, expert_levels: int = 0) -> None:
        self.expert_levels = expert_levels
        self.reader = gguf.GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self.meta("general.architecture")

        def opt(key: str, default: object = 0) -> object:
            return self.meta(f"{arch}.{key}", default)

        embd, n_heads = opt("embedding_length", _REQUIRED), opt("attention.head_count", _REQUIRED)
        head_dim = opt("attention.key_length", embd // n_heads)
        self.config = Config(
            arch=arch,
            n_layers=opt("block_count", _REQUIRED) - opt("nextn_predict_layers"),
            n_heads=n_heads,
            n_kv_heads=opt("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            rope_dim=opt("rope.dimension_count", head_dim),
            rope_base=float(opt("rope.freq_base", 10000.0)),
            eps=float(opt("attention.layer_norm_rms_epsilon", 1e-5)),
            n_used=opt("expert_used_count"),
            norm_topk=opt("expert_weights_norm", None),
            scale=float(opt("expert_weights_scale", 0.0)),
            n_groups=opt("expert_group_count"),
            n_groups_used=opt("expert_group_used_count"),
            n_dense_lead=opt("leading_dense_block_count"),
            window=opt("attention.sliding_window"),
            swa_pattern=opt("attention.sliding_window_pattern", None),
            rope_base_swa=float(opt("rope.freq_base_swa", 10000.0)),
            rope_linear=float(opt("rope.scaling.factor", 0.0) or 1.0)
            if opt("rope.scaling.type", "linear") == "linear" else 1.0,
            attn_scale=0.0,
            rope_attn=float(opt("rope.scaling.attn_factor", 1.0)),
            n_ctx_orig=opt("rope.scaling.original_context_length", opt("context_length", 0)),
        )

    def meta(self, key: str, default: object = _REQUIRED) -> object:
        field = self.reader.fields.get(key)
        if field is not None:
            return field.contents()
        if default is _REQUIRED:
            raise KeyError(f"{key} is missing from the file's metadata")
        return default

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> np.ndarray:
        """The whole tensor, numpy order: a vector, a matrix [rows, row length], or experts
        [expert, rows, row length]."""
        t = self.tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)

    def rows(self, name: str, index: Sequence[int] | slice) -> np.ndarray:
        """Some rows of a matrix (the embedding's rows of the tokens), the others left unread."""
        t = self.tensors[name]
        return gguf.quants.dequantize(t.data[index], t.tensor_type).astype(np.float64)


# -- the pieces every architecture is made of ------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Each row (or each head, for a [..., head_dim] weight) over its root mean square."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def head_norm(x: np.ndarray, weight: np.ndarray, head_dim: int, eps: float) -> np.ndarray:
    """RMSNorm of every head of every row (qwen3moe's and glm4moe's q and k norms)."""
    heads = x.reshape(x.shape[0], -1, head_dim)
    return rms_norm(heads, weight, eps).reshape(x.shape)


def rope(x: np.ndarray, head_dim: int, rope_dim: int, base: float, neox: bool,
         divisors: np.ndarray | float = 1.0, mscale: float = 1.0) -> np.ndarray:
    """Rotary position embedding of rows at positions 0, 1, …: in each head, pair i of the first
    ``rope_dim`` dimensions turns by ``position * base^(-2i / rope_dim) / divisors[i]``; the other
    dimensions pass (partial rotary). The pairs are ``(2i, 2i+1)`` in llama's GGUF layout (ggml's
    "normal"; the converter permuted the q and k rows to it), ``(i, i + rope_dim/2)`` with ``neox``
    (Hugging Face's ``rotate_half``). ``divisors``: a linear scaling's factor, or Llama 3's
    per-frequency factors (the file's ``rope_freqs``). ``mscale`` scales the rotated dimensions
    (Phi's long RoPE's attention factor)."""
    t_rows = x.shape[0]
    heads = x.reshape(t_rows, -1, head_dim).copy()
    half = rope_dim // 2
    angle = np.arange(t_rows)[:, None] * base ** (-2.0 * np.arange(half) / rope_dim) / divisors
    cos, sin = mscale * np.cos(angle)[:, None, :], mscale * np.sin(angle)[:, None, :]
    if neox:
        a, b = heads[..., :half], heads[..., half:rope_dim]
    else:
        a, b = heads[..., 0:rope_dim:2], heads[..., 1:rope_dim:2]
    a, b = a * cos - b * sin, a * sin + b * cos
    if neox:
        heads[..., :half], heads[..., half:rope_dim] = a, b
    else:
        heads[..., 0:rope_dim:2], heads[..., 1:rope_dim:2] = a, b
    return heads.reshape(x.shape)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, n_kv_heads: int,
              scale: float = 0.0, window: int = 0) -> np.ndarray:
    """Causal softmax attention, ``softmax(q·kᵀ · scale) · v`` per head (``scale`` 0: 1/sqrt(d));
    grouped-query: query head h reads key/value head ``h // (n_heads / n_kv_heads)``. Rows are
    positions 0, 1, …; ``window`` > 0: row p sees positions p - window + 1 .. p only."""
    t_rows = q.shape[0]
    q = q.reshape(t_rows, n_heads, -1).transpose(1, 0, 2)  # [head, position, d]
    k = np.repeat(k.reshape(t_rows, n_kv_heads, -1).transpose(1, 0, 2), n_heads // n_kv_heads, axis=0)
    v = np.repeat(v.reshape(t_rows, n_kv_heads, -1).transpose(1, 0, 2), n_heads // n_kv_heads, axis=0)
    scores = q @ k.transpose(0, 2, 1) * (scale or 1.0 / np.sqrt(q.shape[-1]))
    seen = np.tril(np.ones((t_rows, t_rows), bool))
    if window > 0:
        seen &= np.subtract.outer(np.arange(t_rows), np.arange(t_rows)) < window
    scores = np.where(seen, scores, -np.inf)
    out = softmax(scores) @ v  # [head, position, value d]
    return out.transpose(1, 0, 2).reshape(t_rows, -1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, levels: int = 0) -> np.ndarray:
    """The gated feed-forward of every architecture here: ``down(silu(gate·h) * up·h)``, each
    matrix's input ``rounded`` to ``levels`` first (0: exact)."""
    h = rounded(h, levels)
    return rounded(silu(h @ gate.T) * (h @ up.T), levels) @ down.T


def dense_ffn(w: Weights, prefix: str, h: np.ndarray, suffix: str = "") -> np.ndarray:
    """A layer's SwiGLU (``suffix`` ""), or its shared expert (``suffix`` "_shexp", its inputs
    ``rounded`` to ``w.expert_levels`` as the routed experts' are)."""
    levels = w.expert_levels if suffix else 0
    return swiglu(h, *(w[f"{prefix}ffn_{m}{suffix}.weight"] for m in ("gate", "up", "down")), levels)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of each row's k highest scores, best first (ties: the lower index first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def rounded(x: np.ndarray, levels: int) -> np.ndarray:
    """Each row of ``x`` as ``levels`` 8-bit levels per 32 values, as the engine's integer matmul
    takes its activations: Q8_0's rounding (the step max|x| / 127 in float32, ties to even), then
    each remainder's on a step 254 times finer; 0 levels, ``x`` itself."""
    if levels == 0:
        return x
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True).astype(np.float32) / np.float32(127.0)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    rest, seen = blocks.copy(), np.zeros_like(blocks)
    for _ in range(levels):
        part = np.clip(np.rint(rest * inv), -127, 127) * d
        seen, rest = seen + part, rest - part
        d, inv = d / np.float32(254.0), inv * 254.0
    return seen.reshape(x.shape)


def experts(w: Weights, prefix: str, h: np.ndarray, chosen: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``sum_r weight[t, r] * expert_{chosen[t, r]}(h[t])`` for every row t: the routed experts,
    each a SwiGLU, slices of the layer's 3-D tensors ``ffn_{gate,up,down}_exps``, their inputs
    ``rounded`` to ``w.expert_levels``."""
    gate, up, down = (w[f"{prefix}ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for e, g in zip(chosen[t], weight[t], strict=True):
            out[t] += g * swiglu(h[t : t + 1], gate[e], up[e], down[e], w.expert_levels)[0]
    return out


def softmax_routing(logits: np.ndarray, k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """mixtral, qwen2moe, qwen3moe: probabilities over all experts, the k most probable, weighted
    by their probabilities (renormalised to sum 1, or as they are)."""
    probs = softmax(logits)
    chosen = top_k(probs, k)
    weight = np.take_along_axis(probs, chosen, axis=-1)
    return chosen, weight / weight.sum(-1, keepdims=True) if renormalise else weight


def output(w: Weights, x: np.ndarray) -> np.ndarray:
    """The final norm and the output matrix (the embedding's when the file has no ``output``),
    in slices of rows so that a large vocabulary's matrix is never all in float64 at once."""
    h = rms_norm(x, w["output_norm.weight"], w.config.eps)
    name = "output.weight" if "output.weight" in w else "token_embd.weight"
    n_vocab = w.tensors[name].data.shape[0]
    return np.concatenate(
        [h @ w.rows(name, slice(a, a + 8192)).T for a in range(0, n_vocab, 8192)], axis=1
    )


def linear(w: Weights, name: str, h: np.ndarray) -> np.ndarray:
    """``h @ W.T``, plus the bias where the file has one (qwen2moe's and glm4moe's q, k, v)."""
    y = h @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def grouped_top_k(scores: np.ndarray, k: int, n_groups: int, n_groups_used: int) -> np.ndarray:
    """glm4moe's (and DeepSeek's) choice: the experts fall into ``n_groups`` equal groups, a group
    ranks by the sum of its two best scores, and the k are taken from the ``n_groups_used`` best
    groups only. One group (or none said): plain top-k."""
    if n_groups <= 1:
        return top_k(scores, k)
    groups = scores.reshape(scores.shape[0], n_groups, -1)
    group_score = -np.sort(-groups, axis=-1)[..., :2].sum(-1)
    kept = np.zeros(group_score.shape, bool)
    np.put_along_axis(kept, top_k(group_score, n_groups_used), True, axis=-1)
    allowed = np.repeat(kept, groups.shape[-1], axis=-1)
    return top_k(np.where(allowed, scores, -np.inf), k)


# -- the architectures: one function each, embedding to logits -------------------------------------


def self_attention(w: Weights, p: str, x: np.ndarray, neox: bool, qk_norm: bool = False,
                   local: bool = False) -> np.ndarray:
    """A layer's attention half, before its residual add: ``rms_norm``, q/k/v (fused in
    ``attn_qkv`` or apart, with their biases where the file has them), per-head q and k norms
    (``qk_norm``), RoPE, causal GQA attention, the output projection. A ``local`` layer: the
    window, and RoPE at the local base without the linear scaling."""
    c = w.config
    h = rms_norm(x, w[p + "attn_norm.weight"], c.eps)
    if p + "attn_qkv.weight" in w:
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q, k, v = np.split(linear(w, p + "attn_qkv", h), [q_dim, q_dim + kv_dim], axis=1)
    else:
        q, k, v = (linear(w, p + f"attn_{n}", h) for n in "qkv")
    if qk_norm:
        q = head_norm(q, w[p + "attn_q_norm.weight"], c.head_dim, c.eps)
        k = head_norm(k, w[p + "attn_k_norm.weight"], c.head_dim, c.eps)
    base, divisors = (c.rope_base_swa, 1.0) if local else (c.rope_base, c.rope_linear)
    phi = "rope_factors_long" if x.shape[0] > c.n_ctx_orig else "rope_factors_short"
    for factors in ("rope_freqs.weight", phi + ".weight"):  # Llama 3's; Phi's long RoPE, by length
        if factors in w:
            divisors = divisors * w[factors]
    q = rope(q, c.head_dim, c.rope_dim, base, neox=neox, divisors=divisors, mscale=c.rope_attn)
    k = rope(k, c.head_dim, c.rope_dim, base, neox=neox, divisors=divisors, mscale=c.rope_attn)
    out = attention(q, k, v, c.n_heads, c.n_kv_heads, c.attn_scale, c.window if local else 0)
    return out @ w[p + "attn_output.weight"].T


def llama(w: Weights, ids: np.ndarray) -> np.ndarray:
    """llama (SmolLM2, Llama 2/3, Mistral) and, with ``ffn_gate_inp`` in a layer, mixtral's
    experts. A layer: ``x += attention(rms_norm(x))``, ``x += ffn(rms_norm(x))``; RoPE on
    adjacent pairs of the whole head; experts: softmax top-k, weights renormalised to sum 1."""
    c = w.config
    x = w.rows("token_embd.weight", ids)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = x + self_attention(w, p, x, neox=False)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        if p + "ffn_gate_inp.weight" not in w:
            x = x + dense_ffn(w, p, h)
            continue
        renormalise = c.norm_topk is not False  # mixtral: yes, unless the file says otherwise
        chosen, weight = softmax_routing(h @ w[p + "ffn_gate_inp.weight"].T, c.n_used, renormalise)
        x = x + experts(w, p, h, chosen, weight)
    return output(w, x)


def qwen2moe(w: Weights, ids: np.ndarray) -> np.ndarray:
    """Qwen1.5-MoE, Qwen2-57B-A14B. Biases on q, k and v; NEOX RoPE on the whole head. Experts:
    softmax top-k with the probabilities as they are (not renormalised), plus a shared expert
    scaled by ``sigmoid(ffn_gate_inp_shexp · h)``. A layer without a router is a dense SwiGLU."""
    c = w.config
    x = w.rows("token_embd.weight", ids)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = x + self_attention(w, p, x, neox=True)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        if p + "ffn_gate_inp.weight" not in w:
            x = x + dense_ffn(w, p, h)
            continue
        renormalise = c.norm_topk is True  # Hugging Face's norm_topk_prob, False by default
        chosen, weight = softmax_routing(h @ w[p + "ffn_gate_inp.weight"].T, c.n_used, renormalise)
        shared_gate = sigmoid(h @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1))[:, None]
        x = x + experts(w, p, h, chosen, weight) + shared_gate * dense_ffn(w, p, h, "_shexp")
    return output(w, x)


def qwen3moe(w: Weights, ids: np.ndarray) -> np.ndarray:
    """Qwen3-30B-A3B, Qwen3-235B-A22B. No biases; each head of q and k RMS-normalised before NEOX
    RoPE; the head size (``key_length``) need not be the width over the heads. Experts: softmax
    top-k renormalised to sum 1, no shared expert."""
    c = w.config
    x = w.rows("token_embd.weight", ids)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = x + self_attention(w, p, x, neox=True, qk_norm=True)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        if p + "ffn_gate_inp.weight" not in w:  # Hugging Face's mlp_only_layers
            x = x + dense_ffn(w, p, h)
            continue
        renormalise = c.norm_topk is not False
        chosen, weight = softmax_routing(h @ w[p + "ffn_gate_inp.weight"].T, c.n_used, renormalise)
        x = x + experts(w, p, h, chosen, weight)
    return output(w, x)


def glm4moe(w: Weights, ids: np.ndarray) -> np.ndarray:
    """GLM-4.5, GLM-4.5-Air. Biases on q, k, v; per-head q and k norms where the file has them;
    NEOX RoPE on the first ``rope_dim`` dimensions of each head only. The FFN's norm is
    ``post_attention_norm``; the first ``leading_dense_block_count`` layers are dense. Experts:
    ``s = sigmoid(router · h)``, chosen by ``s + exp_probs_b`` within the best groups, weighted by
    ``s`` itself, renormalised (``expert_weights_norm``), times ``expert_weights_scale``; plus an
    ungated shared expert. The next-token-prediction layers at the file's end are not run here
    (``glm4moe_nextn``)."""
    return output(w, glm4moe_hidden(w, ids))


def glm4moe_hidden(w: Weights, ids: np.ndarray) -> np.ndarray:
    """The last layer's output at every position, before the final norm."""
    x = w.rows("token_embd.weight", ids)
    for i in range(w.config.n_layers):
        x = glm4moe_layer(w, i, x)
    return x


def glm4moe_layer(w: Weights, i: int, x: np.ndarray) -> np.ndarray:
    c, p = w.config, f"blk.{i}."
    x = x + self_attention(w, p, x, neox=True, qk_norm=p + "attn_q_norm.weight" in w)
    h = rms_norm(x, w[p + "post_attention_norm.weight"], c.eps)
    if i < c.n_dense_lead or p + "ffn_gate_inp.weight" not in w:
        return x + dense_ffn(w, p, h)
    s = sigmoid(h @ w[p + "ffn_gate_inp.weight"].T)
    chosen = grouped_top_k(s + w[p + "exp_probs_b.bias"], c.n_used, c.n_groups, c.n_groups_used)
    weight = np.take_along_axis(s, chosen, axis=-1)
    if c.norm_topk:  # llama.cpp's default: not renormalised unless the file says so
        weight = weight / weight.sum(-1, keepdims=True)
    weight = weight * (c.scale or 1.0)
    return x + experts(w, p, h, chosen, weight) + dense_ffn(w, p, h, "_shexp")


def glm4moe_nextn(w: Weights, ids: Sequence[int]) -> np.ndarray:
    """The first next-token-prediction (MTP) layer's logits, [len(ids) - 1, n_vocab]: row p takes
    the last hidden state at p after the final norm and the embedding of ``ids[p + 1]`` (zeros at
    position 0, as vLLM's GLM-4.5 MTP has it), and predicts ``ids[p + 2]``. ``x = eh_proj ·
    [enorm(e) ; hnorm(h)]``, a whole glm4moe layer (attention over the MTP rows, its own experts),
    ``shared_head_norm``, the output matrix (the layer's own ``shared_head_head`` if it has one)."""
    c, ids, p = w.config, np.asarray(ids, np.int64), f"blk.{w.config.n_layers}.nextn."
    e = w.rows(p + "embed_tokens.weight" if p + "embed_tokens.weight" in w else "token_embd.weight", ids[1:])
    e = rms_norm(e * (np.arange(len(e)) > 0)[:, None], w[p + "enorm.weight"], c.eps)  # zeros at 0
    h = rms_norm(glm4moe_hidden(w, ids)[:-1], w["output_norm.weight"], c.eps)
    h = rms_norm(h, w[p + "hnorm.weight"], c.eps)
    x = glm4moe_layer(w, c.n_layers, np.concatenate([e, h], 1) @ w[p + "eh_proj.weight"].T)
    x = rms_norm(x, w[p + "shared_head_norm.weight"], c.eps)
    head = next(n for n in (p + "shared_head_head.weight", "output.weight", "token_embd.weight") if n in w)
    return x @ w[head].T


def dense(w: Weights, ids: np.ndarray) -> np.ndarray:
    """qwen2 (q/k/v biases), qwen3 (per-head q/k norms) and phi3 (q, k, v fused in ``attn_qkv``;
    gate and up fused in ``ffn_up``, gate first): llama's layer with NEOX RoPE, each variant as
    the tensors present say."""
    c = w.config
    x = w.rows("token_embd.weight", ids)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = x + self_attention(w, p, x, neox=True, qk_norm=p + "attn_q_norm.weight" in w)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        if p + "ffn_gate.weight" in w:
            x = x + dense_ffn(w, p, h)
        else:
            gate, up = np.split(h @ w[p + "ffn_up.weight"].T, 2, axis=1)
            x = x + (silu(gate) * up) @ w[p + "ffn_down.weight"].T
    return output(w, x)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gemma3_local(c: Config, layer: int) -> bool:
    """Whether a Gemma 3 layer is a sliding-window one: as the file's pattern says, else five
    local layers and a global one (Gemma 3's own pattern, llama.cpp's default)."""
    if c.window <= 0:
        return False
    if isinstance(c.swa_pattern, list):
        return bool(c.swa_pattern[layer])
    period = 6 if c.swa_pattern is None else int(c.swa_pattern)
    return period == 0 or layer % period < period - 1


def gemma3(w: Weights, ids: np.ndarray) -> np.ndarray:
    """Gemma 3. Embeddings times sqrt(n_embd); a layer: ``x += post_norm(attention(rms_norm(x)))``,
    ``x += post_ffw_norm(geglu(rms_norm(x)))`` with the tanh GELU; per-head q/k norms, NEOX
    RoPE; sliding-window layers with their own RoPE base (``gemma3_local``); q·k scaled by
    1/sqrt(head_dim) (1/sqrt(n_embd / n_heads) for the 62-layer 27B). The norms' weights hold
    Gemma's +1 already (the converter adds it)."""
    n_embd = w.meta(f"{w.config.arch}.embedding_length")
    if w.config.n_layers == 62:  # (a copy: the caller's Weights keep their config)
        w = copy.copy(w)
        w.config = replace(w.config, attn_scale=1.0 / np.sqrt(n_embd // w.config.n_heads))
    c = w.config
    x = w.rows("token_embd.weight", ids) * np.float64(np.float32(np.sqrt(n_embd)))
    for i in range(c.n_layers):
        p = f"blk.{i}."
        a = self_attention(w, p, x, neox=True, qk_norm=True, local=gemma3_local(c, i))
        x = x + rms_norm(a, w[p + "post_attention_norm.weight"], c.eps)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        gate, up, down = (w[f"{p}ffn_{m}.weight"] for m in ("gate", "up", "down"))
        f = (gelu_tanh(h @ gate.T) * (h @ up.T)) @ down.T
        x = x + rms_norm(f, w[p + "post_ffw_norm.weight"], c.eps)
    return output(w, x)


ARCHITECTURES: dict[str, Callable[[Weights, np.ndarray], np.ndarray]] = {
    "llama": llama,
    "qwen2": dense,
    "qwen3": dense,
    "phi3": dense,
    "gemma3": gemma3,
    "qwen2moe": qwen2moe,
    "qwen3moe": qwen3moe,
    "glm4moe": glm4moe,
}


def forward(w: Weights | Path | str, ids: Sequence[int]) -> np.ndarray:
    """The logits [len(ids), n_vocab] (float64) at every position of the token sequence ``ids``,
    the first at position 0."""
    w = w if isinstance(w, Weights) else Weights(w)
    arch = ARCHITECTURES.get(w.config.arch)
    if arch is None:
        have = ", ".join(ARCHITECTURES)
        raise ValueError(f"no reference for architecture {w.config.arch!r} (have: {have})")
    return arch(w, np.asarray(ids, np.int64))
