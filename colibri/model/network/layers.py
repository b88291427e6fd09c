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
from colibri.model.kernels.ops import add_bias, add_into, rmsnorm, rmsnorm_heads, rope, swiglu
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.network.weights import (
    load_stack_or_apart,
    load_vector,
    load_weight,
    optional_vector,
    stacked_bias,
)
from colibri.store.gguf import GGUFFile
from colibri.store.packed import SwiGLUWeights, Weight

# -- attention -------------------------------------------------------------------------------------


class Attention(NamedTuple):
    """The attention half of a layer. Optional parts are empty vectors (one NamedTuple type for
    every variant, so numba compiles ``attention`` once)."""

    norm: np.ndarray  # RMSNorm before attention
    wqkv: Weight  # q, k and v stacked by rows: one matmul; or q and k, where v is apart
    wv: Weight  # v where its format would widen the stack (``load_stack_or_apart``); else empty
    bqkv: np.ndarray  # their biases, stacked (qwen2moe, glm4moe); empty: none
    q_norm: np.ndarray  # per-head RMSNorm of q and k before RoPE (qwen3moe, glm4moe); empty: none
    k_norm: np.ndarray
    wo: Weight


class AttnShape(NamedTuple):
    """The integers and floats attention needs, as one argument."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    neox: bool  # NEOX RoPE (pairs i, i + rope_dim/2) instead of llama's adjacent pairs


def load_attention(gguf: GGUFFile, i: int, hp: HParams) -> Attention:
    """Layer i's attention with llama.cpp's tensor names; biases and q/k norms when present."""
    p = f"blk.{i}."
    q_dim, kv_dim = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    wqkv, wv = load_stack_or_apart(gguf, *(p + f"attn_{x}.weight" for x in "qkv"))
    return Attention(
        norm=load_vector(gguf, p + "attn_norm.weight"),
        wqkv=wqkv,
        wv=wv,
        bqkv=stacked_bias(gguf, [p + f"attn_{x}.bias" for x in "qkv"], [q_dim, kv_dim, kv_dim]),
        q_norm=optional_vector(gguf, p + "attn_q_norm.weight"),
        k_norm=optional_vector(gguf, p + "attn_k_norm.weight"),
        wo=load_weight(gguf, p + "attn_output.weight"),
    )


@nb.njit(nogil=True, cache=True)
def attention(
    x: np.ndarray, a: Attention, sh: AttnShape, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_direct: int,
    h: np.ndarray,
) -> None:
    """``x += wo · attend(rope(q), rope(k), v)`` over rmsnorm(x), in place; every row writes its
    key and value into its slot first. ``h`` (T, n_embd) is scratch."""
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
    if a.q_norm.shape[0] > 0:
        rmsnorm_heads(q, a.q_norm, sh.n_heads, sh.head_dim, sh.eps)
    if a.k_norm.shape[0] > 0:
        rmsnorm_heads(k, a.k_norm, sh.n_kv, sh.head_dim, sh.eps)
    rope(q, positions, sh.n_heads, sh.head_dim, inv_freq, sh.neox)
    rope(k, positions, sh.n_kv, sh.head_dim, inv_freq, sh.neox)
    store_kv(k, v, k_cache, v_cache, layer, slots, positions, sh.n_kv, sh.head_dim)
    attn = np.empty((t_rows, q_dim), np.float32)
    attend(q, k_cache, v_cache, layer, slots, positions, sh.n_heads, sh.n_kv, attn)
    qmatmul(attn, a.wo, h, n_direct)
    add_into(x, h)


# -- feed-forward ----------------------------------------------------------------------------------


# A SwiGLU feed-forward: a dense layer's FFN, a shared expert, and a routed expert (the expert
# store hands out the same type), so numba compiles ``swiglu_ffn`` once for all three.
FFN = SwiGLUWeights


def load_ffn(gguf: GGUFFile, prefix: str, suffix: str = "") -> FFN:
    """``{prefix}ffn_gate{suffix}.weight`` etc.: suffix "" (dense) or "_shexp" (shared expert)."""
    return FFN(
        gate_up=load_weight(gguf, f"{prefix}ffn_gate{suffix}.weight", f"{prefix}ffn_up{suffix}.weight"),
        down=load_weight(gguf, f"{prefix}ffn_down{suffix}.weight"),
    )


@nb.njit(nogil=True, cache=True)
def swiglu_ffn(h: np.ndarray, gate_up: Weight, down: Weight, n_direct: int, out: np.ndarray) -> None:
    """``out = down(silu(gate · h) * (up · h))`` for every row of ``h``."""
    n_ff = gate_up.n_rows // 2
    gu = np.empty((h.shape[0], 2 * n_ff), np.float32)
    qmatmul(h, gate_up, gu, n_direct)
    gate = np.ascontiguousarray(gu[:, :n_ff])
    swiglu(gate, gu[:, n_ff:])
    qmatmul(gate, down, out, n_direct)


@nb.njit(nogil=True, cache=True)
def dense_layer(
    x: np.ndarray, a: Attention, ffn_norm: np.ndarray, f: FFN, sh: AttnShape, k_cache: np.ndarray,
    v_cache: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
    n_direct: int,
) -> None:
    """A whole dense layer in one compiled call: attention, then ``x += ffn(rmsnorm(x))``."""
    h = np.empty_like(x)
    attention(x, a, sh, k_cache, v_cache, layer, slots, positions, inv_freq, n_direct, h)
    rmsnorm(x, ffn_norm, sh.eps, h)
    out = np.empty_like(x)
    swiglu_ffn(h, f.gate_up, f.down, n_direct, out)
    add_into(x, out)


@nb.njit(nogil=True, cache=True)
def attention_then_norm(
    x: np.ndarray, a: Attention, ffn_norm: np.ndarray, sh: AttnShape, k_cache: np.ndarray,
    v_cache: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
    n_direct: int, h: np.ndarray,
) -> None:
    """The first half of a MoE layer in one compiled call: attention on ``x``, then
    ``h = rmsnorm(x)``, the input of the experts."""
    attention(x, a, sh, k_cache, v_cache, layer, slots, positions, inv_freq, n_direct, h)
    rmsnorm(x, ffn_norm, sh.eps, h)
