"""The expert store: routed experts by (layer, expert), packed for the kernels.

An expert is a slice of the 3-D expert tensors of its layer: ``blk.N.ffn_{gate,up}_exps.weight``
are [n_expert, n_ff_exp, n_embd] (in GGUF's row-major view: ``n_expert * n_ff_exp`` rows of
``n_embd``), so expert e is rows ``e*n_ff_exp .. (e+1)*n_ff_exp``; ``ffn_down_exps`` is
[n_expert, n_embd, n_ff_exp], expert e being rows ``e*n_embd .. (e+1)*n_embd``. ``get`` packs an
expert's gate and up rows into one matrix (``gate_up``, like a dense layer's) and its down rows
into another, with ``make_weight``.

The interface is what the forward pass relies on; the internals are this first version's: every
expert is packed on first use and kept resident in a dict. Tiers (a RAM budget, disk through the
mmap), heat, pinning, prefetch and telemetry replace the internals later, not the interface:

- ``get(layer, expert)`` returns the expert's weights, always bit-identical whatever tier held it.
- ``note_routing(layer, expert_ids)`` is called by the forward pass once per MoE layer per step,
  before that layer's ``get`` calls, with the distinct experts the step's rows route to (ascending).
  It does nothing yet; it is where heat and prefetch will hook in.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from colibri.model.kernels.quant_matmul import Weight, make_weight
from colibri.store.gguf import GGUFError, GGUFFile


class ExpertWeights(NamedTuple):
    """One routed expert: ``down(silu(gate · h) * (up · h))``."""

    gate_up: Weight  # gate rows then up rows: n_ff_exp * 2 rows of n_embd
    down: Weight  # n_embd rows of n_ff_exp


class ExpertStore:
    """Every MoE layer's routed experts, addressed by (layer, expert).

    ``n_experts``: experts per MoE layer; ``n_used``: experts per token (top-k); ``layers``: the
    layers that have routed experts (a glm4moe model's first layers are dense)."""

    def __init__(self, gguf: GGUFFile, hp) -> None:
        self.gguf = gguf
        self.n_experts: int = hp.n_expert
        self.n_used: int = hp.n_expert_used
        self.layers: tuple[int, ...] = tuple(
            i for i in range(hp.n_layers) if f"blk.{i}.ffn_down_exps.weight" in gguf.tensors
        )
        self._tensors: dict[int, tuple[str, str, str]] = {}
        for i in self.layers:
            names = tuple(f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
            for name in names:
                info = gguf.require_supported(name)
                if len(info.shape) != 3 or info.shape[2] != self.n_experts:
                    raise GGUFError(
                        f"{gguf.path}: tensor {name!r} has shape {list(info.shape)}, "
                        f"expected 3 dimensions with {self.n_experts} experts"
                    )
            self._tensors[i] = names
        self._resident: dict[tuple[int, int], ExpertWeights] = {}

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """Expert ``expert`` of layer ``layer``, packed for ``qmatmul``."""
        key = (layer, expert)
        weights = self._resident.get(key)
        if weights is None:
            weights = self._resident[key] = self._pack(layer, expert)
        return weights

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        """The distinct experts (ascending int64) this step routes to in ``layer``; a hook for the
        heat counts and prefetch of later versions."""

    def _pack(self, layer: int, expert: int) -> ExpertWeights:
        if not 0 <= expert < self.n_experts or layer not in self._tensors:
            raise KeyError(f"no expert {expert} in layer {layer}")
        gate, up, down = self._tensors[layer]
        parts = [self._slice(name, expert) for name in (gate, up)]
        return ExpertWeights(
            gate_up=make_weight(parts, self.gguf.tensors[gate].shape[0]),
            down=make_weight([self._slice(down, expert)], self.gguf.tensors[down].shape[0]),
        )

    def _slice(self, name: str, expert: int) -> tuple[np.ndarray, int]:
        """The raw rows of one expert of a 3-D tensor, and their block type."""
        info = self.gguf.tensors[name]
        rows = info.shape[1]
        return self.gguf.raw(name)[expert * rows : (expert + 1) * rows], int(info.gtype)
