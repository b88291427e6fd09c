"""The engine: KV slots, requests and the step loop, independent of the wire protocol.

Every active request contributes rows to one forward step (``planner.py``): one row per request
that is decoding (continuous batching: the weights are read once per step for all of them), then
its draft's rows where speculative decoding gave it one (``speculation.py``: verified in the same
step, exactly), and, for at most one request that is prefilling, a chunk of its prompt. The step
runs in a worker thread (the kernels release the GIL), so stdin is read and CANCEL acted on while it computes.

A request's lifetime is its task in the engine's nursery, inside its own cancel scope: CANCEL
cancels the scope; the task then waits out the step in flight, persists the slot and answers
ERROR CANCELLED.

No wire format here: a request's events (``colibri.io.events``, the vocabulary every protocol
shares) go to the ``emit`` its session gave; each session (``mux_session.py``,
``legacy_session.py``, ``channel_session.py``) owns its frames, its writer and its extras, which
work on a slot between steps through ``exclusive``. The model is seen through
``colibri.model.interface.EngineModel`` only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import trio

from colibri.io.events import TOPK_CANDIDATES, Accept, Data, Error, ErrorCode, Hits, Submit, TopK
from colibri.model.grammar import GrammarError, GrammarVocab
from colibri.model.interface import EngineModel
from colibri.model.sampling import Sampler, SamplingParams, top_candidates
from colibri.sched import persist, telemetry
from colibri.sched.compute import ComputeThread
from colibri.sched.drafts import assign_drafts, index_slot, line_joins, nextn_pass
from colibri.sched.planner import Share, StepPlan, plan_step
from colibri.sched.requests import Emit, Request, Slot
from colibri.sched.speculation import NO_SPECULATION, Drafting, Speculation, StepCost, verify
from colibri.settings import PrefillChunks

HITS_EVERY_TOKENS = 6  # the spec's "~every 6 tokens": a live routing picture without flooding the pipe

T = TypeVar("T")
# A sampled token and, with TOPK on, its candidates.
Sampled = tuple[int, tuple[tuple[float, bytes], ...] | None]
# A request's tokens of a step: one, or with a draft those its walk took (every one but the last a
# draft token verified); None for a request mid-prompt; a str: why its sampling failed (the request
# ends with an ERROR, the step's other requests go on).
Choice = list[Sampled] | str | None


class Engine:
    """The slot table and every request's lifecycle over one model; ``run`` is the step loop."""

    def __init__(
        self, model: EngineModel, n_slots: int, n_ctx: int, state_dir: Path | None, prefill: PrefillChunks,
        compute: ComputeThread, topk: bool = False, perf: bool = False,
        speculation: Speculation = NO_SPECULATION,
    ) -> None:
        self.model, self.tokenizer = model, model.tokenizer
        # Where the model loads and computes: one thread (``compute.py``: one OpenMP pool)
        self.run_model = compute.run
        self.n_ctx, self.state_dir = n_ctx, state_dir
        # prompt tokens a step: beside decoding streams, and with none (``settings.prefill_chunks``)
        self.prefill_chunk, self.alone_chunk = prefill
        self.topk, self.perf = topk, perf
        self.speculation, self.step_cost = speculation, StepCost()
        # prompt lookup's soft line breaks in this vocabulary (``lookup.py``)
        self._joins = line_joins(self.tokenizer) if speculation.lookup else None
        self._grammar_vocab: GrammarVocab | None = None  # built on the first grammar
        self.kv = model.new_kv_cache(n_slots, n_ctx)
        self.slots = [Slot(i) for i in range(n_slots)]
        self.requests: dict[int, Request] = {}
        self.active: list[Request] = []
        self.step_lock = trio.Lock()
        self._usage_lock = trio.Lock()
        # One turn's end block at a time: PROF carries no id, it belongs to the DONE after it, so
        # two slots ending together must not interleave their blocks.
        self._turn_end_lock = trio.Lock()
        self._work = trio.Event()
        self.idle = trio.Event()
        self.idle.set()
        self.stop_ids = model.tokenizer.stop_ids
        self.model_fp = model.fingerprint  # the routing heat's
        self.kv_fp = model.kv_fingerprint(n_ctx)  # the slots' and snapshots' K/V
        self.experts = model.experts

    # ------------------------------------------------------------------ state

    def restore(self) -> None:
        """Load every slot's persisted history and K/V (a bad file: one warning, slot cold), and
        pin the experts: the hottest by the persisted heat, or all of them where they fit."""
        heat = None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            persist.remove_stale_temps(self.state_dir)
            for slot in self.slots:
                tokens = persist.load_slot(
                    self.state_dir, slot.index, self.kv_fp,
                    *self.kv.slot(slot.index), self.n_ctx, self.model.hp.n_vocab,
                )
                slot.history = tokens or []
            if self.experts is not None:
                heat = persist.load_usage(self.state_dir, self.model_fp, self.experts.heat.shape)
        if self.experts is not None:
            self.experts.pin_hottest(heat)

    async def persist_slot(self, slot: Slot) -> bool:
        """Write the slot's file; whether it was written (DONE says so: a restart sees the turn only
        then). A failure (disk full, permissions) is a warning, not an error: the previous file
        stays intact and the engine goes on serving from memory. False with no state directory."""
        if self.state_dir is None:
            return False
        history = list(slot.history)
        try:
            await trio.to_thread.run_sync(
                lambda: persist.save_slot(self.state_dir, slot.index, history, *self.kv.slot(slot.index),
                                          self.kv_fp)
            )
        except OSError as e:
            warn(f"slot {slot.index} not persisted: {e}")
            return False
        return True

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

    def check(self, sub: Submit, sampling: SamplingParams | None = None) -> Error | None:
        """The checks a SUBMIT must pass before it gets a task (cheap, on the reader's path), its
        sampling (``sampling``, or the SUBMIT's own fields) held to ``SamplingParams.validate``: the
        one check of every protocol's values, whatever its reader let through."""
        try:
            _sampling(sub, sampling).validate()
        except ValueError as e:
            warn(f"request {sub.id}: {e}")
            return Error(sub.id, ErrorCode.BAD_REQUEST)
        if sub.id in self.requests:
            return Error(sub.id, ErrorCode.DUPLICATE_ID)
        if sub.slot >= len(self.slots):
            return Error(sub.id, ErrorCode.BAD_REQUEST)
        if self.slots[sub.slot].owner is not None:
            return Error(sub.id, ErrorCode.SLOT_BUSY)
        if sub.prompt_ids is not None:
            if any(t >= self.model.hp.n_vocab for t in sub.prompt_ids):
                return Error(sub.id, ErrorCode.BAD_REQUEST)
        elif not sub.prompt:
            return Error(sub.id, ErrorCode.EMPTY_PROMPT)
        return None

    def start(self, sub: Submit, nursery: trio.Nursery, emit: Emit,
              sampling: SamplingParams | None = None) -> Request:
        """Register an accepted SUBMIT and start its task in ``nursery``; its events go to ``emit``."""
        slot = self.slots[sub.slot]
        req = Request(sub.id, slot, sub, Sampler(_sampling(sub, sampling)), emit, self.tokenizer.stream())
        slot.owner = req
        self.requests[sub.id] = req
        self.idle = trio.Event()
        nursery.start_soon(self._serve, req)
        return req

    def stop(self, rid: int) -> bool:
        """STOP: the request ends at the next step boundary with a normal DONE (the host matched a
        stop string). False if no such request is in flight; one already ending ignores it."""
        req = self.requests.get(rid)
        if req is None:
            return False
        req.stop_requested = True
        return True

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
            elif req.failure is not None:
                with trio.CancelScope(shield=True):  # the tokens fed so far are the slot's, as at a DONE
                    await self.persist_slot(req.slot)
                    await req.emit(req.failure)
            elif req.admitted:
                with trio.CancelScope(shield=True):
                    await self._finish(req)
        finally:
            req.slot.owner = None
            self.requests.pop(req.id, None)
            if not self.requests:
                self.idle.set()

    async def _admit(self, req: Request) -> bool:
        """Tokenize (off the event loop: a prompt may be megabytes), check, reuse the slot's prefix.
        A SUBMIT's text is the host's rendered prompt: its control-token text is parsed (the host
        owns the template); the HTTP server sends SUBMIT_IDS, tokenized by the trust rule."""
        if req.submit.prompt_ids is not None:
            prompt = list(req.submit.prompt_ids)
        else:
            prompt = await trio.to_thread.run_sync(self.tokenizer.encode, req.submit.prompt, True)
        if not prompt:
            await req.emit(Error(req.id, ErrorCode.EMPTY_PROMPT))
            return False
        if len(prompt) > self.n_ctx:
            await req.emit(Error(req.id, ErrorCode.CONTEXT_EXCEEDED, (len(prompt), self.n_ctx)))
            return False
        if req.submit.grammar is not None and not await self._constrain(req):
            return False
        await req.emit(Accept(req.id, len(prompt)))
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
        if req.submit.max_tokens == 0 or req.stop_requested:
            req.finished.set()
            return True
        spec = self.speculation
        if spec.on and req.submit.speculative is not False and req.constraint is None:
            lookup = None
            if spec.lookup:
                lookup = await trio.to_thread.run_sync(index_slot, req.slot, prompt, self._joins)
            req.drafting = Drafting(lookup, spec.nextn, spec.draft_min)
        self.active.append(req)
        self._work.set()
        return True

    async def _constrain(self, req: Request) -> bool:
        """The request's grammar, compiled off the event loop (a big schema takes milliseconds);
        one that does not compile is a BAD_REQUEST (the reason goes to stderr: ERROR has no text)."""
        def build():
            if self._grammar_vocab is None:
                tok = self.tokenizer
                self._grammar_vocab = GrammarVocab(tok.to_json(), self.model.hp.n_vocab, self.stop_ids)
            return self._grammar_vocab.constraint(req.submit.grammar)

        try:
            req.constraint = await trio.to_thread.run_sync(build)
        except GrammarError as e:
            warn(f"request {req.id}: {e}")
            await req.emit(Error(req.id, ErrorCode.BAD_REQUEST))
            return False
        return True

    def _deactivate(self, req: Request) -> None:
        if req in self.active:
            self.active.remove(req)

    async def _finish(self, req: Request) -> None:
        """Turn end: the detokenizer's tail, persistence, the telemetry block, DONE (which says
        whether the slot was saved)."""
        tail = req.detokenizer.flush().encode()
        if tail:
            await req.emit(Data(req.id, tail))
        saved = await self.persist_slot(req.slot)
        await self.save_usage()  # routing heat, at every turn end (empty for a dense model)
        if self.experts is None:
            maps, counters = telemetry.expert_events(None, hits=True), None
        else:
            async with self.step_lock:  # the forward thread changes the store's tiers during a step
                maps, counters = telemetry.expert_events(self.experts, hits=True), self.experts.counters()
        async with self._turn_end_lock:
            for event in telemetry.turn_end_events(req, counters, maps, saved, perf=self.perf):
                await req.emit(event)

    # ------------------------------------------------------------------ outside any request

    def busy(self, slot: int) -> bool:
        return self.slots[slot].owner is not None

    def forget(self, slot: int) -> None:
        """An idle slot's next request reuses none of its history (another client's conversation)."""
        assert not self.busy(slot), "forget a busy slot"
        self.slots[slot].history.clear()
        self.slots[slot].drafter = None

    async def exclusive(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the compute thread between steps: a session's work on a slot outside
        any request (the Channel's probes, soft inputs, snapshots) sees no step half done."""
        async with self.step_lock:
            return await self.run_model(fn, *args)

    def expert_telemetry(self, hits: bool) -> list[object]:
        """TIERS, EMAP and (with ``hits``) HITS: at start, and at every turn end."""
        return telemetry.expert_events(self.experts, hits)

    # ------------------------------------------------------------------ the step loop

    async def run(self) -> None:
        """Forever: wait for work, then run steps while any request is active."""
        while True:
            await self._work.wait()
            self._work = trio.Event()
            while self.active:
                async with self.step_lock:
                    assign_drafts(self.active, self.speculation, self.step_cost, self.n_ctx, self.stop_ids)
                    plan = plan_step(self.active, self.prefill_chunk, self.alone_chunk)
                    t0 = time.perf_counter()
                    sampled = await self.run_model(self._compute, plan)
                    self._advance(plan, time.perf_counter() - t0)
                for (req, _, logit_rows), choice in zip(plan.shares, sampled, strict=True):
                    if not logit_rows or req.cancelled or req.finished.is_set():
                        continue
                    if isinstance(choice, str):
                        self._fail(req, choice)
                    else:
                        await self._accept_walk(req, choice)
                for req in [r for r in self.active if r.stop_requested]:
                    self._end(req, limited=False)  # STOP: mid-prompt, or between tokens
                await trio.sleep(0)  # let CANCEL, STOP and new SUBMITs in between steps

    def _advance(self, plan: StepPlan, seconds: float) -> None:
        """The step's rows are in the KV cache now: each request's todo moves to its slot's history
        (a draft's verified tokens follow as its walk takes them). A step's seconds count for every
        request in it (they shared it); a decode step's, for the cost of its rows."""
        if plan.n_direct == len(plan.tokens):
            self.step_cost.observe(len(plan.tokens), seconds)
        parts = self.model.step_times
        for req, n, _ in plan.shares:
            req.slot.history.extend(req.todo[:n])
            del req.todo[:n]
            req.forwards += 1
            req.t_attn += parts.attn
            req.t_head += parts.head
            if n - len(req.draft) > 1 or not req.emitted:  # a prompt's step, not a draft's
                req.t_prefill += seconds

    def _compute(self, plan: StepPlan) -> list[Choice]:
        """The forward step and the sampling, in a worker thread. The rows are inside the cache by
        construction (a prompt fits ``n_ctx``, a turn ends when its slot is full); checked here all
        the same, as every caller of the forward pass does, so a bug is an error and not a write
        into another layer's K/V."""
        slots, positions = np.asarray(plan.slots, np.int64), np.asarray(plan.positions, np.int64)
        self.kv.check_rows(slots, positions)
        logits = self.model.forward(
            np.asarray(plan.tokens, np.int64), slots, positions, self.kv,
            np.asarray(plan.logit_rows, np.int64), plan.n_direct,
        )
        out: list[Choice] = []
        i = 0
        for share in plan.shares:
            rows = logits[i : i + len(share.logit_rows)]
            i += len(share.logit_rows)
            out.append(self._walk(share, rows) if len(rows) else None)
        if self.speculation.nextn:  # the model's draft layer, over the rows this step verified
            try:
                nextn_pass(self.model, self.kv, plan, out, self.speculation, self.step_cost, self.stop_ids)
            except Exception as e:  # noqa: BLE001 (drafts are optional: the step's tokens stand)
                warn(f"NextN drafts skipped this step: {type(e).__name__}: {e}")
        return out

    def _walk(self, share: Share, rows: np.ndarray) -> Choice:
        """A request's tokens from its rows: the first row's, then, while the token drawn equals the
        draft's next, the next row's (``speculation.verify``: the rejection rule, exact)."""
        req, n, _ = share
        window = req.sampler.params.repeat_window
        fed = req.todo[: n - len(req.draft)] + req.draft  # the tokens of the request's rows, in order
        recent = req.slot.history[-window:] if window else []
        first = n - len(rows)  # the fed token before the first sampled row
        drawn: list[Sampled] = []

        def draw(j: int) -> int:
            row, context = rows[j], recent + fed[: first + j + 1]
            token = self._sample(req, row, context) if req.constraint else req.sampler(row, context)
            drawn.append((token, self._topk(row, token) if self.topk else None))
            return token

        try:
            verify(req.draft, draw, self.stop_ids)
        except ValueError as e:  # logits with no finite peak (a model gone bad): this request only
            # the tokens before the row are emitted, as plain decoding would; it fails on that
            # row at the next step, whose logits are these
            return drawn or str(e)
        return drawn

    def _sample(self, req: Request, row: np.ndarray, recent: list[int]) -> int:
        """A token the request's grammar allows (its row is masked in place: TOPK then shows the
        candidates the grammar left). A grammar that allows nothing (in error) ends the turn."""
        row[:] = req.constraint.mask(row)
        if not np.isfinite(row).any():
            return min(self.stop_ids)
        token = req.sampler(row, recent)
        if not req.constraint.advance(token):
            return min(self.stop_ids)
        return token

    def _topk(self, row: np.ndarray, sampled: int) -> tuple[tuple[float, bytes], ...]:
        """TOPK's candidates: the sampled token first, then the best others, with their text (not
        the tokens a grammar ruled out: their logprob is -inf)."""
        best = top_candidates(row, sampled, TOPK_CANDIDATES)
        return tuple((lp, self.tokenizer.token_bytes(t)) for t, lp in best if t == sampled or lp > -np.inf)

    async def _accept_walk(self, req: Request, picked: list[Sampled]) -> None:
        """A step's tokens for the request, in order: each but the first follows a draft token
        verified by the one before it, whose K/V the step wrote: it joins the history then."""
        draft, req.draft = req.draft, []
        for j, (token, topk) in enumerate(picked):
            if req.finished.is_set() or req.scope.cancel_called:  # a CANCEL during an emit: the
                break  # request's task owns the slot now (it persists it, then frees it)
            if j:
                req.slot.history.append(draft[j - 1])
                req.todo = []
            await self._accept(req, token, topk)
        if req.drafting is not None:  # (a step without a draft: the NextN layer's tokens are scored)
            accepted = sum(1 for (t, _), d in zip(picked, draft, strict=False) if t == d)
            req.drafting.record(len(draft), accepted, req.emitted, [t for t, _ in picked])

    async def _accept(self, req: Request, token: int, topk: tuple | None) -> None:
        """A sampled token: stream it, or end the turn."""
        if not req.t_first:
            req.t_first = time.perf_counter()
        if token in self.stop_ids:
            return self._end(req, limited=False)
        req.emitted += 1
        if req.drafting is not None:
            req.drafting.extend((token,))
        # every token, even one whose text is not yet a whole character: a session whose wire
        # carries token ids (Channel) sees them all; the text sessions skip the empty ones
        await req.emit(Data(req.id, req.detokenizer.feed(token).encode(), token))
        if topk is not None:
            await req.emit(TopK(req.id, topk))
        if self.experts is not None and req.emitted % HITS_EVERY_TOKENS == 0:
            rows, cols = self.experts.shape
            hits = self.experts.take_hits()
            if any(hits):  # none since the last: a drafted step's tokens, or a stream beside, took them
                await req.emit(Hits(rows, cols, hits))
        if req.emitted >= req.submit.max_tokens or len(req.slot.history) >= self.n_ctx:
            return self._end(req, limited=True)
        if req.stop_requested or (req.constraint is not None and req.constraint.finished):
            return self._end(req, limited=False)
        req.todo = [token]

    def _fail(self, req: Request, reason: str) -> None:
        """The request's sampling failed: it ends with ERROR BAD_REQUEST (the protocols' codes have no
        other for it), the reason on stderr; the engine and the step's other requests go on."""
        warn(f"request {req.id}: sampling failed: {reason}")
        req.failure = Error(req.id, ErrorCode.BAD_REQUEST)
        self._end(req, limited=False)

    def _end(self, req: Request, limited: bool) -> None:
        req.length_limited = limited
        req.todo = []
        self._deactivate(req)
        req.finished.set()


def _sampling(sub: Submit, sampling: SamplingParams | None) -> SamplingParams:
    """A request's sampling: its session's (the Channel's SET_CONFIG), or the SUBMIT's fields."""
    return sampling or SamplingParams(temperature=sub.temperature, top_p=sub.top_p, seed=sub.seed)


def warn(message: str) -> None:
    print(f"colibri: warning: {message}", file=sys.stderr, flush=True)
