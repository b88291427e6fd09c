"""The parts of a layer every architecture here shares: the attention half (with its variants)
and the dense SwiGLU feed-forward, each loaded from the file and computed by one compiled call.

``decoder.py`` runs them layer by layer; an architecture's subclass only says how its layers differ.
A forward step is a ragged batch (see ``docs/architecture.md``): row t is token ``tokens[t]`` of KV
slot ``slots[t]`` at ``positions[t]``; rows ``[0, n_direct)`` are decode rows, the rest prompt
rows (only float and in-place block weights take them apart, ``quant_matmul``). A row's result never
depends on the other rows of the step.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.attention import attend, store_kv
from colibri.model.kernels.ops import (
    add_bias,
    add_into,
    geglu,
    rmsnorm,
    rmsnorm_heads,
    rope_angles,
    rotate,
    swiglu,
)
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.network.weights import (
    load_stack_or_apart,
    load_vector,
    load_weight,
    named_norm,
    optional_vector,
    stacked_bias,
)
from colibri.store.gguf import GGUFError, GGUFFile
from colibri.store.packed import EMPTY_WEIGHT, SwiGLUWeights, Weight

# -- attention -------------------------------------------------------------------------------------


class Attention(NamedTuple):
    """The attention half of a layer. Optional parts are empty vectors (one NamedTuple type for
    every variant, so numba compiles ``attention`` once)."""

    norm: np.ndarray  # RMSNorm before attention
    wqkv: Weight  # q, k and v stacked by rows: one matmul; or q and k, where v is apart
    wv: Weight  # v where its format would widen the stack (``load_stack_or_apart``); else empty
    bqkv: np.ndarray  # their biases, stacked (qwen2, qwen2moe, glm4moe); empty: none
    # RMSNorm of q and k before RoPE: per head where head_dim wide (qwen3, gemma3, glm4moe), over
    # the whole row where as wide as q or k (olmoe); empty: none
    q_norm: np.ndarray
    k_norm: np.ndarray
    wo: Weight
    bo: np.ndarray  # the output's bias (gpt-oss); empty: none
    sinks: np.ndarray  # a logit per query head in each softmax, weighing no value (gpt-oss); empty: none
    post_norm: np.ndarray  # RMSNorm of the output before the residual add (gemma3); empty: none


class LayerShape(NamedTuple):
    """The integers, floats and switches of one layer, as one argument (one per layer: a
    sliding-window layer differs from a global one)."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    neox: bool  # NEOX RoPE (pairs i, i + rope_dim/2) instead of llama's adjacent pairs
    scale: float  # of q·k: 1/sqrt(head_dim) unless the architecture says otherwise
    window: int  # > 0: a sliding-window layer, each row attending to its last ``window`` positions
    gelu: bool  # the FFN is a GeGLU (tanh GELU), not a SwiGLU (gemma3)
    mscale: float  # RoPE's rotated pairs scaled by it (rope.scaling.attn_factor; 1: none)


def load_attention(gguf: GGUFFile, i: int, hp: HParams, post_norm: str = "") -> Attention:
    """Layer i's attention with llama.cpp's tensor names: q, k and v apart or fused (``attn_qkv``,
    phi3); biases, q/k norms and sinks when present; ``post_norm``: the output's norm's name, if any."""
    p = f"blk.{i}."
    q_dim, kv_dim = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    if p + "attn_qkv.weight" in gguf.tensors:
        wqkv, wv = load_weight(gguf, p + "attn_qkv.weight"), EMPTY_WEIGHT
        bqkv = optional_vector(gguf, p + "attn_qkv.bias")
    else:
        wqkv, wv = load_stack_or_apart(gguf, *(p + f"attn_{x}.weight" for x in "qkv"))
        bqkv = stacked_bias(gguf, [p + f"attn_{x}.bias" for x in "qkv"], [q_dim, kv_dim, kv_dim])
    sinks = optional_vector(gguf, p + "attn_sinks.weight")
    if sinks.shape[0] not in (0, hp.n_heads):  # the kernel indexes it by query head, unchecked
        raise GGUFError(f"{gguf.path}: {p}attn_sinks.weight has {sinks.shape[0]} values for "
                        f"{hp.n_heads} heads")
    return Attention(
        norm=load_vector(gguf, p + "attn_norm.weight"),
        wqkv=wqkv,
        wv=wv,
        bqkv=bqkv,
        q_norm=optional_vector(gguf, p + "attn_q_norm.weight"),
        k_norm=optional_vector(gguf, p + "attn_k_norm.weight"),
        wo=load_weight(gguf, p + "attn_output.weight"),
        bo=optional_vector(gguf, p + "attn_output.bias"),
        sinks=sinks,
        post_norm=named_norm(gguf, p, post_norm),
    )


