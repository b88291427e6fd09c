"""Cached kernels loaded without their linking modules parsed: ~30 MB less resident on a MoE model.

numba caches a compiled function as its machine code plus the LLVM bitcode of its whole module, kept
so that a later compile can link (and inline) it. Loading a function from the cache parses that
bitcode into an LLVM module at once and keeps it for the process's life, though a process that
loads all its kernels from the cache never links against them: the resident qwen3moe / glm4moe
forward's ~14 entry points hold ~31 MB of parsed modules (the heap after a first step 87.5 ->
56.4 MB, peak RSS 2.498 -> 2.467 GB, docs/performance.md), 1.4% of a 2.25 GB model. Here a
loaded function keeps the bitcode's bytes and parses them only when a compile links it.

This replaces two private methods of numba's ``CPUCodeLibrary`` (``_unserialize`` and
``_get_module_for_linking``), so it applies only where they are as this was written against
(numba 0.60-0.68: ``state`` is ``(name, "object", (machine code, bitcode))``); any other shape
goes to numba's own code, as does every other kind of cache entry.
"""

from __future__ import annotations

import llvmlite.binding as ll
from numba.core import codegen

_LIBRARY = codegen.CPUCodeLibrary
_unserialize = _LIBRARY._unserialize.__func__
_module_for_linking = _LIBRARY._get_module_for_linking


def _unserialize_lazily(cls, codegen_, state):  # noqa: ANN001, ANN202
    """numba's object-code branch of ``_unserialize``, the parsed module dropped once its symbols
    are read."""
    name, kind, data = state
    if kind != "object" or not (isinstance(data, tuple) and len(data) == 2):
        return _unserialize(cls, codegen_, state)
    object_code, bitcode = data
    library = codegen_.create_library(name)
    library.enable_object_caching()
    library._set_compiled_object(object_code)
    library._finalize_final_module()
    library._codegen._engine._load_defined_symbols(ll.parse_bitcode(bitcode))
    library._lazy_bitcode = bitcode
    return library


def _module_for_linking_lazily(self):  # noqa: ANN001, ANN202
    """The linking module, parsed from the kept bitcode the first time a compile links it."""
    bitcode = getattr(self, "_lazy_bitcode", None)
    if self._shared_module is None and bitcode is not None:
        self._shared_module = ll.parse_bitcode(bitcode)
    return _module_for_linking(self)


def install() -> bool:
    """Load cached kernels lazily from now on; False (numba left as it is) where numba's library
    class is not the shape this was written against."""
    if not (hasattr(_LIBRARY, "_set_compiled_object") and hasattr(_LIBRARY, "enable_object_caching")
            and "_shared_module" in _LIBRARY.__init__.__code__.co_names):
        return False
    _LIBRARY._unserialize = classmethod(_unserialize_lazily)
    _LIBRARY._get_module_for_linking = _module_for_linking_lazily
    return True


INSTALLED = install()
