"""DeepSeek's layout (GGUF ``deepseek2``: V2, V2-Lite, V3), embedding to logits, with its attention
written as the paper has it: every head's key and value decompressed from the token's latent.

Multi-head latent attention (DeepSeek-V2, section 2.1): a token's hidden state h gives a latent
``c = norm(W_kv_a h)[:kv_lora]`` and one rope key ``k_pe`` shared by the heads; head i's key is
``[W_k_b,i c ; k_pe]`` and its value ``W_v_b,i c``; its query ``[q_nope,i ; rope(q_pe,i)]``, from h
straight or through a low rank (``attn_q_a``, its norm, ``attn_q_b``). The engine attends in the
latent instead (queries through ``k_b``, the output through ``v_b``): the same numbers, another
order of the products, which is why this oracle keeps the decompressed form.
"""

from __future__ import annotations

import numpy as np

from colibri.model.reference.parts import (
    attention,
    dense_ffn,
    experts,
    grouped_top_k,
    output,
    rms_norm,
    rope,
    sigmoid,
    softmax,
    yarn,
)
from colibri.model.reference.weights import Weights

GATING_SIGMOID = 2  # expert_gating_func; 1 (and 0, a V2 file's absence of it) is softmax


def deepseek2(w: Weights, ids: np.ndarray) -> np.ndarray:
    """A layer: ``x += latent_attention(rms_norm(x))``, ``x += ffn(rms_norm(x, ffn_norm))``. The
    first ``leading_dense_block_count`` FFNs are dense; the others: scores softmax (V2) or sigmoid
    (V3) of the router's logits, the choice by score + ``exp_probs_b`` where the file has it,
    within the best groups (``grouped_top_k``), weighted by the scores, renormalised where the file
    says, times ``expert_weights_scale``; plus the ungated shared experts."""
    c = w.config
    x = w.rows("token_embd.weight", ids)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = x + latent_attention(w, p, x)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        if i < c.n_dense_lead:
            x = x + dense_ffn(w, p, h)
            continue
        logits = h @ w[p + "ffn_gate_inp.weight"].T
        s = sigmoid(logits) if c.gating == GATING_SIGMOID else softmax(logits)
        bias = w[p + "exp_probs_b.bias"] if p + "exp_probs_b.bias" in w else 0.0
        chosen = grouped_top_k(s + bias, c.n_used, c.n_groups, c.n_groups_used)
        weight = np.take_along_axis(s, chosen, axis=-1)
        if c.norm_topk:
            weight = weight / weight.sum(-1, keepdims=True)
        x = x + experts(w, p, h, chosen, weight * (c.scale or 1.0))
        if p + "ffn_gate_shexp.weight" in w:
            x = x + dense_ffn(w, p, h, "_shexp")
    return output(w, x)


def latent_attention(w: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """A layer's attention half, before its residual add, in the decompressed form: RoPE on adjacent
    pairs (ggml's "normal") of q's rope part and of the shared rope key, YaRN-scaled where the file
    says (``parts.yarn``); q·k scaled by 1/sqrt(key_length_mla) times YaRN's term."""
    c = w.config
    t_rows, n_heads, n_rope = x.shape[0], c.n_heads, c.rope_dim
    nope = c.k_mla - n_rope
    h = rms_norm(x, w[p + "attn_norm.weight"], c.eps)
    if p + "attn_q_a.weight" in w:
        q = rms_norm(h @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"], c.eps)
        q = q @ w[p + "attn_q_b.weight"].T
    else:
        q = h @ w[p + "attn_q.weight"].T
    q = q.reshape(t_rows, n_heads, c.k_mla)
    kv = h @ w[p + "attn_kv_a_mqa.weight"].T
    latent = rms_norm(kv[:, : c.kv_lora], w[p + "attn_kv_a_norm.weight"], c.eps)
    divisors, magnitude, scale = yarn(c)
    k_pe = rope(kv[:, c.kv_lora :], n_rope, n_rope, c.rope_base, False, divisors, magnitude * c.rope_attn)
    q_pe = rope(q[..., nope:].reshape(t_rows, -1), n_rope, n_rope, c.rope_base, False, divisors,
                magnitude * c.rope_attn)
    k_nope = np.einsum("tl,hln->thn", latent, w[p + "attn_k_b.weight"])  # k_b: [head, latent, nope]
    v = np.einsum("tl,hvl->thv", latent, w[p + "attn_v_b.weight"])  # v_b: [head, value, latent]
    q = np.concatenate([q[..., :nope], q_pe.reshape(t_rows, n_heads, n_rope)], axis=-1)
    k = np.concatenate([k_nope, np.repeat(k_pe[:, None, :], n_heads, axis=1)], axis=-1)
    scale *= (magnitude * c.rope_attn) ** 2 / np.sqrt(c.k_mla)
    out = attention(q.reshape(t_rows, -1), k.reshape(t_rows, -1), v.reshape(t_rows, -1), n_heads, n_heads,
                    scale)
    return out @ w[p + "attn_output.weight"].T
