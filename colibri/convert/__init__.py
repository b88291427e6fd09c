"""``coli convert``: Hugging Face checkpoints (config.json + safetensors) to GGUF, streamed.

See docs/convert.md. ``convert()`` (in ``writer``) is the entry point; errors are ``ColibriError``
subclasses (``ConvertError`` for what the checkpoint holds, ``SafetensorsError`` for how it is
stored). This module itself imports nothing heavy, so the CLI can list the types cheaply.
"""

# The block types ``--type`` accepts for the matrices; writer.TYPES maps them to ggml types.
TYPE_NAMES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
DEFAULT_TYPE = "f16"  # llama.cpp's converter's default too
