"""The llama architecture (SmolLM2, Llama 2/3, Mistral …) as GGUF describes it.

A forward step takes a ragged batch of tokens, each with its KV slot and position, and returns the
logits of the rows asked for. One compiled call per layer (``llama_block``) does all of a layer's
work, so a decode step costs a few dozen compiled calls, whatever the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.attention import attend, store_kv
from colibri.model.kernels.ops import add_into, rmsnorm, rope, rope_frequencies, swiglu
from colibri.model.kernels.quant_matmul import Weight, dequantize_row, make_weight, qmatmul
from colibri.model.kv_cache import KVCache
from colibri.store.gguf import GGUFFile


class LlamaBlock(NamedTuple):
    attn_norm: np.ndarray
    wqkv: Weight  # q, k and v stacked by rows: one matmul
    wo: Weight
    ffn_norm: np.ndarray
    w_gate_up: Weight  # gate and up stacked by rows
    w_down: Weight


class Shape(NamedTuple):
    """The integers and floats a block needs, as one argument."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float


def load_weight(gguf: GGUFFile, *names: str) -> Weight:
    """One matrix from one or more tensors of the same row length, stacked by rows."""
    infos = [gguf.require_supported(n) for n in names]
    parts = [(gguf.raw(n), int(i.gtype)) for n, i in zip(names, infos, strict=True)]
    return make_weight(parts, infos[0].shape[0])


def load_vector(gguf: GGUFFile, name: str) -> np.ndarray:
    """A 1-D tensor (norm weights) as float32, dequantized if it was stored otherwise."""
    info = gguf.require_supported(name)
    out = np.empty(info.n_elements, dtype=np.float32)
    dequantize_row(gguf.raw(name).reshape(-1), int(info.gtype), out)
    return out


@nb.njit(nogil=True, cache=True)
def llama_block(
    x: np.ndarray, w: LlamaBlock, sh: Shape, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_direct: int,
) -> None:
    """One transformer layer on the residual stream ``x`` (T, n_embd), in place; rows
    ``[0, n_direct)`` take the matmuls' direct path (see ``qmatmul``)."""
    t_rows = x.shape[0]
    q_dim, kv_dim = sh.n_heads * sh.head_dim, sh.n_kv * sh.head_dim
    h = np.empty_like(x)
    rmsnorm(x, w.attn_norm, sh.eps, h)
    qkv = np.empty((t_rows, q_dim + 2 * kv_dim), np.float32)
    qmatmul(h, w.wqkv, qkv, n_direct)
    q = np.ascontiguousarray(qkv[:, :q_dim])
    k = np.ascontiguousarray(qkv[:, q_dim : q_dim + kv_dim])
    v = qkv[:, q_dim + kv_dim :]  # store_kv reads it in place
    rope(q, positions, sh.n_heads, sh.head_dim, inv_freq)
    rope(k, positions, sh.n_kv, sh.head_dim, inv_freq)
    store_kv(k, v, k_cache, v_cache, layer, slots, positions, sh.n_kv, sh.head_dim)
    attn = np.empty((t_rows, q_dim), np.float32)
    attend(q, k_cache, v_cache, layer, slots, positions, sh.n_heads, sh.n_kv, sh.head_dim, attn)
    qmatmul(attn, w.wo, h, n_direct)
    add_into(x, h)

    rmsnorm(x, w.ffn_norm, sh.eps, h)
    n_ff = w.w_gate_up.n_rows // 2
    gate_up = np.empty((t_rows, 2 * n_ff), np.float32)
    qmatmul(h, w.w_gate_up, gate_up, n_direct)
    gate = np.ascontiguousarray(gate_up[:, :n_ff])
    swiglu(gate, gate_up[:, n_ff:])
    qmatmul(gate, w.w_down, h, n_direct)
    add_into(x, h)


@nb.njit(nogil=True, cache=True)
def embed(tokens: np.ndarray, table: np.ndarray, gtype: int, out: np.ndarray) -> None:
    for t in range(tokens.shape[0]):
        dequantize_row(table[tokens[t]], gtype, out[t])


class LlamaModel:
    """Weights (views of the mmap) and the forward step."""

    def __init__(self, gguf: GGUFFile, hp: HParams) -> None:
        self.hp = hp
        embd = gguf.require_supported("token_embd.weight")
        self.token_embd, self.embd_type = gguf.raw("token_embd.weight"), int(embd.gtype)
        self.blocks = [
            LlamaBlock(
                attn_norm=load_vector(gguf, f"blk.{i}.attn_norm.weight"),
                wqkv=load_weight(gguf, *(f"blk.{i}.attn_{p}.weight" for p in "qkv")),
                wo=load_weight(gguf, f"blk.{i}.attn_output.weight"),
                ffn_norm=load_vector(gguf, f"blk.{i}.ffn_norm.weight"),
                w_gate_up=load_weight(gguf, f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
                w_down=load_weight(gguf, f"blk.{i}.ffn_down.weight"),
            )
            for i in range(hp.n_layers)
        ]
        self.output_norm = load_vector(gguf, "output_norm.weight")
        # Tied embeddings (SmolLM2): no output.weight, the logits reuse the embedding table.
        has_output = "output.weight" in gguf.tensors
        self.output = load_weight(gguf, "output.weight" if has_output else "token_embd.weight")
        self.shape = Shape(hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.norm_eps)
        self.inv_freq = rope_frequencies(hp.head_dim, hp.rope_dim, hp.rope_base)

    def forward(
        self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
        logit_rows: np.ndarray, n_direct: int = 0,
    ) -> np.ndarray:
        """Run one step; write every row's K/V into its slot; return logits of ``logit_rows``.

        The first ``n_direct`` rows are decode rows (the direct matmul path), the rest prompt rows
        (tiled); the logits always take the direct path, one row per sequence."""
        x = np.empty((tokens.shape[0], self.hp.n_embd), np.float32)
        embed(tokens, self.token_embd, self.embd_type, x)
        for layer, block in enumerate(self.blocks):
            llama_block(x, block, self.shape, kv.k, kv.v, layer, slots, positions, self.inv_freq, n_direct)
        h = np.empty((logit_rows.shape[0], self.hp.n_embd), np.float32)
        rmsnorm(np.ascontiguousarray(x[logit_rows]), self.output_norm, self.hp.norm_eps, h)
        logits = np.empty((h.shape[0], self.output.n_rows), np.float32)
        qmatmul(h, self.output, logits, h.shape[0])
        return logits