@nb.njit(nogil=True, cache=True)
def attention(
    x: np.ndarray, a: Attention, sh: LayerShape, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_direct: int,
    h: np.ndarray,
) -> None:
    """``x += wo · attend(rope(q), rope(k), v)`` over rmsnorm(x), in place (the sum normed first
    where the layer has a post-norm); every row writes its key and value into its slot first.
    ``h`` (T, n_embd) is scratch."""
    t_rows = x.shape[0]
    q_dim, kv_dim = sh.n_heads * sh.head_dim, sh.n_kv * sh.head_dim
    rmsnorm(x, a.norm, sh.eps, h)
    qkv = np.empty((t_rows, q_dim + 2 * kv_dim), np.float32)
    if a.wv.n_rows > 0:  # v apart: two matmuls into contiguous rows (the kernels' one layout)
        qk, v_apart = np.empty((t_rows, q_dim + kv_dim), np.float32), np.empty((t_rows, kv_dim), np.float32)
        qmatmul(h, a.wqkv, qk, n_direct)
        qmatmul(h, a.wv, v_apart, n_direct)
        qkv[:, : q_dim + kv_dim] = qk
        qkv[:, q_dim + kv_dim :] = v_apart
    else:
        qmatmul(h, a.wqkv, qkv, n_direct)
    if a.bqkv.shape[0] > 0:
        add_bias(qkv, a.bqkv)
    q = np.ascontiguousarray(qkv[:, :q_dim])
    k = np.ascontiguousarray(qkv[:, q_dim : q_dim + kv_dim])
    v = qkv[:, q_dim + kv_dim :]  # store_kv reads it in place
    if a.q_norm.shape[0] > 0:  # spans as wide as the weight: each head, or the whole row
        rmsnorm_heads(q, a.q_norm, q_dim // a.q_norm.shape[0], a.q_norm.shape[0], sh.eps)
    if a.k_norm.shape[0] > 0:
        rmsnorm_heads(k, a.k_norm, kv_dim // a.k_norm.shape[0], a.k_norm.shape[0], sh.eps)
    cos, sin = rope_angles(positions, inv_freq, sh.mscale)
    rotate(q, cos, sin, sh.n_heads, sh.head_dim, sh.neox)
    rotate(k, cos, sin, sh.n_kv, sh.head_dim, sh.neox)
    store_kv(k, v, k_cache, v_cache, layer, slots, positions, sh.n_kv, sh.head_dim)
    attn = np.empty((t_rows, q_dim), np.float32)
    attend(q, k_cache, v_cache, layer, slots, positions, sh.n_heads, sh.n_kv, attn, sh.scale, sh.window,
           a.sinks)
    qmatmul(attn, a.wo, h, n_direct)
    if a.bo.shape[0] > 0:
        add_bias(h, a.bo)
    add_normed(x, h, a.post_norm, sh.eps)


@nb.njit(nogil=True, cache=True)
def add_normed(x: np.ndarray, y: np.ndarray, norm: np.ndarray, eps: float) -> None:
    """``x += rmsnorm(y, norm)``, or ``x += y`` where ``norm`` is empty (no post-norm)."""
    if norm.shape[0] > 0:
        normed = np.empty_like(y)
        rmsnorm(y, norm, eps, normed)
        add_into(x, normed)
    else:
        add_into(x, y)


# -- feed-forward ----------------------------------------------------------------------------------


# A gated feed-forward: a dense layer's FFN, a shared expert, and a routed expert (the expert
# store hands out the same type), so numba compiles ``swiglu_ffn`` once for all three.
FFN = SwiGLUWeights
# A step's FFN goes through its rows FFN_ROWS at a time: its scratch (the gate/up rows, 2 n_ff
# floats a row, and the activated rows' copy) is a tile's, not the step's: a MoE model's prompt
# alone prefills in 512-token steps, where GLM-4.5-Air's dense first layer (5,888 wide, as the bench
# file's) held 36 MB of it against 9 at 128 rows. The weights are read once a tile: a tile of 128
# prompt rows is already bound by the dot products, not by reading them.
FFN_ROWS = 128


def load_ffn(gguf: GGUFFile, prefix: str, suffix: str = "") -> FFN:
    """``{prefix}ffn_gate{suffix}.weight`` etc.: suffix "" (dense) or "_shexp" (shared expert).
    Without ``ffn_gate``, ``ffn_up`` holds gate and up stacked (phi3's fused ``gate_up_proj``)."""
    up = f"{prefix}ffn_up{suffix}.weight"
    gate = f"{prefix}ffn_gate{suffix}.weight"
    return FFN(
        gate_up=load_weight(gguf, gate, up) if gate in gguf.tensors else load_weight(gguf, up),
        down=load_weight(gguf, f"{prefix}ffn_down{suffix}.weight"),
    )


@nb.njit(nogil=True, cache=True)
def swiglu_ffn(h: np.ndarray, gate_up: Weight, down: Weight, n_direct: int, out: np.ndarray,
               gelu: bool) -> None:
    """``out = down(silu(gate · h) * (up · h))`` for every row of ``h``, FFN_ROWS rows at a time
    (a row's result is its own: the same bits in any tile); ``gelu``: tanh GELU in place of silu
    (GeGLU)."""
    for a in range(0, h.shape[0], FFN_ROWS):
        b = min(a + FFN_ROWS, h.shape[0])
        _swiglu_rows(h[a:b], gate_up, down, min(max(n_direct - a, 0), b - a), out[a:b], gelu)


@nb.njit(nogil=True, cache=True)
def _swiglu_rows(h: np.ndarray, gate_up: Weight, down: Weight, n_direct: int, out: np.ndarray,
                 gelu: bool) -> None:
    n_ff = gate_up.n_rows // 2
    gu = np.empty((h.shape[0], 2 * n_ff), np.float32)
    qmatmul(h, gate_up, gu, n_direct)
    gate = np.ascontiguousarray(gu[:, :n_ff])
    if gelu:
        geglu(gate, gu[:, n_ff:])
    else:
        swiglu(gate, gu[:, n_ff:])
    qmatmul(gate, down, out, n_direct)


class FFNNorms(NamedTuple):
    """The norms around a layer's feed-forward: before it, and of its output before the residual
    add (gemma3; empty: none)."""

    pre: np.ndarray
    post: np.ndarray


@nb.njit(nogil=True, cache=True)
def dense_layer(
    x: np.ndarray, a: Attention, norms: FFNNorms, f: FFN, sh: LayerShape, k_cache: np.ndarray,
    v_cache: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
    n_direct: int,
) -> None:
    """A whole dense layer in one compiled call: attention, then ``x += ffn(rmsnorm(x))``."""
    h = np.empty_like(x)
    attention(x, a, sh, k_cache, v_cache, layer, slots, positions, inv_freq, n_direct, h)
    rmsnorm(x, norms.pre, sh.eps, h)
    out = np.empty_like(x)
    swiglu_ffn(h, f.gate_up, f.down, n_direct, out, sh.gelu)
    add_normed(x, out, norms.post, sh.eps)


@nb.njit(nogil=True, cache=True)
def attention_then_norm(
    x: np.ndarray, a: Attention, norms: FFNNorms, sh: LayerShape, k_cache: np.ndarray,
    v_cache: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
    n_direct: int, h: np.ndarray,
) -> None:
    """The first half of a MoE layer in one compiled call: attention on ``x``, then
    ``h = rmsnorm(x)``, the input of the experts."""
    attention(x, a, sh, k_cache, v_cache, layer, slots, positions, inv_freq, n_direct, h)
    rmsnorm(x, norms.pre, sh.eps, h)
