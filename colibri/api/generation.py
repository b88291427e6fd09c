"""One request's generation on a KV slot it holds, with no HTTP in it.

The engine streams DATA (text) and TOPK (the token's candidates) events; a ``GenerationRun`` turns
them into ``Piece``s: the text a client may see now, with stop strings applied, and the logprobs
of the tokens that made that text. At the end it knows the finish reason, the usage and the
engine's stats. Leaving early (a client gone, a stop string) cancels the request in the engine
and waits until the engine has let go of the slot. How a piece looks on the wire is the endpoint's
shaper's business (``serving``); failures are ``GenerationFailed``, mapped to HTTP by the caller.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from colibri.api.engine_client import EngineClient, EngineDied, Ticket
from colibri.api.metrics import ServerMetrics
from colibri.api.openai_requests import Generation
from colibri.api.reasoning import ReasoningSplit
from colibri.api.stop import StopMatcher
from colibri.io.events import Data, Done, Error, ErrorCode, Perf, TopK
from colibri.model.harmony import HarmonySplit


class GenerationFailed(Exception):
    """The request ended without an answer."""


class ContextExceeded(GenerationFailed):
    """The prompt does not fit the context: the client's fault (a 400), not the server's."""

    def __init__(self, used: int, limit: int) -> None:
        super().__init__(f"{used} tokens in a context of {limit}")
        self.used, self.limit = used, limit


class EngineRefused(GenerationFailed):
    def __init__(self, code: ErrorCode) -> None:
        super().__init__(code)
        self.code = code


class EngineStopped(GenerationFailed):
    """The engine process ended while the request was in flight (the server restarts it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class TokenLogprob:
    text: bytes
    logprob: float
    top: list[tuple[bytes, float]]  # the candidates, most likely first


@dataclass
class Piece:
    """Text to send now, and the tokens whose text it is (so a chunk's logprobs match its text):
    the answer's text, and a thinking model's reasoning before it (``reasoning.py``)."""

    text: str
    tokens: list[TokenLogprob]
    reasoning: str = ""


class GenerationRun:
    """Engine events -> pieces, then the finish reason, usage and stats of what was generated.

    ``counters`` are the server's /health counts: a request the engine fails is counted here, where
    the failure is seen; the caller counts completions and cancellations.
    """

    def __init__(
        self,
        engine: EngineClient,
        gen: Generation,
        slot: int,
        *,
        forget: bool = False,
        metrics: ServerMetrics,
        counters: dict[str, int],
        count_tokens: Callable[[str], int],
    ) -> None:
        self.engine, self.gen, self.slot, self.forget = engine, gen, slot, forget
        self.metrics, self.counters, self.count_tokens = metrics, counters, count_tokens
        self.stops = StopMatcher(gen.stops)
        # A thinking model's reply, split after the stop strings (they apply to the whole text).
        self.split = (HarmonySplit() if gen.harmony else ReasoningSplit(gen.reasoning_open) if gen.reasoning
                      else None)
        self.tokens: list[TokenLogprob] = []
        self.done: Done | None = None
        self.perf: Perf | None = None
        self.finish = "length"
        self._start: float = 0.0  # for the latency metrics
        self._last: float | None = None

    async def pieces(self) -> AsyncIterator[Piece]:
        """The text as it becomes safe to send; sets ``finish``, ``done`` and ``perf`` by the end."""
        g = self.gen
        self._start, self._last = time.perf_counter(), None
        pending: list[TokenLogprob] = []
        held: tuple[str, bool] | None = None  # a DATA's text and stop hit, until its TOPK (which follows)
        prompt = g.prompt_ids or g.prompt
        ticket = Ticket()
        stream = self.engine.generate(prompt, self.slot, g.max_tokens, g.temperature, g.top_p, g.seed,
                                      grammar=g.grammar, ticket=ticket, forget=self.forget,
                                      speculative=g.speculative)
        try:
            async for event in stream:
                if isinstance(event, TopK):
                    pending.append(self._token(event.candidates))
                if held is not None:  # the text goes out with the logprobs of the tokens that made it
                    (out, hit), held = held, None
                    yield self._piece(out, pending)
                    pending = []
                    if hit:  # the turn's last events, then the reply's held end, as at any end
                        await self._stop(stream, ticket)
                        break
                if isinstance(event, Data):
                    held = self.stops.feed(event.text.decode("utf-8", errors="replace"))
                else:
                    self._note(event)
        except EngineDied as e:
            self.counters["failed"] += 1
            raise EngineStopped(str(e)) from None
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()  # left early: CANCEL, and wait until the engine frees the slot
        out = held[0] if held is not None else ""
        tail = self.stops.flush()
        if self.stops.stopped:
            self.finish = "stop"
        last = self._piece(out + tail, pending)
        if self.split is not None:
            reasoning, text = self.split.flush()
            last = Piece(last.text + text, last.tokens, last.reasoning + reasoning)
        if last.text or last.reasoning or last.tokens:
            yield last

    def _piece(self, text: str, tokens: list[TokenLogprob]) -> Piece:
        """A piece of the reply: its answer and its reasoning, for a thinking model."""
        if self.split is None:
            return Piece(text, tokens)
        reasoning, answer = self.split.feed(text, len(tokens))
        return Piece(answer, tokens, reasoning)

    @property
    def reasoning_tokens(self) -> int:
        """The reply's tokens of its reasoning block (0: none, or not a thinking model)."""
        return self.split.reasoning_tokens if self.split is not None else 0

    @property
    def has_reasoning(self) -> bool:
        return self.split is not None and self.split.opened

    async def _stop(self, stream: AsyncIterator[object], ticket: Ticket) -> None:
        """A stop string matched: STOP, then the turn's last events until its DONE (its stats)."""
        await self.engine.stop(ticket.id)
        async for event in stream:
            if not isinstance(event, Data | TopK):
                self._note(event)
        self.finish = "stop"

    def _note(self, event: object) -> None:
        match event:
            case TopK():
                now = time.perf_counter()
                if self._last is None:
                    self.metrics.time_to_first_token.observe(now - self._start)
                else:
                    self.metrics.token_latency.observe(now - self._last)
                self._last = now
            case Perf():
                self.perf = event
            case Done():
                self.done = event
                self.finish = "length" if event.length_limited else "stop"
            case Error(code=code, args=args):
                if code == ErrorCode.CONTEXT_EXCEEDED:
                    raise ContextExceeded(args[0], args[1])
                self.counters["failed"] += 1
                raise EngineRefused(code)

    def _token(self, candidates: tuple[tuple[float, bytes], ...]) -> TokenLogprob:
        """TOPK lists the sampled token first, then the others: logprobs want them best first."""
        (lp, text), top = candidates[0], sorted(candidates, key=lambda c: -c[0])
        token = TokenLogprob(text, lp, [(t, p) for p, t in top])
        self.tokens.append(token)
        return token

    def record_usage(self) -> tuple[int, int]:
        """(prompt, completion) tokens, counted into the metrics: call it once, at the end."""
        counted = len(self.gen.prompt_ids) or self.count_tokens(self.gen.prompt)
        prompt = self.done.prompt_tokens if self.done else counted
        completion = len(self.tokens) if self.tokens or not self.done else self.done.emitted
        self.metrics.tokens.inc(prompt, kind="prompt")
        self.metrics.tokens.inc(completion, kind="completion")
        if self.perf is not None:
            self.metrics.reused_tokens.inc(self.perf.reused_tokens)
            self.metrics.drafted_tokens.inc(self.perf.drafted_tokens)
            self.metrics.accepted_tokens.inc(self.perf.accepted_tokens)
        return prompt, completion

    def stats(self) -> dict[str, Any]:
        """The ``colibri`` block of the answer: the slot, the prompt tokens its KV already held (null:
        the engine did not say), and the engine's figures for the turn."""
        d, p = self.done, self.perf
        out: dict[str, Any] = {"slot": self.slot, "reused_tokens": p.reused_tokens if p else None}
        if d:
            out["stats"] = {
                "emitted": d.emitted,
                "tok_s": d.tok_s,
                "hit_pct": d.hit_pct,
                "rss_gb": d.rss_gb,
                "prompt_tokens": d.prompt_tokens,
                "length_limited": d.length_limited,
                "saved": d.saved,  # the slot file was written; null: the engine did not say
            }
        if p:
            out["perf"] = {k: v for k, v in p.__dict__.items() if k != "id"}
        return out
