"""DeepSeek's layout as GGUF describes it: ``deepseek2`` (DeepSeek-V2, V2-Lite, V3, and the models
built on them).

A layer: ``x += latent_attention(rmsnorm(x))``, then ``x += ffn(rmsnorm(x, ffn_norm))``.

- Attention: multi-head latent attention (``mla.py``): the cache holds each token's latent and one
  rope key, the heads attend in the latent; RoPE on adjacent pairs (ggml's "normal") of the rope
  parts only, YaRN-scaled as DeepSeek's files say (``yarn.py``); q·k scaled by
  1/sqrt(key_length_mla), times YaRN's attention term.
- FFN: the first ``leading_dense_block_count`` layers dense SwiGLUs; the others routed experts plus
  ``expert_shared_count`` ungated shared experts (``ffn_*_shexp``), summed. Routing: softmax (V2,
  the default where the file does not say) or sigmoid (V3, ``expert_gating_func`` 2) scores; the
  choice by score + ``exp_probs_b`` where the file has the bias, within the best groups where it
  has groups; weighted by the scores, renormalised where ``expert_weights_norm`` says, times
  ``expert_weights_scale``.
"""

from __future__ import annotations

import math

from colibri.model.hparams import HParams
from colibri.model.network.decoder import Decoder
from colibri.model.network.mla import (
    LatentAttention,
    latent_attention_then_norm,
    latent_dense_layer,
    load_latent_attention,
)
from colibri.model.yarn import yarn_attention_scale
from colibri.store.gguf import GGUFError, GGUFFile


class Deepseek2Decoder(Decoder):
    """deepseek2: latent attention; llama.cpp's defaults where the file is silent (softmax gating,
    the top-k weights not renormalised)."""

    NORM_TOPK = False
    DENSE_LAYER = staticmethod(latent_dense_layer)
    ATTENTION_THEN_NORM = staticmethod(latent_attention_then_norm)

    def load_attention(self, gguf: GGUFFile, i: int, hp: HParams) -> LatentAttention:
        if hp.kv_lora_rank <= 0 or hp.head_dim_mla <= hp.rope_dim or hp.n_kv_heads != 1:
            raise GGUFError(f"{gguf.path}: deepseek2 without latent attention's metadata (kv_lora_rank "
                            f"{hp.kv_lora_rank}, key_length_mla {hp.head_dim_mla}, {hp.n_kv_heads} kv heads)")
        return load_latent_attention(gguf, i, hp)

    def is_moe(self, gguf: GGUFFile, hp: HParams, layer: int) -> bool:
        return layer >= hp.n_dense_lead and super().is_moe(gguf, hp, layer)

    def query_scale(self, hp: HParams) -> float:
        """1/sqrt(key_length_mla), times YaRN's attention term where the file scales its rope."""
        return yarn_attention_scale(hp) / math.sqrt(hp.head_dim_mla)
