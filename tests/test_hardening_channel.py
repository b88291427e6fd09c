"""What a host cannot do to the engine's KV cache or its step loop (issue 38, items 2 and 3): grow a
conversation past ``--ctx`` (an over-long tool result, a turn that runs into the context's end, a
snapshot of either), or hand the sampler a parameter whose arithmetic is not defined (a repetition
penalty of 1e-45, NaN, infinities). Each is refused in its protocol's shape and the engine serves on.

The Channel cases drive the real engine process (``channel_harness.py``) at a small context; the
engine core's own checks (``Engine.check``, a sampler that fails mid-turn) run the real model
in-process; the KV writer's bounds check is called directly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import trio
from channel_harness import ChannelEngine, text_input

from colibri.io import channel_frames as cf
from colibri.io.events import Data, Done, Error, ErrorCode, Submit
from colibri.model.kv_cache import KVCache
from colibri.model.sampling import Sampler, SamplingParams

CTX = 512  # small: a tool result of 100 KB is ~100 times the context
WEATHER = {"name": "get_weather", "description": "Get the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}
# 491 tokens of the default model: a DIRECT input the model continues without ending a turn
COUNTING = ", ".join(str(i) for i in range(1, 121)) + ","


@pytest.fixture(scope="module")
def eng():
    e = ChannelEngine("--ctx", str(CTX))
    yield e
    assert e.close() == 0


def fresh(eng: ChannelEngine, tools: tuple = (), **extra) -> None:
    raw = {"instructions": "Be helpful.", "tools": list(tools), **extra}
    status = eng.until(eng.send(cf.SetSystem("Be helpful.", tools, raw)), cf.Status)
    assert not status.of(cf.Error), status.frames


def context_length(eng: ChannelEngine) -> int:
    """The conversation's length, from the STATUS that answers a SET_CONFIG (the config unchanged)."""
    frames = eng.until(eng.send(cf.SetConfig(temperature=0.0, max_tokens=4096)), cf.Status)
    return frames.of(cf.Status)[-1].total_tok


def alive(eng: ChannelEngine) -> None:
    assert eng.reply(cf.Ping()).message == cf.Pong(), eng.stderr_now()


# ------------------------------------------------------------------------------ the context's end


