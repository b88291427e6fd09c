"""``coli convert``: Hugging Face checkpoints (config.json + safetensors) to GGUF, streamed.

See docs/convert.md. ``convert()`` (in ``writer``) is the entry point; errors are ``ColibriError``
subclasses (``ConvertError`` for what the checkpoint holds, ``SafetensorsError`` for how it is
stored). This module itself imports nothing heavy, so the CLI can list the types cheaply.
"""

# The block types ``--type`` accepts for the matrices: one type for all (writer.TYPES), or one of
# llama.cpp's K-quant mixtures, a type per tensor by its rules (writer.MIXTURES, convert.mixture), or
# llama.cpp's MXFP4_MOE (the experts MXFP4, the rest Q8_0: gpt-oss's own layout).
TYPE_NAMES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k", "mxfp4_moe")
DEFAULT_TYPE = "f16"  # llama.cpp's converter's default too
