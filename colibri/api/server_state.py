"""What every route shares: the model's identity and text side, the engine, admission, counters.

One ``ServerState`` per server, made by ``http_server`` and handed to ``create_app``, which keeps it
in ``app.extensions[EXTENSION]`` for the routes and hooks. Nothing here knows HTTP: the generation
side (``completion``) takes it as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from colibri.api.admission import Admission
from colibri.api.engine_client import EngineClient
from colibri.api.metrics import Registry, ServerMetrics, server_metrics
from colibri.api.openai_requests import Generation, Render
from colibri.api.security import CorsPolicy, HostGuard
from colibri.api.slot_owners import SlotOwners

EXTENSION = "colibri"  # the key of the state in ``app.extensions``

# /health's request counts, each request counted once by how it ended.
COUNTERS = ("completed", "rejected", "cancelled", "failed")


@dataclass
class ServerState:
    model_id: str
    n_slots: int
    n_ctx: int
    api_key: str | None
    engine: EngineClient
    admission: Admission
    render: Render
    count_tokens: Callable[[str], int]  # a rendered prompt's tokens, when the engine did not say
    host_guard: HostGuard
    cors: CorsPolicy
    web_dist: Path | None
    atlas_path: Path | None = None  # experts.json that ``coli atlas`` wrote, published at /atlas
    block_types: tuple[str, ...] = ()  # the model file's tensor block formats, for the console
    kv_bytes_per_token: int = 0  # a slot's KV cache per token (the engine's --kv-type), for /health
    # A request's prompt as token ids, by the trust rule (``ModelText.encode_chat``/``encode_text``);
    # None: the engine tokenizes the rendered text (a unit test's scripted engine). Its second
    # argument, the context: a prompt that cannot fit raises ``TooManyTokens`` untokenized.
    encode: Callable[[Generation, int], list[int]] | None = None
    # Whose conversation each slot holds (only its owner reuses it); None: no rule (a unit test).
    owners: SlotOwners | None = None
    # A request's temperature and top_p where it sets none (--temperature, --top-p); empty: OpenAI's.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    replica_id: str = ""  # x-colibri-replica and /health: --replica-id, else the bound host:port
    draining: bool = False  # SIGTERM came: new generations get 503 while those in flight finish
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's date
    registry: Registry = field(init=False)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.registry, self.metrics = server_metrics()
        if isinstance(self.engine, EngineClient):  # the engine sees the DONEs; /metrics counts them
            self.engine.persist.on_failure = self.metrics.persist_failures.inc
