"""Multi-head latent attention (MLA; DeepSeek-V2, section 2.1), computed in the latent.

A token's hidden state h gives its latent ``c = norm(W_kv_a h)[:kv_lora]`` and one rope key
``k_pe`` shared by every head; head i's key would be ``[W_k_b,i c ; k_pe]`` and its value
``W_v_b,i c``. Both are products with c, so the cache keeps only ``[c ; k_pe]`` per token and
layer (one kv head of kv_lora_rank + rope values; no V: ``kv_cache.py``), and attention runs in
the latent ("absorbed", as llama.cpp and vLLM run it):

    q_i   = [W_k_b,iᵀ q_nope,i ; rope(q_pe,i)]          # a query head in the latent's space
    o_i   = softmax(scale · q_i · [c ; k_pe]ᵀ) · c        # every head against the one kv head
    out   = W_o · [W_v_b,1 o_1 ; ... ; W_v_b,n o_n]

with ``scale`` 1/sqrt(nope + rope) (a query head's own key width). ``k_b`` and ``v_b`` stay in
the file's format, one matrix a head ([kv_lora rows, nope] and [v rows, kv_lora]). The cache per
token and layer is kv_lora + rope values where the heads' keys and values would be
n_heads * (nope + rope + v): 71x fewer for DeepSeek-V3 (576 against 40,960), 8.9x for V2-Lite.
``colibri.model.reference.deepseek2`` keeps the decompressed form, as the paper writes it. A file
converted before llama.cpp split ``attn_kv_b`` is read the same way (``split_kv_b``,
``HParams.legacy_mla``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.attention import attend, store_kv
from colibri.model.kernels.ops import add_into, rmsnorm, rope_angles, rotate
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.network.layers import FFN, FFNNorms, LayerShape, swiglu_ffn
from colibri.model.network.weights import LIFETIME, load_matrix, load_vector, load_weight, optional_vector
from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFError, GGUFFile
from colibri.store.packed import EMPTY_WEIGHT, Weight, make_weight


class LatentAttention(NamedTuple):
    """A layer's attention half in latent form; the q low rank's parts empty where q comes from the
    hidden state (V2-Lite)."""

    norm: np.ndarray  # RMSNorm before attention
    wq_a: Weight  # attn_q_a: the hidden state to q's low rank (empty: none)
    q_a_norm: np.ndarray  # its norm (empty: none)
    wq: Weight  # attn_q_b after the low rank, else attn_q: [n_heads * (nope + rope) rows]
    wkv_a: Weight  # attn_kv_a_mqa: each token's latent and rope key
    kv_a_norm: np.ndarray  # the latent's norm (kv_lora_rank wide)
    k_b: tuple[Weight, ...]  # per head, [kv_lora rows, nope]: a query's nope part into the latent
    v_b: tuple[Weight, ...]  # per head, [v rows, kv_lora]: the latent's output into a value
    wo: Weight


def load_latent_attention(gguf: GGUFFile, i: int, hp: HParams) -> LatentAttention:
    """Layer i's MLA tensors with llama.cpp's names: its converter's split ``attn_k_b``/``attn_v_b``,
    or the older fused ``attn_kv_b``, split here (``split_kv_b``)."""
    p = f"blk.{i}."
    if p + "attn_k_b.weight" in gguf.tensors:
        k_b = per_head(gguf, p + "attn_k_b.weight", hp.n_heads)
        v_b = per_head(gguf, p + "attn_v_b.weight", hp.n_heads)
    elif p + "attn_kv_b.weight" in gguf.tensors:
        k_b, v_b = split_kv_b(gguf, p + "attn_kv_b.weight", hp)
    else:
        raise GGUFError(f"{gguf.path}: {p}attn_k_b.weight (or the older attn_kv_b.weight) is missing")
    low_rank = p + "attn_q_a.weight" in gguf.tensors
    return LatentAttention(
        norm=load_vector(gguf, p + "attn_norm.weight"),
        wq_a=load_weight(gguf, p + "attn_q_a.weight") if low_rank else EMPTY_WEIGHT,
        q_a_norm=optional_vector(gguf, p + "attn_q_a_norm.weight"),
        wq=load_weight(gguf, p + ("attn_q_b.weight" if low_rank else "attn_q.weight")),
        wkv_a=load_weight(gguf, p + "attn_kv_a_mqa.weight"),
        kv_a_norm=load_vector(gguf, p + "attn_kv_a_norm.weight"),
        k_b=k_b,
        v_b=v_b,
        wo=load_weight(gguf, p + "attn_output.weight"),
    )


def per_head(gguf: GGUFFile, name: str, n_heads: int) -> tuple[Weight, ...]:
    """A [head, rows, row length] tensor as one packed matrix a head."""
    info = gguf.require_supported(name)
    raw = gguf.raw(name)
    if raw.shape[0] % n_heads:
        raise GGUFError(f"{gguf.path}: {name} has {raw.shape[0]} rows, not a multiple of {n_heads} heads")
    rows = raw.shape[0] // n_heads
    heads = tuple(make_weight([(raw[h * rows : (h + 1) * rows], int(info.gtype))], int(info.shape[0]),
                              arena=LIFETIME) for h in range(n_heads))
    gguf.release(name)
    return heads


def split_kv_b(gguf: GGUFFile, name: str, hp: HParams) -> tuple[tuple[Weight, ...], tuple[Weight, ...]]:
    """A fused ``attn_kv_b`` ([head x (nope + v) rows, kv_lora]) as llama.cpp's converter now splits
    it: per head its key rows transposed (``k_b``, [kv_lora, nope]) and its value rows (``v_b``),
    widened to float32 (a transposed block is no block of the file's format)."""
    nope, v_dim = hp.head_dim_mla - hp.rope_dim, hp.v_dim_mla
    kv_b = load_matrix(gguf, name)
    if kv_b.shape != (hp.n_heads * (nope + v_dim), hp.kv_lora_rank):
        raise GGUFError(f"{gguf.path}: {name} is {list(kv_b.shape)}, not {hp.n_heads} heads of "
                        f"{nope} + {v_dim} rows of {hp.kv_lora_rank}")
    heads = kv_b.reshape(hp.n_heads, nope + v_dim, hp.kv_lora_rank)

    def dense(m: np.ndarray) -> Weight:
        m = np.ascontiguousarray(m, np.float32)
        return make_weight([(m.view(np.uint8).reshape(m.shape[0], -1), int(GGMLType.F32))], m.shape[1],
                           arena=LIFETIME)

    return (tuple(dense(heads[h, :nope].T) for h in range(hp.n_heads)),
            tuple(dense(heads[h, nope:]) for h in range(hp.n_heads)))


@nb.njit(nogil=True, cache=True)
def latent_attention(
    x: np.ndarray, a: LatentAttention, sh: LayerShape, k_cache: np.ndarray, v_cache: np.ndarray,
    layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_direct: int,
    h: np.ndarray,
) -> None:
    """``x += W_o · values`` of the module docstring's attention over rmsnorm(x), in place; every
    row writes its latent and rope key into its slot first. ``h`` (T, n_embd) is scratch."""
    t_rows, n_heads, width = x.shape[0], sh.n_heads, sh.head_dim
    kv_lora = a.kv_a_norm.shape[0]
    n_rope = width - kv_lora
    k_dim = a.wq.n_rows // n_heads  # a query head: nope + rope
    nope, v_dim = k_dim - n_rope, a.v_b[0].n_rows
    rmsnorm(x, a.norm, sh.eps, h)
    q = np.empty((t_rows, n_heads * k_dim), np.float32)
    if a.wq_a.n_rows > 0:
        low = np.empty((t_rows, a.wq_a.n_rows), np.float32)
        qmatmul(h, a.wq_a, low, n_direct)
        rmsnorm(low, a.q_a_norm, sh.eps, low)
        qmatmul(low, a.wq, q, n_direct)
    else:
        qmatmul(h, a.wq, q, n_direct)
    kv = np.empty((t_rows, width), np.float32)  # [latent ; rope key]: the cache's key
    qmatmul(h, a.wkv_a, kv, n_direct)
    latent = np.ascontiguousarray(kv[:, :kv_lora])
    rmsnorm(latent, a.kv_a_norm, sh.eps, latent)
    pe = np.ascontiguousarray(kv[:, kv_lora:])
    cos, sin = rope_angles(positions, inv_freq, sh.mscale)  # the key's and the queries'
    rotate(pe, cos, sin, np.int64(1), n_rope, np.bool_(False))
    kv[:, :kv_lora], kv[:, kv_lora:] = latent, pe
    store_kv(kv, kv, k_cache, v_cache, layer, slots, positions, np.int64(1), width)
    q_lat = np.empty((t_rows, n_heads * width), np.float32)  # queries in the latent's space
    part = np.empty((t_rows, kv_lora), np.float32)
    q_pe = np.empty((t_rows, n_heads * n_rope), np.float32)
    for i in range(n_heads):
        qmatmul(np.ascontiguousarray(q[:, i * k_dim : i * k_dim + nope]), a.k_b[i], part, n_direct)
        q_lat[:, i * width : i * width + kv_lora] = part
        q_pe[:, i * n_rope : (i + 1) * n_rope] = q[:, i * k_dim + nope : (i + 1) * k_dim]
    rotate(q_pe, cos, sin, n_heads, n_rope, np.bool_(False))
    for i in range(n_heads):
        q_lat[:, i * width + kv_lora : (i + 1) * width] = q_pe[:, i * n_rope : (i + 1) * n_rope]
    o_lat = np.empty((t_rows, n_heads * kv_lora), np.float32)
    attend(q_lat, k_cache, v_cache, layer, slots, positions, n_heads, np.int64(1), o_lat, sh.scale, sh.window,
           np.zeros(0, np.float32))
    values = np.empty((t_rows, n_heads * v_dim), np.float32)
    value = np.empty((t_rows, v_dim), np.float32)
    for i in range(n_heads):
        qmatmul(np.ascontiguousarray(o_lat[:, i * kv_lora : (i + 1) * kv_lora]), a.v_b[i], value, n_direct)
        values[:, i * v_dim : (i + 1) * v_dim] = value
    qmatmul(values, a.wo, h, n_direct)
    add_into(x, h)


@nb.njit(nogil=True, cache=True)
def latent_dense_layer(
    x: np.ndarray, a: LatentAttention, norms: FFNNorms, f: FFN, sh: LayerShape, k_cache: np.ndarray,
    v_cache: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
    n_direct: int,
) -> None:
    """``layers.dense_layer`` with latent attention: a leading dense layer in one compiled call."""
    h = np.empty_like(x)
    latent_attention(x, a, sh, k_cache, v_cache, layer, slots, positions, inv_freq, n_direct, h)
    rmsnorm(x, norms.pre, sh.eps, h)
    out = np.empty_like(x)
    swiglu_ffn(h, f.gate_up, f.down, n_direct, out, sh.gelu)
    add_into(x, out)


@nb.njit(nogil=True, cache=True)
def latent_attention_then_norm(
    x: np.ndarray, a: LatentAttention, norms: FFNNorms, sh: LayerShape, k_cache: np.ndarray,
    v_cache: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
    n_direct: int, h: np.ndarray,
) -> None:
    """``layers.attention_then_norm`` with latent attention: a MoE layer's first half."""
    latent_attention(x, a, sh, k_cache, v_cache, layer, slots, positions, inv_freq, n_direct, h)
    rmsnorm(x, norms.pre, sh.eps, h)
