"""Opening a model file: the container, its hyperparameters, the network for its architecture.
``Model`` is what ``colibri.model.interface.EngineModel`` describes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from colibri.model.chat import ChatTemplate
from colibri.model.hparams import HParams
from colibri.model.interface import ExpertTelemetry, StepTimes
from colibri.model.kv_cache import DEFAULT_KV_TYPE, KV_TYPES, KVCache, kv_type_name
from colibri.model.network import ARCHITECTURES, Decoder
from colibri.model.text import ModelText
from colibri.model.tokenizer import GGUFTokenizer
from colibri.store.experts import Budget
from colibri.store.gguf import GGUFError, GGUFFile


def unsupported(arch: str) -> str:
    """The one wording of an architecture the engine does not run (``coli run`` and ``coli info``)."""
    return f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"


class Model:
    """A loaded model. The tokenizer and template are built on first use: ``--prompt-ids`` runs
    need neither, and test models may carry no vocabulary."""

    def __init__(self, path: Path, ram_budget: Budget = None, kv_type: str = DEFAULT_KV_TYPE,
                 mtp: bool = False) -> None:
        """``ram_budget``: bytes (or experts per MoE layer) the expert store's resident copies may take
        (None: no limit); ``kv_type``: the KV caches' element type (``kv_cache.KV_TYPES``); ``mtp``:
        load the file's NextN layer, where the architecture runs one, for drafting (``draft``)."""
        self.kv_type = kv_type_name(kv_type)
        self._kv_dtype = KV_TYPES[kv_type]
        self.gguf = GGUFFile(path)
        self.hp = HParams.from_gguf(self.gguf)
        arch = ARCHITECTURES.get(self.hp.arch)
        if arch is None:
            raise GGUFError(f"{path}: {unsupported(self.hp.arch)}")
        self.decoder: Decoder = arch(self.gguf, self.hp, ram_budget, mtp)
        self.has_draft_layer = self.decoder.nextn is not None
        self.text = ModelText(self.gguf)
        self.fingerprint = self.gguf.fingerprint()
        store = self.decoder.experts
        self.experts: ExpertTelemetry | None = store if store.layers else None
        self.streams_experts = store.streams  # some experts read from the file at each use

    @property
    def tokenizer(self) -> GGUFTokenizer:
        return self.text.tokenizer

    @property
    def chat_template(self) -> ChatTemplate:
        return self.text.chat_template

    def new_kv_cache(self, n_slots: int, n_ctx: int) -> KVCache:
        return KVCache(self.hp, n_slots, n_ctx, self.kv_type, self.decoder.kv_layers)

    def kv_fingerprint(self, n_ctx: int) -> bytes:
        """What persisted keys and values for a cache of ``n_ctx`` positions are checked against: the
        file's fingerprint, and where the keys' RoPE depends on the context (Phi's long factors
        past the original context), which RoPE: keys rotated one way must not meet queries
        rotated the other after a restart with another ``--ctx``."""
        variant = self.decoder.rope_variant(n_ctx)
        return hashlib.sha256(self.fingerprint + variant.encode()).digest() if variant else self.fingerprint

    def forward(self, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray, kv: KVCache,
                logit_rows: np.ndarray, n_direct: int = 0, embeds: np.ndarray | None = None) -> np.ndarray:
        """One step of the network: see ``Decoder.forward``. The cache must be of this model's type:
        the decoder's layer entry points are compiled for one (``entry.Entry``)."""
        if kv.dtype != self._kv_dtype:
            raise ValueError(f"a {kv.dtype} KV cache for a model of {self.kv_type} caches")
        return self.decoder.forward(tokens, slots, positions, kv, logit_rows, n_direct, embeds)

    def hidden(self, rows: np.ndarray) -> np.ndarray:
        """The last forward step's ``rows`` after the last layer and the final norm."""
        return self.decoder.hidden(rows)

    def draft(self, tokens: np.ndarray, hidden: np.ndarray, slots: np.ndarray, positions: np.ndarray,
              kv: KVCache, logit_rows: np.ndarray, n_direct: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The NextN layer's step (``network/nextn.py``): row t takes ``tokens[t]``, the token after
        the one whose last hidden state is ``hidden[t]`` (``hidden(rows)``); the logits of
        ``logit_rows`` (each predicting the token after ``tokens[t]``) and those rows' output as the
        hidden state of the token after each (a longer draft's next row). ValueError without one."""
        if kv.dtype != self._kv_dtype:
            raise ValueError(f"a {kv.dtype} KV cache for a model of {self.kv_type} caches")
        return self.decoder.draft(tokens, hidden, slots, positions, kv, logit_rows, n_direct)

    @property
    def step_times(self) -> StepTimes:
        return self.decoder.step_times
