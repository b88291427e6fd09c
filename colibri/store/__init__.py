"""The store: the GGUF container over mmap and the quantized block formats it holds."""

from colibri.store.gguf import GGUFError, GGUFFile, TensorInfo
from colibri.store.quant import GGMLType

__all__ = ["GGMLType", "GGUFError", "GGUFFile", "TensorInfo"]
