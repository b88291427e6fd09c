"""OpenAI's gpt-oss as GGUF describes it: ``gpt-oss`` (gpt-oss-20b, gpt-oss-120b).

A layer: ``x += attention(rmsnorm(x))``, then ``x += moe(rmsnorm(x, post_attention_norm))`` (the
FFN's norm carries Hugging Face's ``post_attention_layernorm`` name).

- Attention: biases on q, k, v and the output; NEOX RoPE with YaRN over the unrounded blend range
  (``hparams.UNTRUNCATED_YARN``); a learned sink per query head in each softmax (``attn_sinks``:
  a score weighing no value, so that a head may attend to nothing). Even layers attend to the last
  ``attention.sliding_window`` positions (128), odd ones to all; every layer has ``rope.freq_base``.
- Experts: the router has a bias; the k best logits, weighted by their softmax over those k
  alone; each expert's gate, up and down have biases, and its SwiGLU is clamped
  (``ops.swiglu_clamped``: alpha 1.702, limit 7, llama.cpp's constants: no GGUF key holds them).
  The experts' blocks are MXFP4 in the released checkpoints.
"""

from __future__ import annotations

from colibri.model.hparams import HParams
from colibri.model.network.decoder import Decoder
from colibri.model.network.routing import GATING_SOFTMAX_WEIGHT

# The clamped SwiGLU's (alpha, limit): llama.cpp's ``swiglu_oai`` constants, transformers' defaults.
SWIGLU_CLAMP = (1.702, 7.0)


class GptOssDecoder(Decoder):
    NEOX = True
    SWA_PERIOD = 2
    FFN_NORM = "post_attention_norm"
    GATING = GATING_SOFTMAX_WEIGHT
    SWIGLU_CLAMP = SWIGLU_CLAMP

    @classmethod
    def local_rope_base(cls, hp: HParams) -> float:
        """One base for the sliding and the global layers: llama.cpp's ``rope.freq_base_swa``
        defaults to ``rope.freq_base`` for gpt-oss (the converter writes none)."""
        return hp.rope_base
