"""The mixture-of-experts architectures: one function each, embedding to logits (glm4moe also its
next-token-prediction layer)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from colibri.model.reference.parts import (
    dense_ffn,
    experts,
    grouped_top_k,
    output,
    rms_norm,
    self_attention,
    sigmoid,
    softmax_routing,
)
from colibri.model.reference.weights import Weights


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


def olmoe(w: Weights, ids: np.ndarray) -> np.ndarray:
    """OLMoE (OLMoE-1B-7B). No biases; q and k each RMS-normalised over its whole width (every
    head at once: the weights are n_heads * head_dim wide) before NEOX RoPE. Experts: softmax
    top-k with the probabilities as they are unless the file says to renormalise (Hugging Face's
    ``norm_topk_prob``, false in OLMoE-1B-7B), no shared expert."""
    c = w.config
    x = w.rows("token_embd.weight", ids)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = x + self_attention(w, p, x, neox=True, qk_norm=True)
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.eps)
        chosen, weight = softmax_routing(h @ w[p + "ffn_gate_inp.weight"].T, c.n_used, c.norm_topk is True)
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
