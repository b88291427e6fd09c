"""The mux protocol's messages (docs/serve_protocol.md), one dataclass each.

Requests flow server -> engine, responses and telemetry engine -> server. ``ProtocolError`` is what
a reader produces for input it cannot accept; the engine answers it with an ``Error``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ErrorCode(enum.StrEnum):
    BAD_FRAME = "BAD_FRAME"  # framing broken: a payload not followed by \n, a line too long
    BAD_REQUEST = "BAD_REQUEST"  # a well-framed line that is not a valid request
    SLOT_BUSY = "SLOT_BUSY"
    DUPLICATE_ID = "DUPLICATE_ID"
    EMPTY_PROMPT = "EMPTY_PROMPT"
    NOT_FOUND = "NOT_FOUND"  # CANCEL of an id not in flight
    CANCELLED = "CANCELLED"
    CONTEXT_EXCEEDED = "CONTEXT_EXCEEDED"  # ERROR <id> CONTEXT_EXCEEDED <used> <limit>


# ---------------------------------------------------------------- requests (server -> engine)


@dataclass(frozen=True)
class Submit:
    id: int
    slot: int
    max_tokens: int
    temperature: float
    top_p: float
    prompt: str
    seed: int | None = None  # colibri's optional 8th field: reproducible sampling
    # SUBMIT_IDS: the prompt as token ids (``prompt`` is then empty). The server sends these: it
    # tokenized the template's markup with control tokens and the client's text without.
    prompt_ids: tuple[int, ...] | None = None
    # The 7th field's extra payload (the gateway's): a grammar every sampled token must keep to
    # (GBNF, or llguidance's Lark with ``%json`` schemas); None: unconstrained.
    grammar: str | None = None
    # The 9th field (ours): False, no speculative decoding for this request; None (or True, which is
    # sent as nothing and read back as None): the engine's setting.
    speculative: bool | None = None


@dataclass(frozen=True)
class Cancel:
    id: int


@dataclass(frozen=True)
class Stop:
    """``STOP <id>``: the host matched a stop string; end the request now with a normal DONE."""

    id: int


@dataclass(frozen=True)
class Forget:
    """``FORGET <slot>``: the slot's next request reuses none of its history (a client other than
    the one whose conversation it holds: no prefix of it may be learnt from ``reused_tokens``)."""

    slot: int


@dataclass(frozen=True)
class ProtocolError:
    """Input the reader rejected; ``id`` is 0 when the request's id could not be read."""

    id: int
    code: ErrorCode
    detail: str = ""


@dataclass(frozen=True)
class EndOfInput:
    """The peer closed its side: a graceful shutdown for the engine."""


# ---------------------------------------------------------------- responses (engine -> server)


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Stat:
    """The handshake's STAT line: ``STAT 0 0.00 0.0 <rss_gb>``."""

    rss_gb: float


@dataclass(frozen=True)
class Accept:
    """``ACCEPT <id> <prompt_tokens>``: the SUBMIT passed validation and the context check; prefill
    starts. A gateway opens its streaming response on it."""

    id: int
    prompt_tokens: int


@dataclass(frozen=True)
class Data:
    id: int
    text: bytes  # UTF-8: whole characters (the detokenizer never splits one)
    # The sampled token whose text this is (None: the detokenizer's tail at the turn's end, or a
    # DATA line read off the wire, which carries text only). Sessions whose wire carries ids use it.
    token: int | None = None


# TOPK lines carry five candidates (serve_protocol.md): the engine sends that many, and it is the
# most ``top_logprobs`` an HTTP client can ask for.
TOPK_CANDIDATES = 5


@dataclass(frozen=True)
class TopK:
    id: int
    candidates: tuple[tuple[float, bytes], ...]  # (logprob, token text), best first


@dataclass(frozen=True)
class Done:
    id: int
    emitted: int
    tok_s: float
    hit_pct: float
    rss_gb: float
    prompt_tokens: int
    length_limited: bool
    # Colibri's trailing field: the slot file was written (fsynced, renamed) before this DONE (True),
    # or not (False: no state directory, or the save failed). None: the engine did not say (a DONE
    # of the spec's eight fields), so nothing is known either way.
    saved: bool | None = None


@dataclass(frozen=True)
class Error:
    id: int
    code: ErrorCode
    args: tuple[int, ...] = ()  # CONTEXT_EXCEEDED: (used, limit)


@dataclass(frozen=True)
class HwInfo:
    cores: int
    ram_total_gb: float
    ram_avail_gb: float
    ngpu: int
    vram_total_gb: float
    cpu_name: str
    gpu_name: str


@dataclass(frozen=True)
class Tiers:
    vram_experts: int
    ram_experts: int
    disk_experts: int
    vram_gb: float
    ram_gb: float


@dataclass(frozen=True)
class ExpertMap:
    """EMAP: one byte per expert, (tier << 6) | heat."""

    rows: int
    cols: int
    data: bytes


@dataclass(frozen=True)
class Hits:
    """HITS: one bit per expert routed since the previous HITS."""

    rows: int
    cols: int
    data: bytes


@dataclass(frozen=True)
class Repin:
    layer: int
    expert: int
    old_tier: int
    gpu: int


@dataclass(frozen=True)
class Perf:
    """This turn's timings in seconds, then colibri's own trailing fields (docs/serve_protocol.md)."""

    id: int
    dt: float
    t_edisk: float = 0.0
    t_ewait: float = 0.0
    t_emm: float = 0.0
    t_attn: float = 0.0
    t_kvb: float = 0.0
    t_head: float = 0.0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified, and of those accepted
    accepted_tokens: int = 0


@dataclass(frozen=True)
class Prof:
    """PROF, the gateway's per-turn profile: wall seconds, token counts, the expert store's and the
    forward pass's seconds, and the forward steps the turn took part in. It carries no request id
    (the gateway reads ten fields): it belongs to the DONE that follows it in the turn's block."""

    wall: float
    prompt_tokens: int
    completion_tokens: int
    t_edisk: float = 0.0
    t_ewait: float = 0.0
    t_emm: float = 0.0
    t_attn: float = 0.0
    t_head: float = 0.0
    forwards: int = 0


@dataclass(frozen=True)
class Entropy:
    bits: tuple[float, ...] = ()


@dataclass(frozen=True)
class Gpu:
    used_gb: float
    total_gb: float
    experts: int


@dataclass(frozen=True)
class Gpus:
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class UnknownLine:
    """A line kind this reader does not know: ignored, by the protocol's forward-compatibility rule."""

    line: bytes


Request = Submit | Cancel | Stop | Forget
Response = (
    Ready | Stat | Accept | Data | TopK | Done | Error | HwInfo | Tiers | ExpertMap | Hits | Repin
    | Perf | Prof | Entropy | Gpus
)
