"""The file as the reference reads it: ``Weights`` (metadata and tensors through the ``gguf``
package, dequantized to float64 when asked) and the ``Config`` the forward passes read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

_REQUIRED = object()  # a metadata key without a default

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
    gating: int  # expert_gating_func: 1 softmax, 2 sigmoid (0: the architecture's own)
    kv_lora: int  # attention.kv_lora_rank: MLA's latent per token (0: not MLA)
    k_mla: int  # attention.key_length_mla: an MLA query head's key (its nope and rope parts)
    rope_type: str  # rope.scaling.type ("linear" where the file says none, llama.cpp's reading)
    rope_factor: float  # rope.scaling.factor (1: none)
    yarn_betas: tuple[float, float]  # rope.scaling.yarn_beta_fast and _slow: YaRN's blend's ends
    yarn_log_mul: float  # rope.scaling.yarn_log_multiplier: DeepSeek's 0.1 * mscale_all_dim


class Weights:
    """A GGUF file's metadata and tensors, dequantized to float64 by the ``gguf`` package whenever
    asked for (nothing is kept: a real model does not fit in memory as float64). ``expert_levels``:
    round the experts' inputs (routed and shared) to that many 8-bit levels per ``expert_block``
    values first, as a quantized file's experts in the engine are (``rounded``); 0, the default,
    leaves them exact. ``projection_levels`` and ``projection_block``: the same for the inputs of
    the attention's projections (``self_attention``), which the engine takes at two levels (~15
    bits, left exact here): what one would cost is measured with them
    (``tools/activation_rounding.py``)."""

    def __init__(self, path: Path | str, expert_levels: int = 0, projection_levels: int = 0,
                 expert_block: int = 32, projection_block: int = 32) -> None:
        self.expert_levels, self.expert_block = expert_levels, expert_block
        self.projection_levels, self.projection_block = projection_levels, projection_block
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
            gating=opt("expert_gating_func"),
            kv_lora=opt("attention.kv_lora_rank"),
            k_mla=opt("attention.key_length_mla"),
            rope_type=opt("rope.scaling.type", "linear"),
            rope_factor=float(opt("rope.scaling.factor", 0.0) or 1.0),
            yarn_betas=(float(opt("rope.scaling.yarn_beta_fast", 32.0)),
                        float(opt("rope.scaling.yarn_beta_slow", 1.0))),
            yarn_log_mul=float(opt("rope.scaling.yarn_log_multiplier", 0.0)),
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
