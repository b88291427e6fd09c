"""The expert store: routed experts by (layer, expert), in two tiers, under a RAM budget.

An expert is a slice of the 3-D expert tensors of its layer: ``blk.N.ffn_{gate,up}_exps.weight``
are [n_expert, n_ff_exp, n_embd] (in GGUF's row-major view: ``n_expert * n_ff_exp`` rows of
``n_embd``), so expert e is rows ``e*n_ff_exp .. (e+1)*n_ff_exp``; ``ffn_down_exps`` is
[n_expert, n_embd, n_ff_exp], expert e being rows ``e*n_embd .. (e+1)*n_embd``.

Tiers (``docs/store.md``):

- **disk**: the expert's bytes in the file (in the page cache, or on the disk). Using it means
  one ``pread`` of its rows (never mapped, so the file's pages stay out of this process's RSS),
  then packing them into the packed layout (``packed.py``, moves of the file's words, in cache),
  a transient copy dropped after the step; the formats computed in place are read straight into
  their copy.
- **RAM**: a resident packed copy. The copies never exceed the budget (``--ram-budget``): a share
  of it holds the experts that were hottest in earlier runs (*pinned* at start from the heat in
  ``.coli_usage``), the rest the most recently used others (*recent*, least recently used out).

Both tiers give the same bits (packing is deterministic), so the budget changes speed, never the
tokens. Heat is a decayed count of routings per expert; the forward pass reports each step's
routing (``note_routing``) and, one layer ahead, the experts it expects (``prefetch``), which the
store asks the kernel to read in (``MADV_WILLNEED``) while the current layer computes.
"""

from __future__ import annotations

import mmap
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numba as nb
import numpy as np

from colibri.store.arena import Arena
from colibri.store.formats import GGMLType
from colibri.store.gguf import GGUFError, GGUFFile
from colibri.store.numerics import KERNEL
from colibri.store.packed import (
    GROUP,
    KIND_BLOCKS,
    KIND_Q4,
    KIND_Q5,
    KIND_Q6,
    KIND_Q8,
    SwiGLUWeights,
    Weight,
    blocks_weight,
    make_weight,
    packed_kind,
    packed_nbytes,
)
from colibri.store.readahead import ReadAheadPolicy

TIER_DISK, TIER_RAM = 0, 1  # EMAP's 2-bit tier codes (2 would be VRAM: no GPU here)
# Heat halves every this many forward steps: long enough that a conversation's topic shows, short
# enough that last week's workload does not pin experts forever.
HEAT_HALF_LIFE_STEPS = 1024
HEAT_DECAY = 0.5 ** (1.0 / HEAT_HALF_LIFE_STEPS)
# Share of the budget given to the experts pinned at start; the rest (and whatever the pinned set
# leaves unused) holds recently used experts, so a new workload still finds room.
PIN_SHARE = 0.75
# EMAP's 6-bit heat: quarter-octave buckets of log2(1 + heat), so the whole decayed range (up to
# ~1/(1-HEAT_DECAY) ≈ 1478) stays distinguishable below the cap.
HEAT_BUCKETS_PER_OCTAVE = 4
HEAT_BUCKET_MAX = 63
_PAGE = mmap.PAGESIZE
# The in-place formats whose experts compute on the integer lanes (``packed.py``, ``lanes.py``) in
# every tier, packed at load or on a miss (the same bits at every budget): a ``_K_M`` file's experts
# and the fallbacks of its rows that are not whole 256-blocks. The others (Q2_K, Q3_K, IQ4) stay the
# file's blocks. Q4_K packs into Q4 lanes at 1.03x its bytes, at 5-6 GB/s (``packers.pack_q4_k``),
# Q6_K into Q6 lanes at 1.00x, ~3 GB/s; the Q5 formats into Q5 lanes (the file's scales; Q5_K
# sub-scaled), value by value. The lanes kernel was 1.5-3x the speed of integer dot products on
# Q4_K and Q6_K blocks in place (a kernel since removed), and is ~10x ``block_matmul``'s on Q5_0
# (docs/performance.md).
# MXFP4 (gpt-oss) goes into Q5 lanes, its grid's 25 levels shifted to 4..28: 1.41x its file bytes
# (a float32 scale per block where the file has an exponent byte), for the integer kernels.
STORE_LANES = frozenset({GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q5_0, GGMLType.Q5_1,
                         GGMLType.MXFP4})


