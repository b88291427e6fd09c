"""The pieces every architecture is made of, in float64 numpy: norms, RoPE, attention, the gated
feed-forward, the routers, the experts, the output head."""

from __future__ import annotations

import numpy as np

from colibri.model.reference.weights import Config, Weights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Each row (or each head, for a [..., head_dim] weight) over its root mean square."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def span_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of q or k over spans as wide as ``weight``: every head (qwen3moe's and glm4moe's
    head_dim-wide weights) or the whole row (olmoe's, all heads at once)."""
    spans = x.reshape(x.shape[0], -1, weight.shape[0])
    return rms_norm(spans, weight, eps).reshape(x.shape)


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' ``get_mscale``: YaRN's magnitude for a context ``factor`` times longer."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * np.log(factor) + 1.0


def yarn(c: Config) -> tuple[np.ndarray | float, float, float]:
    """YaRN as transformers' ``_compute_yarn_parameters`` has it: (per-pair divisors of the inverse
    frequencies, the rotated pairs' magnitude, q·k's scale factor). A pair turning ``beta_fast``
    times or more over the original context keeps its frequency, ``beta_slow`` times or fewer is
    divided by the factor, linear between. DeepSeek's files keep 0.1 * mscale_all_dim; its mscale,
    not kept, is taken to equal it (llama.cpp's reading): magnitude 1, and q·k scaled by
    get_mscale(factor, mscale_all_dim)². Not YaRN: (1, 1, 1)."""
    if c.rope_type != "yarn" or c.rope_factor <= 1.0:
        return 1.0, 1.0, 1.0
    d, half = c.rope_dim, c.rope_dim // 2

    def turns_at(n: float) -> float:
        return d * np.log(c.n_ctx_orig / (n * 2 * np.pi)) / (2 * np.log(c.rope_base))

    low, high = max(np.floor(turns_at(c.yarn_betas[0])), 0), min(np.ceil(turns_at(c.yarn_betas[1])), d - 1)
    ramp = np.clip((np.arange(half) - low) / (high - low if high > low else 0.001), 0.0, 1.0)
    extrapolated = 1.0 - ramp
    inv = (1.0 - extrapolated) / c.rope_factor + extrapolated  # times the unscaled inverse frequency
    if c.yarn_log_mul:
        return 1.0 / inv, 1.0, yarn_mscale(c.rope_factor, c.yarn_log_mul / 0.1) ** 2
    return 1.0 / inv, yarn_mscale(c.rope_factor), 1.0


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


def swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, levels: int = 0,
           block: int = 32) -> np.ndarray:
    """The gated feed-forward of every architecture here: ``down(silu(gate·h) * up·h)``, each
    matrix's input ``rounded`` to ``levels`` per ``block`` values first (0: exact)."""
    h = rounded(h, levels, block)
    return rounded(silu(h @ gate.T) * (h @ up.T), levels, block) @ down.T


def dense_ffn(w: Weights, prefix: str, h: np.ndarray, suffix: str = "") -> np.ndarray:
    """A layer's SwiGLU (``suffix`` ""), or its shared expert (``suffix`` "_shexp", its inputs
    ``rounded`` to ``w.expert_levels`` as the routed experts' are)."""
    levels = w.expert_levels if suffix else 0
    return swiglu(h, *(w[f"{prefix}ffn_{m}{suffix}.weight"] for m in ("gate", "up", "down")), levels,
                  w.expert_block)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of each row's k highest scores, best first (ties: the lower index first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def rounded(x: np.ndarray, levels: int, block: int = 32) -> np.ndarray:
    """Each row of ``x`` as ``levels`` 8-bit levels per ``block`` values (the engine's: 32), as the
    engine's integer matmul takes its activations: Q8_0's rounding (the step max|x| / 127 in
    float32, ties to even), then each remainder's on a step 254 times finer; 0 levels, ``x``
    itself."""
    if levels == 0:
        return x
    blocks = x.reshape(x.shape[0], -1, block)
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
            out[t] += g * swiglu(h[t : t + 1], gate[e], up[e], down[e], w.expert_levels, w.expert_block)[0]
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




def self_attention(w: Weights, p: str, x: np.ndarray, neox: bool, qk_norm: bool = False,
                   local: bool = False) -> np.ndarray:
    """A layer's attention half, before its residual add: ``rms_norm``, q/k/v (fused in
    ``attn_qkv`` or apart, with their biases where the file has them), q and k norms
    (``qk_norm``: per head, or over the whole row where the weight is that wide), RoPE, causal
    GQA attention, the output projection. A ``local`` layer: the window, and RoPE at the local
    base without the linear scaling."""
    c = w.config
    h = rounded(rms_norm(x, w[p + "attn_norm.weight"], c.eps), w.projection_levels, w.projection_block)
    if p + "attn_qkv.weight" in w:
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q, k, v = np.split(linear(w, p + "attn_qkv", h), [q_dim, q_dim + kv_dim], axis=1)
    else:
        q, k, v = (linear(w, p + f"attn_{n}", h) for n in "qkv")
    if qk_norm:
        q = span_norm(q, w[p + "attn_q_norm.weight"], c.eps)
        k = span_norm(k, w[p + "attn_k_norm.weight"], c.eps)
    divisors_yarn, magnitude, _ = yarn(c)
    base, divisors = (c.rope_base_swa, 1.0) if local else (c.rope_base, c.rope_linear * divisors_yarn)
    phi = "rope_factors_long" if x.shape[0] > c.n_ctx_orig else "rope_factors_short"
    for factors in ("rope_freqs.weight", phi + ".weight"):  # Llama 3's; Phi's long RoPE, by length
        if factors in w:
            divisors = divisors * w[factors]
    mscale = c.rope_attn * (1.0 if local else magnitude)
    q = rope(q, c.head_dim, c.rope_dim, base, neox=neox, divisors=divisors, mscale=mscale)
    k = rope(k, c.head_dim, c.rope_dim, base, neox=neox, divisors=divisors, mscale=mscale)
    out = attention(q, k, v, c.n_heads, c.n_kv_heads, c.attn_scale, c.window if local else 0)
    return rounded(out, w.projection_levels, w.projection_block) @ w[p + "attn_output.weight"].T
