"""The engine's core: KV slots, requests and the step loop, independent of the wire protocol.

Every active request contributes rows to one forward step: one row per request that is decoding
(continuous batching: the weights are read once per step for all of them) and, for at most one
request that is prefilling, a chunk of its prompt (serial, chunked prefill, interleaved with the
decode rows so a long prompt does not freeze the other streams). The step runs in a worker thread
(the kernels release the GIL), so stdin is read and CANCEL acted on while it computes.

A request's lifetime is its task in the engine's nursery, inside its own cancel scope: CANCEL
cancels the scope; the task then waits out the step in flight, persists the slot and answers
ERROR CANCELLED. The protocol drivers (mux_server, legacy_server) see only ``emit(event)`` calls
with the events of ``colibri.io.events``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

from colibri.io.events import (
    Data,
    Done,
    Entropy,
    Error,
    ErrorCode,
    ExpertMap,
    Gpus,
    Hits,
    Perf,
    Submit,
    Tiers,
    TopK,
)
from colibri.model.kv_cache import KVCache
from colibri.model.sampling import Sampler, SamplingParams
from colibri.sched import persist, telemetry
from colibri.store.experts import ExpertStore, StoreCounters

MAX_SLOTS = 16  # the protocol's limit: slot fields and KV_SLOTS are 1..16
TOPK_CANDIDATES = 5  # TOPK lines carry five candidates (serve_protocol.md)
HITS_EVERY_TOKENS = 6  # the spec's "~every 6 tokens": a live routing picture without flooding the pipe


@dataclass(eq=False)
class Slot:
    index: int
    history: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache, in order
    owner: Request | None = None


@dataclass(eq=False)
class Request:
    id: int
    slot: Slot
    submit: Submit
    sampler: Sampler
    emit: Callable[[object], Awaitable[None]]
    prompt: list[int] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)  # tokens still to feed: prompt suffix, then the last sample
    decoder: object = None
    emitted: int = 0
    reused: int = 0
    admitted: bool = False
    length_limited: bool = False
    cancelled: bool = False
    finished: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    t_prefill: float = 0.0
    store_at_start: StoreCounters | None = None  # the expert store's counters when admitted


@dataclass
class StepRows:
    """One forward step: the rows, and for each request its share of them."""

    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    shares: list[tuple[Request, int, int | None]] = field(default_factory=list)  # (req, n rows, logit row)
    n_direct: int = 0  # the leading decode rows


class Engine:
    def __init__(
        self, model, n_slots: int, n_ctx: int, state_dir: Path | None, prefill_chunk: int,
        emit: Callable[[object], Awaitable[None]], topk: bool = False,
    ) -> None:
        self.model, self.net, self.tokenizer = model, model.net, model.tokenizer
        self.n_ctx, self.state_dir, self.prefill_chunk = n_ctx, state_dir, prefill_chunk
        self.emit, self.topk = emit, topk
        self.kv = KVCache(model.hp, n_slots, n_ctx)
        self.slots = [Slot(i) for i in range(n_slots)]
        self.requests: dict[int, Request] = {}
        self.active: list[Request] = []
        self.step_lock = trio.Lock()
        self._usage_lock = trio.Lock()
        self._work = trio.Event()
        self.idle = trio.Event()
        self.idle.set()
        self.stop_ids = model.tokenizer.stop_ids
        self.model_fp = persist.model_fingerprint(model.gguf)
        hp = model.hp
        self.layout_fp = persist.layout_fingerprint(hp.n_layers, hp.n_kv_heads, hp.head_dim)
        store = getattr(self.net, "experts", None)
        self.experts: ExpertStore | None = store if store is not None and store.layers else None

    # ------------------------------------------------------------------ state

    def restore(self) -> None:
        """Load every slot's persisted history and K/V (a bad file: one warning, slot cold)."""
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        persist.remove_stale_temps(self.state_dir)
        for slot in self.slots:
            tokens = persist.load_slot(
                self.state_dir, slot.index, self.model_fp, self.layout_fp,
                self.kv.k[slot.index], self.kv.v[slot.index], self.n_ctx, self.model.hp.n_vocab,
            )
            slot.history = tokens or []
        if self.experts is not None:
            heat = persist.load_usage(self.state_dir, self.model_fp, self.experts.heat.shape)
            self.experts.pin_hottest(heat)

    async def persist_slot(self, slot: Slot) -> None:
        """Write the slot's file. A failure (disk full, permissions) is a warning: the previous
        file stays intact and the engine goes on serving from memory."""
        if self.state_dir is None:
            return
        history = list(slot.history)
        try:
            await trio.to_thread.run_sync(
                lambda: persist.save_slot(self.state_dir, slot.index, history, self.kv.k[slot.index],
                                          self.kv.v[slot.index], self.model_fp, self.layout_fp)
            )
        except OSError as e:
            warn(f"slot {slot.index} not persisted: {e}")

    async def save_usage(self) -> None:
        """``.coli_usage``; one writer at a time (turns end concurrently, the temp file is shared)."""
        if self.state_dir is None:
            return
        async with self._usage_lock:
            async with self.step_lock:  # a snapshot between steps: the forward pass updates the heat
                heat = self.experts.heat.copy() if self.experts else np.zeros(0, np.float32)
            try:
                await trio.to_thread.run_sync(persist.save_usage, self.state_dir, heat, self.model_fp)
            except OSError as e:
                warn(f"routing heat not persisted: {e}")

    # ------------------------------------------------------------------ requests

    def check(self, sub: Submit) -> Error | None:
        """The checks a SUBMIT must pass before it gets a task (cheap, on the reader's path)."""
        if sub.id in self.requests:
            return Error(sub.id, ErrorCode.DUPLICATE_ID)
        if sub.slot >= len(self.slots):
            return Error(sub.id, ErrorCode.BAD_REQUEST)
        if self.slots[sub.slot].owner is not None:
            return Error(sub.id, ErrorCode.SLOT_BUSY)
        if not sub.prompt:
            return Error(sub.id, ErrorCode.EMPTY_PROMPT)
        return None

    def start(self, sub: Submit, nursery: trio.Nursery, sampling: SamplingParams | None = None,
              emit: Callable[[object], Awaitable[None]] | None = None) -> Request:
        """Register an accepted SUBMIT and start its task; its events go to ``emit`` (default: the
        engine's)."""
        params = sampling or SamplingParams(temperature=sub.temperature, top_p=sub.top_p, seed=sub.seed)
        slot = self.slots[sub.slot]
        req = Request(sub.id, slot, sub, Sampler(params), emit or self.emit, decoder=self.tokenizer.stream())
        slot.owner = req
        self.requests[sub.id] = req
        self.idle = trio.Event()
        nursery.start_soon(self._serve, req)
        return req

    def cancel(self, rid: int) -> bool:
        """False if no such request is in flight. A request that has already finished generating
        ends with its DONE; the CANCEL is then moot and gets no reply of its own."""
        req = self.requests.get(rid)
        if req is None:
            return False
        if not req.finished.is_set():
            req.scope.cancel()
        return True

    async def _serve(self, req: Request) -> None:
        try:
            with req.scope:
                if await self._admit(req):
                    await req.finished.wait()
            if req.scope.cancelled_caught:
                req.cancelled = True
                async with self.step_lock:  # the step in flight has written its K/V
                    self._deactivate(req)
                with trio.CancelScope(shield=True):
                    await self.persist_slot(req.slot)
                    await req.emit(Error(req.id, ErrorCode.CANCELLED))
            elif req.admitted:
                with trio.CancelScope(shield=True):
                    await self._finish(req)
        finally:
            req.slot.owner = None
            self.requests.pop(req.id, None)
            if not self.requests:
                self.idle.set()

    async def _admit(self, req: Request) -> bool:
        """Tokenize (off the event loop: a prompt may be megabytes), check, reuse the slot's prefix."""
        prompt = await trio.to_thread.run_sync(self.tokenizer.encode, req.submit.prompt, True)
        if not prompt:
            await req.emit(Error(req.id, ErrorCode.EMPTY_PROMPT))
            return False
        if len(prompt) > self.n_ctx:
            await req.emit(Error(req.id, ErrorCode.CONTEXT_EXCEEDED, (len(prompt), self.n_ctx)))
            return False
        history = req.slot.history
        common = 0
        for a, b in zip(history, prompt, strict=False):
            if a != b:
                break
            common += 1
        req.reused = min(common, len(prompt) - 1)  # the last prompt token is fed for its logits
        del history[req.reused :]
        req.prompt, req.todo = prompt, prompt[req.reused :]
        req.admitted = True
        if self.experts is not None:
            req.store_at_start = self.experts.counters()
        if req.submit.max_tokens == 0:
            req.finished.set()
            return True
        self.active.append(req)
        self._work.set()
        return True

    def _deactivate(self, req: Request) -> None:
        if req in self.active:
            self.active.remove(req)

    async def _finish(self, req: Request) -> None:
        """Turn end: the decoder's tail, persistence, the telemetry block, DONE."""
        tail = req.decoder.flush().encode()
        if tail:
            await req.emit(Data(req.id, tail))
        await self.persist_slot(req.slot)
        await self.save_usage()  # routing heat, at every turn end (empty for a dense model)
        now = time.perf_counter()
        gen_s = now - req.t_first if req.t_first else 0.0
        tok_s = (req.emitted - 1) / gen_s if req.emitted > 1 and gen_s > 0 else 0.0
        hit_pct, t_edisk, t_emm = 0.0, 0.0, 0.0
        if self.experts is None:
            expert_events, counters = self.expert_telemetry(hits=True), None
        else:
            async with self.step_lock:  # the forward thread changes the store's tiers during a step
                expert_events, counters = self.expert_telemetry(hits=True), self.experts.counters()
        if counters is not None and req.store_at_start is not None:
            # the store serves every slot at once: a turn's figures are the store's over its span
            c0, c1 = req.store_at_start, counters
            uses = (c1.hits - c0.hits) + (c1.misses - c0.misses)
            hit_pct = 100.0 * (c1.hits - c0.hits) / uses if uses else 0.0
            t_edisk, t_emm = c1.t_disk - c0.t_disk, c1.t_compute - c0.t_compute
        await req.emit(telemetry.hwinfo())
        await req.emit(Perf(req.id, now - req.t_start, t_edisk=t_edisk, t_emm=t_emm, t_kvb=req.t_prefill,
                             reused_tokens=req.reused, prefilled_tokens=len(req.prompt) - req.reused))
        await req.emit(Entropy())
        await req.emit(Gpus())
        for event in expert_events:
            await req.emit(event)
        await req.emit(Done(req.id, req.emitted, tok_s, hit_pct, telemetry.rss_gb(), len(req.prompt),
                             req.length_limited))

    def expert_telemetry(self, hits: bool) -> list[object]:
        """TIERS, EMAP and (with ``hits``) HITS, from the expert store; zeros on a dense model."""
        if self.experts is None:
            return [Tiers(0, 0, 0, 0.0, 0.0), ExpertMap(0, 0, b"")] + ([Hits(0, 0, b"")] if hits else [])
        ram, disk, ram_bytes = self.experts.tier_counts()
        rows, cols = self.experts.shape
        events: list[object] = [Tiers(0, ram, disk, 0.0, ram_bytes / telemetry.GB),
                                ExpertMap(rows, cols, self.experts.expert_map())]
        if hits:
            events.append(Hits(rows, cols, self.experts.take_hits()))
        return events

    # ------------------------------------------------------------------ the step loop

    async def run(self) -> None:
        """Forever: wait for work, then run steps while any request is active."""
        while True:
            await self._work.wait()
            self._work = trio.Event()
            while self.active:
                async with self.step_lock:
                    rows = self._plan()
                    t0 = time.perf_counter()
                    sampled = await trio.to_thread.run_sync(self._compute, rows)
                    dt = time.perf_counter() - t0
                    for req, n, _ in rows.shares:
                        fed = req.todo[:n]
                        req.slot.history.extend(fed)
                        del req.todo[:n]
                        if n > 1 or not req.emitted:
                            req.t_prefill += dt
                for (req, _, logit_row), choice in zip(rows.shares, sampled, strict=True):
                    if logit_row is not None and not req.cancelled:
                        await self._accept(req, *choice)
                await trio.sleep(0)  # let CANCEL and new SUBMITs in between steps

    def _plan(self) -> StepRows:
        """Decode rows first (one per request with one token to feed), then at most one prompt
        chunk: serial prefill, one prompt at a time, in the order requests arrived."""
        rows = StepRows()
        decoding = [(r, 1) for r in self.active if len(r.todo) == 1]
        prefill = next((r for r in self.active if len(r.todo) > 1), None)
        chunk = [(prefill, min(self.prefill_chunk, len(prefill.todo)))] if prefill else []
        rows.n_direct = len(decoding)
        for req, n in decoding + chunk:
            start = len(req.slot.history)
            rows.tokens.extend(req.todo[:n])
            rows.slots.extend([req.slot.index] * n)
            rows.positions.extend(range(start, start + n))
            last = len(rows.tokens) - 1 if n == len(req.todo) else None
            rows.shares.append((req, n, last))
        return rows

    def _compute(self, rows: StepRows) -> list[tuple[int, tuple | None] | None]:
        """The forward step and the sampling, in a worker thread."""
        logit_rows = [r for _, _, r in rows.shares if r is not None]
        logits = self.net.forward(
            np.asarray(rows.tokens, np.int64), np.asarray(rows.slots, np.int64),
            np.asarray(rows.positions, np.int64), self.kv, np.asarray(logit_rows, np.int64), rows.n_direct,
        )
        out: list[tuple[int, tuple | None] | None] = []
        i = 0
        for req, n, r in rows.shares:
            if r is None:
                out.append(None)
                continue
            row = logits[i]
            i += 1
            recent = req.slot.history[-64:] + req.todo[:n]
            token = req.sampler(row, recent)
            out.append((token, self._topk(row, token) if self.topk else None))
        return out

    def _topk(self, row: np.ndarray, sampled: int) -> tuple[tuple[float, bytes], ...]:
        """The sampled token first, then the best others: five (logprob, text) in all."""
        best = np.argpartition(-row, TOPK_CANDIDATES)[:TOPK_CANDIDATES]
        best = [int(t) for t in best[np.argsort(-row[best], kind="stable")] if t != sampled]
        peak = float(row.max())
        log_z = peak + math.log(float(np.exp(row - peak, dtype=np.float64).sum()))
        chosen = [sampled, *best[: TOPK_CANDIDATES - 1]]
        return tuple((float(row[t]) - log_z, self.tokenizer.token_bytes(t)) for t in chosen)

    async def _accept(self, req: Request, token: int, topk: tuple | None) -> None:
        """A sampled token: stream it, or end the turn."""
        if not req.t_first:
            req.t_first = time.perf_counter()
        if token in self.stop_ids:
            return self._end(req, limited=False)
        req.emitted += 1
        text = req.decoder.feed(token).encode()
        if text:
            await req.emit(Data(req.id, text))
        if topk is not None:
            await req.emit(TopK(req.id, topk))
        if self.experts is not None and req.emitted % HITS_EVERY_TOKENS == 0:
            rows, cols = self.experts.shape
            await req.emit(Hits(rows, cols, self.experts.take_hits()))
        if req.emitted >= req.submit.max_tokens or len(req.slot.history) >= self.n_ctx:
            return self._end(req, limited=True)
        req.todo = [token]

    def _end(self, req: Request, limited: bool) -> None:
        req.length_limited = limited
        req.todo = []
        self._deactivate(req)
        req.finished.set()


def warn(message: str) -> None:
    print(f"colibri: warning: {message}", file=sys.stderr, flush=True)
