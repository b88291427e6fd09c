"""What the engine needs of a loaded model, and nothing more: the scheduler (``colibri.sched``)
depends on these Protocols, never on the network, the kernels or the store behind them.

``Model`` (``loader.py``) is the implementation; a test may hand the engine anything that fits.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from colibri.model.chat import ChatTemplate
from colibri.model.hparams import HParams
from colibri.model.kv_cache import KVCache
from colibri.model.text import ModelText
from colibri.model.tokenizer import GGUFTokenizer
from colibri.store.experts import StoreCounters


class StepTimes(NamedTuple):
    """Parts of the last forward step, in seconds, as the decoder can time them from Python:
    attention where it is its own compiled call (a MoE layer's; a dense layer's attention and FFN
    are one call, so its share is not split out), and the output head (final norm and logits)."""

    attn: float = 0.0
    head: float = 0.0


class ExpertTelemetry(Protocol):
    """The expert store as the engine sees it: counters, tiers, heat and the protocol's maps. The
    forward pass changes all of these during a step: read them between steps."""

    heat: np.ndarray  # decayed routings per (MoE layer, expert), persisted to .coli_usage
    budget: int | None  # bytes the resident copies may take; None: no limit

    @property
    def shape(self) -> tuple[int, int]: ...  # (MoE layers, experts): the maps' rows and columns

    def counters(self) -> StoreCounters: ...

    def tier_counts(self) -> tuple[int, int, int]: ...  # (RAM experts, disk experts, RAM bytes)

    def expert_map(self) -> bytes: ...  # EMAP: (tier << 6) | heat bucket per expert

    def take_hits(self) -> bytes: ...  # HITS since the previous call, one bit per expert

    def pin_hottest(self, heat: np.ndarray | None) -> int: ...  # pin from persisted heat


class EngineModel(Protocol):
    """A loaded model: one forward step over a ragged batch of rows, and what surrounds it."""

    hp: HParams
    fingerprint: bytes  # of the file: persisted state from another model is refused
    experts: ExpertTelemetry | None  # None: a dense model (no expert store to report)
    streams_experts: bool  # some experts are read from the file at each use (the budget is short)

    @property
    def tokenizer(self) -> GGUFTokenizer: ...

    @property
    def chat_template(self) -> ChatTemplate: ...

    text: ModelText  # the text side: the trust rule's rendering of chat turns
    step_times: StepTimes  # the last forward step's parts (PERF and PROF add them up per request)
    has_draft_layer: bool  # a NextN (MTP) layer is loaded: ``draft`` runs it

    def hidden(self, rows: np.ndarray) -> np.ndarray: ...  # the last step's rows after the final norm

    def new_kv_cache(self, n_slots: int, n_ctx: int) -> KVCache: ...

    def kv_fingerprint(self, n_ctx: int) -> bytes: ...  # what persisted K/V of this context must match

    def forward(self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
                logit_rows: np.ndarray, n_direct: int, embeds: np.ndarray | None = None) -> np.ndarray: ...

    def draft(self, tokens: np.ndarray, hidden: np.ndarray, slots: np.ndarray, positions: np.ndarray,
              kv: KVCache, logit_rows: np.ndarray, n_direct: int) -> tuple[np.ndarray, np.ndarray]: ...
