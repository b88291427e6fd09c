"""The store: the GGUF container over mmap (``gguf``), the block formats it holds (``formats``),
their packed layout (``packed``, the kernels' and the RAM tier's format) and the expert tiers
(``experts``); at the bottom, the numbers the store and the kernels share (``numerics``: block
geometry and compile options; ``halves``). It knows nothing of requests or kernels."""

from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFError, GGUFFile, TensorInfo

__all__ = ["GGMLType", "GGUFError", "GGUFFile", "TensorInfo"]