# One routed expert: gate rows then up rows (n_ff_exp * 2 rows of n_embd), and down (n_embd rows
# of n_ff_exp), the same type as a dense layer's FFN.
ExpertWeights = SwiGLUWeights


class ExpertsPerLayer(NamedTuple):
    """A budget counted in experts per MoE layer (the C engine's positional cap) rather than bytes:
    the store holds the bytes of ``n`` experts of each MoE layer (each layer's own expert size).
    It stays one pool: which experts are resident follows their heat, so a hot layer may hold more
    than ``n`` and a cold one fewer."""

    n: int


# The resident copies' budget: bytes, experts per layer, or None for no limit.
Budget = int | ExpertsPerLayer | None


class ResidentLayer(NamedTuple):
    """A layer whose experts are all resident, as the compiled forward pass takes it."""

    pool: ExpertWeights  # every expert, stacked by expert (``packed.slot``)
    heat: np.ndarray  # float32 [n_experts]: the layer's row of ``ExpertStore.heat``
    hits: np.ndarray  # bool [n_experts]: its HITS bits


class _Stacking:
    """An allocator for ``make_weight`` that hands expert e the e-th part of each of a layer's
    stacked arrays, so that the layer's experts are one matrix per kind of weight (``packed.slot``):
    the forward pass applies all of a token's experts in one parallel region (``moe.apply_experts``)."""

    def __init__(self, arena: Arena, n: int) -> None:
        self.arena, self.n = arena, n
        self.whole: list[np.ndarray] = []  # the stacked arrays, in the order make_weight asks
        self.first: list[np.ndarray] = []  # expert 0's parts of them
        self.slot = self.i = 0

    def at(self, slot: int) -> _Stacking:
        self.slot, self.i = slot, 0
        return self

    def empty(self, shape: int | tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if self.i == len(self.whole):
            self.whole.append(self.arena.empty((self.n * shape[0], *shape[1:]), dtype))
        whole = self.whole[self.i]
        self.i += 1
        assert whole.shape[1:] == shape[1:] and whole.dtype == dtype, "experts differ in shape"
        part = whole[self.slot * shape[0] : (self.slot + 1) * shape[0]]
        if self.slot == 0:
            self.first.append(part)
        return part

    def stacked(self, w: Weight) -> Weight:
        """Expert 0's weight ``w`` as the whole stack."""
        names = ("q", "d", "m", "dh", "mh", "sd", "sm", "raw")
        fields = {name: self.whole[i] for name in names
                  for i, part in enumerate(self.first) if getattr(w, name) is part}
        if any(getattr(w, name).size and name not in fields for name in names):
            raise AssertionError("a packed array was not allocated from the stack")
        if "raw" in fields:  # in-place blocks are read-only, as the file's mapping (one numba type)
            fields["raw"].setflags(write=False)
        return w._replace(n_rows=w.n_rows * self.n, **fields)


class StoreCounters(NamedTuple):
    """Cumulative since the store opened; callers take differences over the span they report."""

    hits: int  # get() served by a resident copy
    misses: int  # get() that read the file
    missed_bytes: int  # file bytes those misses read
    t_disk: float  # seconds reading and packing misses
    t_compute: float  # seconds applying experts (a resident layer: its whole compiled FFN)


@nb.njit(**KERNEL)
def note_routing(heat: np.ndarray, hits: np.ndarray, expert_ids: np.ndarray, decay: np.float32) -> None:
    """A layer's heat decayed a step, its routed experts' heat +1 and their HITS bits set: one
    compiled call a layer, where three NumPy operations on 64 values took ~22 us."""
    for e in range(heat.shape[0]):
        heat[e] *= decay
    for e in expert_ids:
        heat[e] += np.float32(1.0)
        hits[e] = True


class ExpertStore:
    """Every MoE layer's routed experts, addressed by (layer, expert).

    ``n_layers``: layers of the network; ``n_experts``: experts per MoE layer; ``n_used``: experts
    per token (top-k, for reports); ``layers``: the
    layers that have routed experts (a glm4moe model's first layers are dense). ``ram_budget`` in
    bytes or experts per layer, None for no limit (every expert used stays resident)."""

    def __init__(self, gguf: GGUFFile, n_layers: int, n_experts: int, n_used: int,
                 ram_budget: Budget = None) -> None:
        self.gguf = gguf
        self.n_experts, self.n_used = n_experts, n_used
        self.layers: tuple[int, ...] = tuple(
            i for i in range(n_layers) if f"blk.{i}.ffn_down_exps.weight" in gguf.tensors
        )
        self._row_of = {layer: i for i, layer in enumerate(self.layers)}
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
        # Whether to read ahead: measured (``readahead.py``), or fixed (the benchmarks' baselines).
        self.readahead = ReadAheadPolicy()
        # On: misses read through the mapping (page faults, the pages kept mapped), as a plain mmap
        # engine reads: the benchmark's baseline. Off: by ``pread``, nothing mapped.
        self.mapped_reads = False
        self.heat = np.zeros((len(self.layers), self.n_experts), np.float32)
        self._hits_map = np.zeros((len(self.layers), self.n_experts), np.bool_)
        self._pinned: dict[tuple[int, int], ExpertWeights] = {}
        self._stacks: dict[int, ExpertWeights] = {}  # layer: every expert, stacked (``_Stacking``)
        self._recent: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self._pinned_bytes = self._recent_bytes = 0
        self._predictors: dict[int, Callable[[np.ndarray], np.ndarray]] = {}
        self._hits = self._misses = self._missed_bytes = 0
        self._t_disk = self._t_compute = 0.0
        self._step_uses = 0  # expert uses since the last ``step_done``, and the misses before it
        self._step_misses0 = 0
        self._buffer = np.empty(0, np.uint8)  # ``_scratch``
        # Sizes per layer: a file may mix block types across layers (budget accounting must not
        # assume layer 0's everywhere).
        self._nbytes = {layer: self._packed_nbytes(layer) for layer in self.layers}
        self._file_bytes = {
            layer: sum(self._slice_bytes(name) for name in self._tensors[layer]) for layer in self.layers
        }
        self.expert_nbytes = self._nbytes[self.layers[0]] if self.layers else 0  # layer 0's, for reports
        if isinstance(ram_budget, ExpertsPerLayer):
            ram_budget = sum(min(ram_budget.n, n_experts) * self._nbytes[layer] for layer in self.layers)
        self.budget: int | None = ram_budget
        self.expert_file_bytes = self._file_bytes[self.layers[0]] if self.layers else 0

    # -- the forward pass's interface --------------------------------------------------------------

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """Expert ``expert`` of layer ``layer``, packed for ``qmatmul``: the resident copy, or one
        packed from the file now (kept if the budget has room for it)."""
        key = (layer, expert)
        weights = self._pinned.get(key)
        if weights is None:
            weights = self._recent.get(key)
            if weights is not None:
                self._recent.move_to_end(key)
        if weights is not None:
            self._hits += 1
            return weights
        start = time.perf_counter()
        weights = self._pack(layer, expert)
        self._t_disk += time.perf_counter() - start
        self._misses += 1
        self._missed_bytes += self._file_bytes[layer]
        self._keep_recent(key, weights)
        return weights

    def resident_layer(self, layer: int) -> ResidentLayer | None:
        """Every expert of ``layer`` stacked by expert (``packed.slot``) with the layer's heat and
        HITS rows, when the whole model is resident in that form: the forward pass then routes,
        applies and accounts a layer in one compiled call (``moe.resident_ffn``), and reports the
        experts it used with ``note_resident_use``."""
        stack = self._stacks.get(layer)
        if stack is None:
            return None
        row = self._row_of[layer]
        return ResidentLayer(stack, self.heat[row], self._hits_map[row])

    def note_resident_use(self, n_used: int) -> None:
        """``n_used`` experts applied from a resident layer (their heat and HITS already noted)."""
        self._hits += n_used
        self._step_uses += n_used

    def note_routing(self, layer: int, expert_ids: np.ndarray) -> None:
        """The distinct experts (ascending int64) this step routes to in ``layer``: heat and HITS."""
        row = self._row_of[layer]
        self._step_uses += len(expert_ids)
        note_routing(self.heat[row], self._hits_map[row], expert_ids, np.float32(HEAT_DECAY))

    def step_done(self, seconds: float, decode: bool) -> None:
        """A forward step ended, ``seconds`` after it began; ``decode``: all its rows were decode
        rows (the read-ahead policy weighs those alone: a prefill chunk's cost is another scale)."""
        if decode and self.budget is not None:
            self.readahead.observe(seconds, self._step_uses, self._misses - self._step_misses0)
        self._step_uses, self._step_misses0 = 0, self._misses

    def note_compute(self, seconds: float) -> None:
        """Time the forward pass spent applying an expert (PERF's t_emm)."""
        self._t_compute += seconds

    def register_predictor(self, layer: int, predict: Callable[[np.ndarray], np.ndarray]) -> None:
        """``predict(h)``: the experts ``layer`` would route hidden rows ``h`` to (its router)."""
        self._predictors[layer] = predict

    def prefetch_next(self, layer: int, h: np.ndarray) -> None:
        """Read ahead the experts the MoE layer after ``layer`` is likely to use, guessed by applying
        its router to ``h`` (this layer's input) while this layer computes. Without a budget every
        expert used stays resident, and there is nothing to read ahead after the first use."""
        if not self.readahead.enabled or self.budget is None:
            return
        i = self._row_of[layer] + 1
        if i < len(self.layers) and (predict := self._predictors.get(self.layers[i])) is not None:
            self.prefetch(self.layers[i], predict(h))

    def prefetch(self, layer: int, expert_ids: np.ndarray) -> None:
        """Experts ``layer`` is expected to route to soon: ask the kernel to start reading the file
        pages of those not resident, so the read overlaps the compute in between."""
        if self.readahead.enabled:
            self._advise(layer, expert_ids)

    def queue_reads(self, layer: int, expert_ids: np.ndarray) -> None:
        """A step's experts in ``layer``, before it reads them one by one: every miss's pages asked
        of the kernel at once, so the disk reads them together (docs/store.md). No guess, so not the
        read-ahead policy's to decide; not for mapped reads (the plain mmap engine's baseline)."""
        if not self.mapped_reads:
            self._advise(layer, expert_ids)

    def _advise(self, layer: int, expert_ids: np.ndarray) -> None:
        for e in expert_ids.tolist():
            if self.tier(layer, e) == TIER_DISK:
                for name in self._tensors[layer]:
                    self.gguf.advise_willneed(*self._slice_span(name, e))

    # -- tiers -------------------------------------------------------------------------------------

    def pin_hottest(self, heat: np.ndarray | None) -> int:
        """Load ``heat`` (from ``.coli_usage``; None keeps the current one) and make the hottest
        experts resident, up to PIN_SHARE of the budget. When every expert fits the budget (or
        there is none), every expert is made resident, hottest first: a model that fits RAM is
        loaded whole at start, as any engine loads its weights, and no token waits on a miss.
        Returns how many were pinned."""
        if heat is not None:
            self.heat[...] = heat
        self._pinned.clear()
        self._pinned_bytes = 0
        if not self.layers:
            return 0
        everything = not self.streams
        room = None if everything else int(self.budget * PIN_SHARE)
        # Every expert resident for good: in huge pages, as the dense weights (``arena.py``; the
        # synthetic MoE's resident step 12.28 -> 11.38 ms, 13 of 14 pairs). Not when the budget is
        # short of the model: faulting huge pages in could then mean compacting memory at its cap.
        arena = Arena() if everything else None
        self._stacks.clear()
        if everything and not self.mapped_reads:  # (mapped reads copy outside any allocator)
            for layer in self.layers:
                if self._stackable(layer):
                    self._stack(layer, arena)
        order = np.argsort(-self.heat, axis=None, kind="stable")
        for flat in order.tolist():
            row, e = divmod(flat, self.n_experts)
            if self.heat[row, e] <= 0.0 and not everything:
                break
            layer = self.layers[row]
            size = self._nbytes[layer]
            if room is not None and self._pinned_bytes + size > room:
                break
            key = (layer, e)
            if key in self._pinned:  # stacked above
                continue
            weights = self._recent.pop(key, None)
            if weights is None:
                weights = self._pack(*key, arena)
            else:
                self._recent_bytes -= size
            self._pinned[key] = weights
            self._pinned_bytes += size
        self._trim_recent()
        return len(self._pinned)

    @property
    def streams(self) -> bool:
        """Whether some experts are read from the file at each use (the budget holds fewer)."""
        return bool(self.layers) and self.budget is not None and self.all_nbytes() > self.budget

    def _stackable(self, layer: int) -> bool:
        """Whether ``layer``'s experts can be stacked (``packed.slot``): packed Q4, Q5, Q6 or Q8 in whole
        groups of rows, or the file's blocks in place (float32 copies are not)."""
        infos = [self.gguf.tensors[name] for name in self._tensors[layer]]
        kinds = {packed_kind([int(i.gtype) for i in infos[:2]], lanes=STORE_LANES),
                 packed_kind([int(infos[2].gtype)], lanes=STORE_LANES)}
        whole_groups = all(i.shape[1] % GROUP == 0 for i in infos)
        lanes = {KIND_Q4, KIND_Q5, KIND_Q6, KIND_Q8}
        return kinds <= {KIND_BLOCKS} or (kinds <= lanes | {KIND_BLOCKS} and whole_groups)

    def _stack(self, layer: int, arena: Arena) -> None:
        """Pack every expert of ``layer`` into stacked arrays and pin each (its parts of them)."""
        stacking = _Stacking(arena, self.n_experts)
        for e in range(self.n_experts):
            if self._recent.pop((layer, e), None) is not None:
                self._recent_bytes -= self._nbytes[layer]
            self._pinned[(layer, e)] = self._pack(layer, e, stacking.at(e))
            self._pinned_bytes += self._nbytes[layer]
        first = self._pinned[(layer, 0)]
        self._stacks[layer] = ExpertWeights(stacking.stacked(first.gate_up), stacking.stacked(first.down))

    def all_nbytes(self) -> int:
        """Bytes of every expert's packed copy: what a budget must hold for the whole model."""
        return sum(self._nbytes[layer] for layer in self.layers) * self.n_experts

    def tier(self, layer: int, expert: int) -> int:
        return TIER_RAM if (layer, expert) in self._pinned or (layer, expert) in self._recent else TIER_DISK

    def tier_counts(self) -> tuple[int, int, int]:
        """(ram experts, disk experts, resident bytes)."""
        ram = len(self._pinned) + len(self._recent)
        return ram, len(self.layers) * self.n_experts - ram, self._pinned_bytes + self._recent_bytes

    def counters(self) -> StoreCounters:
        return StoreCounters(self._hits, self._misses, self._missed_bytes, self._t_disk, self._t_compute)

    # -- telemetry maps ----------------------------------------------------------------------------

    def expert_map(self) -> bytes:
        """EMAP's bytes: row-major over (MoE layer, expert), ``(tier << 6) | heat bucket``."""
        buckets = np.minimum(np.floor(np.log2(1.0 + self.heat.astype(np.float64)) * HEAT_BUCKETS_PER_OCTAVE),
                             HEAT_BUCKET_MAX).astype(np.uint8)
        tiers = np.zeros_like(buckets)
        for layer, e in (*self._pinned, *self._recent):
            tiers[self._row_of[layer], e] = TIER_RAM
        return ((tiers << 6) | buckets).tobytes()

    def take_hits(self) -> bytes:
        """HITS' bits since the previous call: row-major, bit i of the map is bit ``i % 8`` (least
        significant first) of byte ``i // 8``."""
        bits = np.packbits(self._hits_map.reshape(-1), bitorder="little").tobytes()
        self._hits_map[...] = False
        return bits

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of EMAP and HITS: MoE layers × experts."""
        return len(self.layers), self.n_experts

    # -- internals ---------------------------------------------------------------------------------

    def _keep_recent(self, key: tuple[int, int], weights: ExpertWeights) -> None:
        size = self._nbytes[key[0]]
        if self.budget is not None and self._pinned_bytes + size > self.budget:
            return  # no room beside the pinned set: the copy stays transient
        self._recent[key] = weights
        self._recent_bytes += size
        self._trim_recent()

    def _trim_recent(self) -> None:
        if self.budget is None:
            return
        while self._recent and self._pinned_bytes + self._recent_bytes > self.budget:
            (layer, _), _ = self._recent.popitem(last=False)
            self._recent_bytes -= self._nbytes[layer]

    def _packed_nbytes(self, layer: int) -> int:
        """An expert's packed size, from the shapes alone (nothing read from the file)."""
        infos = [self.gguf.tensors[name] for name in self._tensors[layer]]
        rows = [(info.shape[1], int(info.gtype)) for info in infos]
        return (packed_nbytes(rows[:2], infos[0].shape[0], lanes=STORE_LANES)
                + packed_nbytes(rows[2:], infos[2].shape[0], lanes=STORE_LANES))

    def _pack(self, layer: int, expert: int, arena: Arena | _Stacking | None = None) -> ExpertWeights:
        """Expert ``expert`` of ``layer`` from the file, its copies in ``arena`` if given (else
        NumPy's heap)."""
        if not 0 <= expert < self.n_experts or layer not in self._tensors:
            raise KeyError(f"no expert {expert} in layer {layer}")
        gate, up, down = self._tensors[layer]
        return ExpertWeights(gate_up=self._read_weight((gate, up), expert, arena),
                             down=self._read_weight((down,), expert, arena))

    def _read_weight(self, names: tuple[str, ...], expert: int, arena: Arena | _Stacking | None) -> Weight:
        """One expert's rows of ``names`` stacked, read from the file by ``pread`` (its pages never
        enter this process's RSS). Formats computed in place are read straight into the resident
        copy: a miss is one read. The packed formats are read into a buffer that is reused, and
        packed from there (moves of the file's words, in cache)."""
        types = [int(self.gguf.tensors[name].gtype) for name in names]
        n_cols = self.gguf.tensors[names[0]].shape[0]
        if self.mapped_reads:
            parts = [(self._mapped(name, expert), t) for name, t in zip(names, types, strict=True)]
            return make_weight(parts, n_cols, copy=True, lanes=STORE_LANES)
        sizes = [self._slice_bytes(name) for name in names]
        blocks = packed_kind(types, lanes=STORE_LANES) == KIND_BLOCKS
        fresh = np.empty if arena is None else arena.empty
        buf = fresh(sum(sizes), np.uint8) if blocks else self._scratch(sum(sizes))
        parts, at = [], 0
        for name, size, t in zip(names, sizes, types, strict=True):
            raw = buf[at : at + size]
            self.gguf.read_into(self._slice_span(name, expert)[0], raw)
            parts.append((raw.reshape(self.gguf.tensors[name].shape[1], -1), t))
            at += size
        if blocks:  # the buffer is the copy: its rows are the parts' rows, end to end
            return blocks_weight(buf, parts)
        return make_weight(parts, n_cols, lanes=STORE_LANES, arena=arena)

    def _mapped(self, name: str, expert: int) -> np.ndarray:
        """The raw rows of one expert of a 3-D tensor, a view of the mapping."""
        rows = self.gguf.tensors[name].shape[1]
        return self.gguf.raw(name)[expert * rows : (expert + 1) * rows]

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A reused read buffer of at least ``nbytes`` (a fresh one would fault its pages in on
        every miss). Only the forward step's thread reads experts, one at a time."""
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, np.uint8)
        return self._buffer[:nbytes]

    def _slice_bytes(self, name: str) -> int:
        return self.gguf.tensors[name].nbytes // self.n_experts

    def _slice_span(self, name: str, expert: int) -> tuple[int, int]:
        """(file offset, length) of one expert's rows of a 3-D tensor."""
        size = self._slice_bytes(name)
        return self.gguf.tensors[name].offset + expert * size, size

