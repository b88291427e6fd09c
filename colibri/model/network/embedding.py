"""Both ends of the network: the token embedding (rows read from the mmap as tokens need them)
and the output head (final norm, then the output matrix, tied to the embedding when the file has
no ``output.weight``)."""

from __future__ import annotations

import numba as nb
import numpy as np

from colibri.model.kernels.ops import rmsnorm
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.network.weights import load_vector, load_weight
from colibri.store.blocks import dequantize_row
from colibri.store.gguf import GGUFFile
from colibri.store.packed import Weight


@nb.njit(nogil=True, cache=True)
def embed(tokens: np.ndarray, table: np.ndarray, gtype: int, out: np.ndarray) -> None:
    for t in range(tokens.shape[0]):
        dequantize_row(table[tokens[t]], gtype, out[t])


class Embedding:
    """The token embedding table: a view of the mmap, each row dequantized when a token needs it."""

    def __init__(self, gguf: GGUFFile, n_embd: int, name: str = "token_embd.weight") -> None:
        info = gguf.require_supported(name)
        self.table, self.gtype = gguf.raw(name), int(info.gtype)
        self.n_embd = n_embd

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        x = np.empty((tokens.shape[0], self.n_embd), np.float32)
        embed(tokens, self.table, self.gtype, x)
        return x


class OutputHead:
    """The final norm and the output matrix (the embedding's, packed, when they are tied)."""

    def __init__(self, gguf: GGUFFile, n_embd: int, eps: float, norm: str = "output_norm.weight",
                 output: Weight | None = None) -> None:
        """``norm``: the norm's name where it is not the model's own (a NextN layer's head);
        ``output``: a matrix already packed (the model's, which a NextN layer shares)."""
        self.n_embd, self.eps = n_embd, eps
        self.norm = load_vector(gguf, norm)
        if output is None:
            has_output = "output.weight" in gguf.tensors
            output = load_weight(gguf, "output.weight" if has_output else "token_embd.weight")
        self.output = output

    def __call__(self, x: np.ndarray, logit_rows: np.ndarray) -> np.ndarray:
        """Final norm and output matmul of the rows asked for, on the direct path (one row per
        sequence, whatever else is in the step)."""
        return self.project(self.normed(x[logit_rows]))

    def normed(self, x: np.ndarray) -> np.ndarray:
        """The rows ``x`` after the final norm: what the output matrix sees (and a NextN layer)."""
        h = np.empty((x.shape[0], self.n_embd), np.float32)
        rmsnorm(np.ascontiguousarray(x, np.float32), self.norm, self.eps, h)
        return h

    def project(self, h: np.ndarray) -> np.ndarray:
        """The logits of normed rows ``h``."""
        logits = np.empty((h.shape[0], self.output.n_rows), np.float32)
        qmatmul(h, self.output, logits, h.shape[0])
        return logits
