"""The dense architectures that differ from llama only in what their files hold, as GGUF
describes them. The layer is llama's (``decoder.py``) with NEOX RoPE; what varies is read from the
tensors present:

- ``qwen2`` (Qwen2, Qwen2.5 and their coder/math fine-tunes): biases on q, k and v.
- ``qwen3`` (Qwen3 dense, 0.6B to 32B): per-head RMSNorm of q and k before RoPE, no biases, a head
  size (``attention.key_length``) that need not be n_embd / n_heads.
- ``phi3`` (Phi-3, Phi-3.5, Phi-4-mini): q, k and v fused in ``attn_qkv``, gate and up fused in
  ``ffn_up``; its sliding window is not applied (llama.cpp disables it too: ``SWA_PERIOD``).
"""

from __future__ import annotations

from colibri.model.network.decoder import Decoder


class Qwen2Decoder(Decoder):
    NEOX = True


class Qwen3Decoder(Decoder):
    NEOX = True


class Phi3Decoder(Decoder):
    NEOX = True