def test_an_overlong_tool_result_is_refused_and_the_conversation_goes_on(eng, tmp_path):
    """A TOOL_RETURN of 100 KB at --ctx 512 is MALFORMED_PAYLOAD (it grew the context to ~50,000
    tokens, and the next SNAPSHOT_SAVE wrote past the cache: a segfault); the context is as it was,
    the call still waits, a snapshot saves, and a result that fits is taken."""
    fresh(eng, (WEATHER,), tool_choice="required")
    eng.configure(temperature=0.0, max_tokens=60)
    turn = eng.say("What is the weather in Paris?")
    assert turn.complete.stop_reason == cf.StopReason.TOOL_CALL, turn.frames
    [call] = turn.of(cf.ToolCall)
    before = context_length(eng)
    big = eng.reply(cf.ToolReturn(str(call.call_id), False, "x " * 50_000))
    assert isinstance(big.message, cf.Error), big
    assert big.message.code == cf.ErrorCode.MALFORMED_PAYLOAD and "fit" in big.message.detail
    alive(eng)
    assert context_length(eng) == before
    saved = eng.reply(cf.SnapshotSave(str(tmp_path / "after.snap"), "s")).message
    assert saved == cf.SnapshotStatus(int(cf.SnapshotState.SAVED), 1, before, "s"), saved
    eng.configure(temperature=0.0, max_tokens=8)
    follow = eng.turn(cf.ToolReturn(str(call.call_id), False, '{"temperature_c": 21}'))
    assert not follow.of(cf.Error) and follow.complete.tokens > 0
    fresh(eng)
    eng.configure(temperature=0.0, max_tokens=8)
    assert eng.say("Hello!").complete.tokens > 0
    alive(eng)


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_an_input_too_long_by_its_length_is_refused_untokenized(eng):
    """An 8 MiB STREAM_INPUT (and a tool result of as much) at --ctx 512 cannot fit by its length
    alone: refused without being tokenized (it took the engine from ~300 MB to 1.5 GB and stalled
    PING for seconds), the engine's memory about as it was."""
    fresh(eng)
    before = _rss_mb(eng.proc.pid)
    huge = "word " * ((8 << 20) // 5)
    refused = eng.reply(text_input(huge)).message
    assert isinstance(refused, cf.Error) and refused.code == cf.ErrorCode.MALFORMED_PAYLOAD, refused
    assert "at least" in refused.detail and "fit the context" in refused.detail, refused.detail
    alive(eng)
    assert _rss_mb(eng.proc.pid) - before < 200  # the frame and its text, not a tokenization
    eng.configure(temperature=0.0, max_tokens=4)
    assert eng.say("Hello").complete.tokens > 0


def test_a_turn_that_runs_into_the_context_end_stays_inside_it(eng, tmp_path):
    """A turn that ends at the context's end (MAX_TOKENS) leaves at most --ctx tokens (it left one
    more, and a snapshot fed that one at position --ctx: into the next layer's data); the snapshot
    saves and loads back with no more than --ctx tokens, and a further input is refused."""
    fresh(eng)
    eng.configure(temperature=0.0, max_tokens=4096)
    turn = eng.turn(text_input(COUNTING, cf.INPUT_FLAG_DIRECT))
    assert turn.complete.stop_reason == cf.StopReason.MAX_TOKENS, turn.content
    assert turn.of(cf.Status)[-1].total_tok <= CTX
    path = tmp_path / "edge.snap"
    saved = eng.reply(cf.SnapshotSave(str(path), "edge")).message
    assert isinstance(saved, cf.SnapshotStatus), saved
    assert saved.status == cf.SnapshotState.SAVED and 0 < saved.clock <= CTX
    loaded = eng.reply(cf.SnapshotLoad(str(path))).message
    assert loaded == cf.SnapshotStatus(int(cf.SnapshotState.LOADED), 1, saved.clock, "edge"), loaded
    more = eng.reply(text_input("And then?"))
    assert isinstance(more.message, cf.Error) and more.message.code == cf.ErrorCode.MALFORMED_PAYLOAD
    alive(eng)
    fresh(eng)


# ------------------------------------------------------------------------------ sampling parameters


@pytest.mark.parametrize("field, value", [
    ("repeat_penalty", 1e-45), ("repeat_penalty", math.inf), ("repeat_penalty", math.nan),
    ("repeat_penalty", 1e30), ("repeat_penalty", 0.0),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0),
    ("min_p", math.nan), ("min_p", -math.inf), ("min_p", math.inf),
    ("quiescence_threshold", math.nan), ("quiescence_threshold", math.inf),
])
def test_a_sampling_value_without_defined_arithmetic_is_refused(eng, field, value):
    """SET_CONFIG with the value is MALFORMED_PAYLOAD naming the field, the previous config stays
    and a turn runs under it (a repeat_penalty of 1e-45 was taken: its next turn's logits overflowed
    and the engine exited 1)."""
    fresh(eng)
    eng.configure(temperature=0.0, max_tokens=6)
    bad = eng.reply(cf.SetConfig(**{field: value, "max_tokens": 6}))
    assert isinstance(bad.message, cf.Error), bad
    assert bad.message.code == cf.ErrorCode.MALFORMED_PAYLOAD
    assert field.split("_")[0] in bad.message.detail.replace("repetition", "repeat")
    turn = eng.say("What is 2+2?")
    assert not turn.of(cf.Error) and 0 < turn.complete.tokens <= 6
    alive(eng)


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1e-45}, {"repetition_penalty": math.inf}, {"repetition_penalty": 1e30},
    {"repetition_penalty": math.nan}, {"repetition_penalty": 0.0},
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1.0},
    {"top_p": math.nan}, {"top_p": 0.0}, {"top_p": 1.5},
    {"min_p": math.nan}, {"min_p": 2.0},
    {"top_k": math.inf}, {"top_k": math.nan}, {"top_k": -1}, {"top_k": 2.5},
    {"repeat_window": math.inf}, {"repeat_window": math.nan}, {"repeat_window": -1},
    {"seed": -1}, {"seed": 1.5},
])
def test_sampling_params_validate_refuses(params):
    with pytest.raises(ValueError, match=next(iter(params)).split("_")[0]):
        SamplingParams(**params).validate()


def test_the_repetition_penalty_bounds_keep_the_logits_finite():
    """At either bound a logit far past any model's (1e4 either side) stays finite and keeps its
    sign, so the row keeps a finite peak; the bounds themselves are accepted."""
    from colibri.model.sampling import REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN

    logits = np.array([1e4, -1e4, 3.0, -3.0], np.float32)
    for penalty in (REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX):
        SamplingParams(repetition_penalty=penalty).validate()
        token = Sampler(SamplingParams(repetition_penalty=penalty))(logits, [0, 1, 2, 3])
        assert 0 <= token < 4


