"""Gemma 3 as GGUF describes it: ``gemma3`` (the text model of Gemma 3 270M to 27B).

A layer: ``x += post_attention_norm(attention(rmsnorm(x)))``, then
``x += post_ffw_norm(ffn(rmsnorm(x, ffn_norm)))``: every branch normed before and after.

- Attention: NEOX RoPE; per-head RMSNorm of q and k (``attn_q_norm``, ``attn_k_norm``); one kv
  head for several query heads; q·k scaled by 1/sqrt(head_dim) (llama.cpp's rule, after Google's
  config: the 27B, 62 layers, takes 1/sqrt(n_embd / n_heads)).
- Sliding-window layers: five local layers, then a global one (``attention.sliding_window_pattern``
  overrides the period); a local layer attends to the last ``attention.sliding_window`` positions
  with RoPE base ``rope.freq_base_swa`` (10000 where absent), a global one to all positions with
  ``rope.freq_base`` and the file's linear RoPE scaling (the 4B-27B's factor 8).
- FFN: GeGLU with the tanh GELU. Embeddings scaled by sqrt(n_embd). The norms' weights are stored
  with Gemma's +1 already added (llama.cpp's converter does it): a plain RMSNorm here.
"""

from __future__ import annotations

import math

from colibri.model.hparams import HParams
from colibri.model.network.decoder import Decoder

LAYERS_27B = 62  # the one size whose query scale is 1/sqrt(n_embd / n_heads) (Gemma's own config)


class Gemma3Decoder(Decoder):
    NEOX = True
    ATTN_POST_NORM = "post_attention_norm"
    FFN_POST_NORM = "post_ffw_norm"
    GELU = True
    SWA_PERIOD = 6

    def query_scale(self, hp: HParams) -> float:
        if hp.n_layers == LAYERS_27B:
            return 1.0 / math.sqrt(hp.n_embd // hp.n_heads)
        return 1.0 / math.sqrt(hp.head_dim)

    def embedding_scale(self, hp: HParams) -> float:
        return math.sqrt(hp.n_embd)
