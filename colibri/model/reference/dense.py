"""The dense architectures (and llama's mixtral-style experts): one function each, embedding to
logits."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from colibri.model.reference.parts import (
    dense_ffn,
    experts,
    output,
    rms_norm,
    self_attention,
    silu,
    softmax_routing,
)
from colibri.model.reference.weights import Config, Weights


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