# ------------------------------------------------------------------------------ the engine core


class NaNLogits:
    """The real model, but its logits NaN while ``broken``: a model whose weights went bad."""

    def __init__(self, model) -> None:
        self.model, self.broken = model, False

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def forward(self, *args, **kwargs):
        logits = self.model.forward(*args, **kwargs)
        if self.broken:
            logits[:] = np.nan
        return logits


async def serve(engine, sub: Submit, nursery) -> list:
    events: list = []
    ended = trio.Event()

    async def emit(event) -> None:
        events.append(event)
        if isinstance(event, Done | Error):
            ended.set()

    error = engine.check(sub)
    if error is not None:
        return [error]
    engine.start(sub, nursery, emit)
    with trio.fail_after(120):
        await ended.wait()
    return events


@pytest.fixture
def core(model):
    from colibri.sched.compute import ComputeThread
    from colibri.sched.engine import Engine
    from colibri.settings import PrefillChunks

    wrapped = NaNLogits(model)
    with ComputeThread() as compute:
        yield Engine(wrapped, 2, 256, None, PrefillChunks(64, 64), compute), wrapped


@pytest.mark.parametrize("temperature, top_p, seed", [
    (math.nan, 1.0, None), (math.inf, 1.0, None), (-1.0, 1.0, None), (0.5, math.nan, None),
    (0.5, 0.0, None), (0.5, 2.0, None), (0.5, 1.0, -1),
])
def test_the_engine_refuses_a_submit_outside_the_sampling_ranges(core, temperature, top_p, seed):
    """Every protocol's SUBMIT passes ``Engine.check``, which holds it to ``SamplingParams.validate``
    (mux and legacy readers refuse non-finite numbers as well; a Submit built in-process did not)."""
    engine, _ = core
    sub = Submit(1, 0, 4, temperature, top_p, "", seed, prompt_ids=(1, 2, 3))
    assert engine.check(sub) == Error(1, ErrorCode.BAD_REQUEST)


async def test_a_sampling_failure_ends_its_request_and_the_engine_serves_on(core, nursery):
    """Logits without a finite peak make the sampler raise: that request ends with ERROR (it left
    the step loop and the engine exited 1), its slot free; the next request is served."""
    engine, wrapped = core
    nursery.start_soon(engine.run)
    prompt = tuple(engine.tokenizer.encode("The capital of France is", special=False))
    wrapped.broken = True
    events = await serve(engine, Submit(1, 0, 8, 0.7, 1.0, "", 5, prompt_ids=prompt), nursery)
    assert events[-1] == Error(1, ErrorCode.BAD_REQUEST), events
    assert not engine.slots[0].owner and not engine.active
    wrapped.broken = False
    events = await serve(engine, Submit(2, 0, 4, 0.0, 1.0, "", None, prompt_ids=prompt), nursery)
    assert isinstance(events[-1], Done) and any(isinstance(e, Data) for e in events), events
    nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------ the KV writer


def test_the_kv_writer_refuses_a_row_outside_the_cache(model):
    """``store_kv`` raises on a position or slot outside the cache (it wrote there: the next layer's
    data, or past the mapping), and ``KVCache.check_rows`` says which row before any kernel runs."""
    from colibri.model.kernels.attention import store_kv
    from colibri.model.kv_cache import KVBoundsError

    hp = model.hp
    kv = KVCache(hp, 2, 16)
    width = hp.n_kv_heads * hp.head_dim
    k = np.ones((1, width), np.float32)
    for slot, position in ((0, 16), (0, -1), (2, 0), (0, 1 << 40)):
        with pytest.raises(IndexError):
            store_kv(k, k, kv.k, kv.v, 0, np.array([slot], np.int64), np.array([position], np.int64),
                     hp.n_kv_heads, hp.head_dim)
        with pytest.raises(KVBoundsError, match="outside"):
            kv.check_rows(np.array([slot]), np.array([position]))
    assert not kv.k.any() and not kv.v.any()  # nothing was written anywhere
    store_kv(k, k, kv.k, kv.v, 0, np.array([1], np.int64), np.array([15], np.int64), hp.n_kv_heads,
             hp.head_dim)
    kv.check_rows(np.array([1]), np.array([15]))
    assert kv.k[1, 0, 15].any()
