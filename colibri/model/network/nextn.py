"""A next-token-prediction layer (MTP, "NextN"): the draft head GLM-4.5 (and DeepSeek-V3) was
trained with, stored at the end of the file (``blk.{n_layers}.*``, ``nextn_predict_layers``).

Row p, at position p, takes two things the main step has: the last hidden state at p as the
output head sees it (after the final norm: what vLLM and SGLang, whose GLM-4.5 MTP Zhipu
contributed, give the layer; llama.cpp's forks take it before the norm) and the embedding of the
token at p + 1 (zeros at position 0, as vLLM has it); it predicts the token at p + 2. A row:

    x = eh_proj · [enorm(embedding(token_{p+1})) ; hnorm(hidden_p)]
    x = layer(x)            # a whole layer of the architecture: attention over the NextN layer's
                            # own K/V (the cache's last layer), its own experts in the store
    logits = head(x)        # shared_head_norm, then the layer's own output matrix or the model's

A draft of several tokens feeds the layer its own output: row p + 1 takes the drafted token and row
p's ``x`` as its head sees it (after ``shared_head_norm``) as its hidden state.
``colibri.model.reference.glm4moe_nextn`` is the same math in float64 over a whole sequence. """

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from colibri.model.hparams import HParams
from colibri.model.kernels.ops import rmsnorm
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.kv_cache import KVCache
from colibri.model.network.embedding import Embedding, OutputHead
from colibri.model.network.weights import load_vector, load_weight
from colibri.store.gguf import GGUFFile
from colibri.store.packed import Weight

# The decoder's ``layer(i, x, kv, slots, positions, n_direct)``: layer i on the rows x, in place.
Layer = Callable[[int, np.ndarray, KVCache, np.ndarray, np.ndarray, int], float]


class NextN:
    """The NextN layer's own parts: the embedding (the model's unless the file has the layer's
    own), its two input norms and projection, its head (the model's output matrix unless it has
    its own). The layer between them is the decoder's layer ``index`` (``Decoder.layer``, given as
    ``layer``), loaded with the others."""

    def __init__(self, gguf: GGUFFile, hp: HParams, index: int, layer: Layer, embedding: Embedding,
                 output: Weight) -> None:
        p = f"blk.{index}.nextn."
        self.index, self.n_embd, self.eps, self.layer = index, hp.n_embd, hp.norm_eps, layer
        own = p + "embed_tokens.weight"
        self.embedding = Embedding(gguf, hp.n_embd, own) if own in gguf.tensors else embedding
        self.enorm, self.hnorm = load_vector(gguf, p + "enorm.weight"), load_vector(gguf, p + "hnorm.weight")
        self.eh_proj = load_weight(gguf, p + "eh_proj.weight")
        norm, head = p + "shared_head_norm.weight", p + "shared_head_head.weight"
        output = load_weight(gguf, head) if head in gguf.tensors else output
        self.head = OutputHead(gguf, hp.n_embd, hp.norm_eps,
                               norm if norm in gguf.tensors else "output_norm.weight", output)

    def __call__(self, tokens: np.ndarray, hidden: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                 kv: KVCache, logit_rows: np.ndarray, n_direct: int) -> tuple[np.ndarray, np.ndarray]:
        """The logits of ``logit_rows`` and those rows' output after the head's norm (the next
        draft row's hidden state). ``hidden``: the model's last hidden states after its final norm."""
        rows = tokens.shape[0]
        e = self.embedding(np.ascontiguousarray(tokens, np.int64))
        e[positions == 0] = 0.0
        both = np.empty((rows, 2 * self.n_embd), np.float32)
        normed = np.empty((rows, self.n_embd), np.float32)
        rmsnorm(e, self.enorm, self.eps, normed)
        both[:, : self.n_embd] = normed
        rmsnorm(np.ascontiguousarray(hidden, np.float32), self.hnorm, self.eps, normed)
        both[:, self.n_embd :] = normed
        x = np.empty((rows, self.n_embd), np.float32)
        qmatmul(both, self.eh_proj, x, n_direct)
        self.layer(self.index, x, kv, slots, positions, n_direct)
        h = self.head.normed(x[logit_rows])
        return self.head.project(h), h
