"""The store: the GGUF container over mmap and the quantized block formats it holds."""

from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFError, GGUFFile, TensorInfo

__all__ = ["GGMLType", "GGUFError", "GGUFFile", "TensorInfo"]
