"""Speculative decoding in the real engine on the default model (``coli engine``, mux protocol):
the tokens are plain decoding's, greedy and seeded, at 1 and 16 streams; drafts are made and
accepted (the tests would prove nothing otherwise); a request may turn them off; and nothing
unverified reaches a slot file: a turn's file is byte for byte the one plain decoding writes, and a
kill -9 in the middle of a drafted turn leaves the previous one."""

from __future__ import annotations

import trio
from engine_harness import EngineProcess, Outcome, chat_prompt, engine_args

from colibri.io.events import Data, Done, Perf, Submit
from colibri.io.mux import encode_request
from colibri.sched import persist

FUNCTION = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''
# Copying prompts (where prompt lookup drafts) and open ones (where it rarely can).
PROMPTS = [
    chat_prompt(f"Here is a function:\n\n{FUNCTION}\nRepeat the function exactly, with `merged` renamed "
                "to `result`."),
    chat_prompt("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
                "honeydew, kiwi, lemon, mango, nectarine."),
    chat_prompt("Copy this sentence three times: The quick brown fox jumps over the lazy dog."),
    chat_prompt("Tell me a story about a dragon who learns to cook."),
    chat_prompt("What is the capital of France?"),
    chat_prompt(f"Explain what this code does:\n\n{FUNCTION}"),
    chat_prompt("Write a haiku about autumn leaves."),
    chat_prompt("Count from one to twenty in words, separated by commas."),
]
TOKENS = 48


async def _run_all(engine: EngineProcess, prompts: list[str], first_id: int, at_once: bool,
                   temperature: float = 0.0, speculative: bool | None = None) -> list[Outcome]:
    """Each prompt in its own slot, all submitted together (``at_once``) or one after another."""
    ids = range(first_id, first_id + len(prompts))
    subs = [Submit(rid, i, TOKENS, temperature, 1.0, p, seed=rid if temperature else None,
                   speculative=speculative) for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))]
    if at_once:
        await engine.send(b"".join(encode_request(s) for s in subs))
        return [await engine.result(rid) for rid in ids]
    outs = []
    for s in subs:
        await engine.send(encode_request(s))
        outs.append(await engine.result(s.id))
    return outs


def _perf(out: Outcome) -> Perf:
    assert isinstance(out.final, Done), out.final
    return next(e for e in out.events if isinstance(e, Perf))


async def _texts(mode: str, temperature: float = 0.0) -> tuple[list[bytes], list[bytes], list[Perf]]:
    """Every prompt one at a time, then sixteen at once (the prompts twice over), in a fresh engine."""
    async with trio.open_nursery() as nursery:
        engine = await EngineProcess.start(nursery, *engine_args(None, "--speculative", mode, slots=16,
                                                                 ctx=2048))
        alone = await _run_all(engine, PROMPTS, 1, at_once=False, temperature=temperature)
        batch = await _run_all(engine, PROMPTS * 2, 100, at_once=True, temperature=temperature)
        await engine.close()
    return [o.text for o in alone], [o.text for o in batch], [_perf(o) for o in alone + batch]


async def test_greedy_tokens_are_plain_decodings_alone_and_sixteen_at_once():
    plain_alone, plain_batch, plain_perf = await _texts("off")
    spec_alone, spec_batch, spec_perf = await _texts("ngram")
    assert spec_alone == plain_alone
    assert spec_batch == plain_batch
    assert not any(p.drafted_tokens for p in plain_perf)
    drafted = sum(p.drafted_tokens for p in spec_perf)
    accepted = sum(p.accepted_tokens for p in spec_perf)
    assert 0 < accepted <= drafted
    # the copying prompts draft, and most of what they draft is accepted
    copying = spec_perf[0].accepted_tokens + spec_perf[1].accepted_tokens
    assert copying > TOKENS // 2, [(p.drafted_tokens, p.accepted_tokens) for p in spec_perf]


async def test_seeded_sampling_gives_the_same_tokens_with_drafts():
    plain_alone, _, _ = await _texts("off", temperature=0.8)
    spec_alone, _, spec_perf = await _texts("ngram", temperature=0.8)
    assert spec_alone == plain_alone
    assert sum(p.accepted_tokens for p in spec_perf) > 0


async def test_a_request_turns_drafting_off():
    async with trio.open_nursery() as nursery:
        engine = await EngineProcess.start(nursery, *engine_args(None, slots=2, ctx=2048))  # default: auto
        default = await _run_all(engine, PROMPTS[:1], 1, at_once=False)
        off = await _run_all(engine, PROMPTS[:1], 2, at_once=False, speculative=False)
        await engine.close()
    assert _perf(default[0]).accepted_tokens > 0
    assert _perf(off[0]).drafted_tokens == 0
    assert off[0].text == default[0].text


async def _turns(state_dir, mode: str, kill_in_second: bool) -> None:
    """A copying turn that ends (its slot file written); then, with ``kill_in_second``, another
    drafted turn on the same slot, killed -9 once tokens flow."""
    async with trio.open_nursery() as nursery:
        engine = await EngineProcess.start(nursery, *engine_args(state_dir, "--speculative", mode, ctx=2048))
        first = await engine.run(1, PROMPTS[0], max_tokens=TOKENS)
        assert isinstance(first.final, Done) and first.final.saved
        if kill_in_second:
            out = await engine.submit(2, PROMPTS[1], max_tokens=200)
            with trio.fail_after(120):
                while sum(isinstance(e, Data) for e in out.events) < 20:
                    await trio.sleep(0.005)
            engine.kill()
        else:
            await engine.close()
        nursery.cancel_scope.cancel()


async def test_slot_files_hold_only_verified_tokens_and_a_kill_mid_turn_keeps_the_last(tmp_path):
    plain, spec = tmp_path / "plain", tmp_path / "spec"
    await _turns(plain, "off", kill_in_second=False)
    await _turns(spec, "ngram", kill_in_second=True)
    name = persist.slot_path(plain, 0).name
    assert (spec / name).read_bytes() == (plain / name).read_bytes()
