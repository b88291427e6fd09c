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
from colibri.model.kernels.quant_matmul import dequantize_row, qmatmul
from colibri.model.kv_cache import KVCache
from colibri.store.gguf import GGUFFile


class Weight(NamedTuple):
    """A matrix as its raw block rows plus the block type id the kernels dispatch on."""

    raw: np.ndarray  # uint8 (rows, row_bytes), a view of the mmap
    gtype: int


class LlamaBlock(NamedTuple):
    attn_norm: np.ndarray
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    ffn_norm: np.ndarray
    w_gate: Weight
    w_up: Weight
    w_down: Weight


class Shape(NamedTuple):
    """The integers and floats a block needs, as one argument."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float


def load_weight(gguf: GGUFFile, name: str) -> Weight:
    info = gguf.require_supported(name)
    return Weight(gguf.raw(name), int(info.gtype))


def load_vector(gguf: GGUFFile, name: str) -> np.ndarray:
    """A 1-D tensor (norm weights) as float32, dequantized if it was stored otherwise."""
    info = gguf.require_supported(name)
    out = np.empty(info.n_elements, dtype=np.float32)
    dequantize_row(gguf.raw(name).reshape(-1), int(info.gtype), out)
    return out


@nb.njit(nogil=True, cache=True)
def llama_block(
    x: np.ndarray, w: LlamaBlock, sh: Shape, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
) -> None:
    """One transformer layer on the residual stream ``x`` (T, n_embd), in place."""
    t_rows, n_embd = x.shape
    q_dim, kv_dim = sh.n_heads * sh.head_dim, sh.n_kv * sh.head_dim
    h = np.empty_like(x)
    rmsnorm(x, w.attn_norm, sh.eps, h)
    q = np.empty((t_rows, q_dim), np.float32)
    k = np.empty((t_rows, kv_dim), np.float32)
    v = np.empty((t_rows, kv_dim), np.float32)
    qmatmul(h, w.wq.raw, w.wq.gtype, q)
    qmatmul(h, w.wk.raw, w.wk.gtype, k)
    qmatmul(h, w.wv.raw, w.wv.gtype, v)
    rope(q, positions, sh.n_heads, sh.head_dim, inv_freq)
    rope(k, positions, sh.n_kv, sh.head_dim, inv_freq)
    store_kv(k, v, k_cache, v_cache, layer, slots, positions, sh.n_kv, sh.head_dim)
    attn = np.empty((t_rows, q_dim), np.float32)
    attend(q, k_cache, v_cache, layer, slots, positions, sh.n_heads, sh.n_kv, sh.head_dim, attn)
    qmatmul(attn, w.wo.raw, w.wo.gtype, h)
    add_into(x, h)

    rmsnorm(x, w.ffn_norm, sh.eps, h)
    n_ff = w.w_gate.raw.shape[0]
    gate = np.empty((t_rows, n_ff), np.float32)
    up = np.empty((t_rows, n_ff), np.float32)
    qmatmul(h, w.w_gate.raw, w.w_gate.gtype, gate)
    qmatmul(h, w.w_up.raw, w.w_up.gtype, up)
    swiglu(gate, up)
    qmatmul(gate, w.w_down.raw, w.w_down.gtype, h)
    add_into(x, h)


@nb.njit(nogil=True, cache=True)
def embed(tokens: np.ndarray, table: np.ndarray, gtype: int, out: np.ndarray) -> None:
    for t in range(tokens.shape[0]):
        dequantize_row(table[tokens[t]], gtype, out[t])


class LlamaModel:
    """Weights (views of the mmap) and the forward step."""

    def __init__(self, gguf: GGUFFile, hp: HParams) -> None:
        self.hp = hp
        self.token_embd = load_weight(gguf, "token_embd.weight")
        self.blocks = [
            LlamaBlock(
                attn_norm=load_vector(gguf, f"blk.{i}.attn_norm.weight"),
                wq=load_weight(gguf, f"blk.{i}.attn_q.weight"),
                wk=load_weight(gguf, f"blk.{i}.attn_k.weight"),
                wv=load_weight(gguf, f"blk.{i}.attn_v.weight"),
                wo=load_weight(gguf, f"blk.{i}.attn_output.weight"),
                ffn_norm=load_vector(gguf, f"blk.{i}.ffn_norm.weight"),
                w_gate=load_weight(gguf, f"blk.{i}.ffn_gate.weight"),
                w_up=load_weight(gguf, f"blk.{i}.ffn_up.weight"),
                w_down=load_weight(gguf, f"blk.{i}.ffn_down.weight"),
            )
            for i in range(hp.n_layers)
        ]
        self.output_norm = load_vector(gguf, "output_norm.weight")
        # Tied embeddings (SmolLM2): no output.weight, the logits reuse the embedding table.
        has_output = "output.weight" in gguf.tensors
        self.output = load_weight(gguf, "output.weight") if has_output else self.token_embd
        self.shape = Shape(hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.norm_eps)
        self.inv_freq = rope_frequencies(hp.head_dim, hp.rope_dim, hp.rope_base)

    def forward(
        self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
        logit_rows: np.ndarray,
    ) -> np.ndarray:
        """Run one step; write every row's K/V into its slot; return logits of ``logit_rows``."""
        x = np.empty((tokens.shape[0], self.hp.n_embd), np.float32)
        embed(tokens, self.token_embd.raw, self.token_embd.gtype, x)
        for layer, block in enumerate(self.blocks):
            llama_block(x, block, self.shape, kv.k, kv.v, layer, slots, positions, self.inv_freq)
        h = np.empty((logit_rows.shape[0], self.hp.n_embd), np.float32)
        rmsnorm(np.ascontiguousarray(x[logit_rows]), self.output_norm, self.hp.norm_eps, h)
        logits = np.empty((h.shape[0], self.output.raw.shape[0]), np.float32)
        qmatmul(h, self.output.raw, self.output.gtype, logits)
        return logits
