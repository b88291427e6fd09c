"""The protocol's telemetry, built from the engine's state: host facts (HWINFO, STAT), the expert
store's maps (TIERS, EMAP, HITS) and a finished turn's figures (PERF, then DONE). Builders only:
the engine decides when to emit."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from colibri import hostinfo
from colibri.io.events import Done, Entropy, ExpertMap, Gpus, Hits, HwInfo, Perf, Prof, Tiers
from colibri.model.interface import ExpertTelemetry, StoreCounters

if TYPE_CHECKING:
    from colibri.sched.requests import Request

GB = hostinfo.GIB


def hwinfo() -> HwInfo:
    mem = hostinfo.meminfo()
    return HwInfo(
        cores=hostinfo.os_cpu_count(),
        ram_total_gb=mem.get("MemTotal", 0) / GB,
        ram_avail_gb=mem.get("MemAvailable", 0) / GB,
        ngpu=0,
        vram_total_gb=0.0,
        cpu_name=hostinfo.cpu_name().replace("|", "/"),  # '|' separates HWINFO's fields
        gpu_name="",
    )


def rss_gb() -> float:
    return hostinfo.rss_gb()


def expert_events(experts: ExpertTelemetry | None, hits: bool) -> list[object]:
    """TIERS, EMAP and (with ``hits``) HITS, from the expert store; a dense model has TIERS of
    zeros and no maps (an empty map is a line a strict reader cannot split into its four fields).
    Call between steps: the forward pass changes the tiers during one."""
    if experts is None:
        return [Tiers(0, 0, 0, 0.0, 0.0)]
    ram, disk, ram_bytes = experts.tier_counts()
    rows, cols = experts.shape
    events: list[object] = [Tiers(0, ram, disk, 0.0, ram_bytes / GB),
                            ExpertMap(rows, cols, experts.expert_map())]
    if hits:
        events.append(Hits(rows, cols, experts.take_hits()))
    return events


def turn_end_events(req: Request, counters: StoreCounters | None, maps: list[object],
                    saved: bool, perf: bool = False) -> list[object]:
    """What ends a turn, in the protocol's order: HWINFO, PROF, (with ``perf``: PERF, ENTROPY,
    GPUS), the expert maps, DONE. PROF is the gateway's profile, always sent; PERF, ENTROPY and
    GPUS are the spec's, sent when the host asks (SERVE_PERF=1; ``coli serve`` does).
    The expert store serves every slot at once, so a turn's hit rate and times are the store's
    over the turn's span (``counters`` now against those when it was admitted). ``saved``: the
    slot file was written before this DONE (DONE must not claim durability it does not have)."""
    now = time.perf_counter()
    gen_s = now - req.t_first if req.t_first else 0.0
    tok_s = (req.emitted - 1) / gen_s if req.emitted > 1 and gen_s > 0 else 0.0
    hit_pct, t_edisk, t_emm = 0.0, 0.0, 0.0
    if counters is not None and req.store_at_start is not None:
        c0, c1 = req.store_at_start, counters
        uses = (c1.hits - c0.hits) + (c1.misses - c0.misses)
        hit_pct = 100.0 * (c1.hits - c0.hits) / uses if uses else 0.0
        t_edisk, t_emm = c1.t_disk - c0.t_disk, c1.t_compute - c0.t_compute
    prof = Prof(now - req.t_start, len(req.prompt), req.emitted, t_edisk=t_edisk, t_emm=t_emm,
                t_attn=req.t_attn, t_head=req.t_head, forwards=req.forwards)
    done = Done(req.id, req.emitted, tok_s, hit_pct, rss_gb(), len(req.prompt), req.length_limited, saved)
    spec: list[object] = []
    drafts = req.drafting
    if perf:
        spec = [Perf(req.id, now - req.t_start, t_edisk=t_edisk, t_emm=t_emm, t_attn=req.t_attn,
                     t_kvb=req.t_prefill, t_head=req.t_head,
                     reused_tokens=req.reused, prefilled_tokens=len(req.prompt) - req.reused,
                     drafted_tokens=drafts.drafted if drafts else 0,
                     accepted_tokens=drafts.accepted if drafts else 0),
                Entropy(), Gpus()]
    return [hwinfo(), prof, *spec, *maps, done]
