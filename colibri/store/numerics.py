"""The numbers the store and the kernels agree on: ggml's block geometry and the compile options of
every numba kernel, with the one fast-math policy they follow.

The bottom of the store: nothing of colibri is imported here, and no numba either, so the block
table (``formats``), which the HTTP server imports, and the bit-exact quantizers (``quantize_k``)
can build on it as well as the compiled decoders and kernels. The one conversion between IEEE halves
and float32 is compiled code, so it is beside this module: ``halves``.

numba's cache knows a kernel by its own file and bytecode, not by these options: after changing
them, delete the caches (``find colibri -name '*.nbi' -delete``), or each kernel whose file is
unchanged loads the machine code compiled with the old ones.
"""

from __future__ import annotations

# Values per block of the 32-value formats (Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL …): the unit one scale covers.
BLOCK = 32
# Values per super-block of the K-quants and the IQ formats (ggml's QK_K).
QK_K = 256

# The fast-math policy of every kernel: the arithmetic may be reassociated (a reduction then runs
# in vector lanes: dot products, norms, softmax sums), multiplies fused into adds (FMA), divisions
# taken as reciprocals and library functions approximated, and the sign of a zero ignored. The
# infinities and NaN keep their IEEE meaning ('ninf' and 'nnan' are left out): -inf is a value the
# kernels compute with (a softmax's starting peak, a grammar's masked logit, a draw's depth), and
# a comparison with it, or a NaN test, is undefined under those flags. Each row's result is still
# one compiled loop's, whatever the batch, so its bits do not depend on the other rows.
FASTMATH = {"reassoc", "contract", "arcp", "afn", "nsz"}  # a set: numba takes no frozenset
# The options of every kernel. error_model "numpy": a float division by zero gives inf (as NumPy),
# where Python's semantics need a check per element that keeps a loop from vectorizing.
KERNEL = {"nogil": True, "cache": True, "error_model": "numpy", "fastmath": FASTMATH}
# No fast-math at all: ggml's reference quantizers, bit for bit (ggml-base is built without
# contraction or reassociation, and a fused or reordered operation changes a rounding); a division
# by zero still gives inf, as in C.
EXACT = {"nogil": True, "cache": True, "error_model": "numpy"}
