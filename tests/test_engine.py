"""The real ``coli engine`` process with the real default model, over its stdin/stdout."""

from __future__ import annotations

import trio
from engine_harness import EngineProcess, chat_prompt, engine_args

from colibri.io.events import (
    Data,
    Done,
    Error,
    ErrorCode,
    HwInfo,
    Perf,
    Ready,
    Stat,
    Tiers,
    TopK,
)

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "What is 2+2?", "Name a primary color.", "Say hello in Spanish.", "What do bees make?",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "Name a planet in our solar system.", "What is the opposite of hot?", "Spell the word cat.",
    "What color is the sky on a clear day?", "Translate 'thank you' into French.",
    "What animal says moo?", "Give me a synonym for happy.",
]
MAX_TOKENS = 16


async def test_handshake(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None))
    with trio.fail_after(10):
        while len(engine.unsolicited) < 4:
            await trio.sleep(0.01)
    kinds = [type(e) for e in engine.unsolicited[:4]]
    assert kinds == [Ready, Stat, HwInfo, Tiers]  # a dense model: no expert maps
    hw = engine.unsolicited[2]
    assert hw.cores >= 1 and hw.ram_total_gb > 0
    assert await engine.close() == 0


async def run_alone(nursery, questions: list[str]) -> list[bytes]:
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=len(questions)))
    texts = []
    for i, q in enumerate(questions):
        out = await engine.run(i + 1, chat_prompt(q), slot=i, max_tokens=MAX_TOKENS)
        assert isinstance(out.final, Done), out.final
        texts.append(out.text)
    assert await engine.close() == 0
    return texts


async def run_together(nursery, questions: list[str]) -> list[bytes]:
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=len(questions)))
    for i, q in enumerate(questions):
        await engine.submit(i + 1, chat_prompt(q), slot=i, max_tokens=MAX_TOKENS)
    texts = []
    for i in range(len(questions)):
        out = await engine.result(i + 1)
        assert isinstance(out.final, Done), out.final
        texts.append(out.text)
    assert await engine.close() == 0
    return texts


async def test_two_then_sixteen_concurrent_requests_equal_alone(nursery):
    alone = await run_alone(nursery, QUESTIONS)
    assert len(set(alone)) > 8, alone  # the prompts really lead to different answers
    assert await run_together(nursery, QUESTIONS[:2]) == alone[:2]
    assert await run_together(nursery, QUESTIONS) == alone


async def test_cancel_mid_stream(nursery):
    long_q = "Write a long story about a dragon who learns to bake bread."
    alone = await run_alone(nursery, [QUESTIONS[0]])
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=2))
    victim = await engine.submit(1, chat_prompt(long_q), slot=0, max_tokens=400)
    await engine.submit(2, chat_prompt(QUESTIONS[0]), slot=1, max_tokens=MAX_TOKENS)
    with trio.fail_after(120):
        while sum(isinstance(e, Data) for e in victim.events) < 3:
            await trio.sleep(0.01)
    await engine.send(b"CANCEL 1\n")
    out = await engine.result(1)
    assert out.final == Error(1, ErrorCode.CANCELLED)
    assert not any(isinstance(e, Done) for e in out.events)
    other = await engine.result(2)
    assert isinstance(other.final, Done) and other.text == alone[0]
    again = await engine.run(3, chat_prompt(QUESTIONS[1]), slot=0, max_tokens=4)  # the slot is free
    assert isinstance(again.final, Done)
    assert await engine.close() == 0


async def test_cancel_of_unknown_id_is_not_found(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None))
    await engine.send(b"CANCEL 77\n")
    out = await engine.result(77)
    assert out.final == Error(77, ErrorCode.NOT_FOUND)
    assert await engine.close() == 0


def perf_of(out) -> Perf:
    return next(e for e in out.events if isinstance(e, Perf))


async def test_prefix_reuse_across_requests_and_restart(nursery, tmp_path):
    system = "You are a careful assistant. " * 12  # a long shared prefix
    first_prompt = chat_prompt("What is the capital of France?", system)
    engine = await EngineProcess.start(nursery, *engine_args(tmp_path))
    first = await engine.run(1, first_prompt)
    p1 = perf_of(first)
    assert p1.reused_tokens == 0 and p1.prefilled_tokens == first.final.prompt_tokens
    # the head is timed on every step; a dense layer's attention is inside its one compiled call
    assert 0 < p1.t_head < p1.dt and p1.t_attn == 0.0
    # the next turn extends the conversation: everything up to the answer is reused
    turn = "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
    second_prompt = first_prompt + first.text.decode() + turn
    second = await engine.run(2, second_prompt)
    p2 = perf_of(second)
    assert p2.reused_tokens >= p1.prefilled_tokens
    assert p2.reused_tokens + p2.prefilled_tokens == second.final.prompt_tokens
    assert await engine.close() == 0
    assert (tmp_path / ".coli_kv").exists()

    engine = await EngineProcess.start(nursery, *engine_args(tmp_path))
    third = await engine.run(3, chat_prompt("What is the capital of Spain?", system))
    p3 = perf_of(third)
    assert p3.reused_tokens > 60  # the shared system prompt survived the restart
    assert p3.prefilled_tokens < 20
    assert await engine.close() == 0


async def test_eof_drains_in_flight_requests(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=2))
    await engine.submit(1, chat_prompt(QUESTIONS[0]), slot=0)
    await engine.submit(2, chat_prompt(QUESTIONS[1]), slot=1)
    assert await engine.close() == 0  # EOF right after the submits
    assert isinstance(engine.outcomes[1].final, Done) and isinstance(engine.outcomes[2].final, Done)


async def test_sigterm_drains_then_exits(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None))
    out = await engine.submit(1, chat_prompt(QUESTIONS[1]), max_tokens=40)
    with trio.fail_after(120):
        while not out.events:
            await trio.sleep(0.01)
    engine.terminate()
    with trio.fail_after(120):
        assert await engine.proc.wait() == 0
    assert isinstance(out.final, Done)


async def test_topk_lines(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None), env={"SERVE_TOPK": "1"})
    out = await engine.run(1, chat_prompt(QUESTIONS[0]), max_tokens=6)
    topks = [e for e in out.events if isinstance(e, TopK)]
    datas = [e for e in out.events if isinstance(e, Data)]
    assert len(topks) == out.final.emitted and datas
    for t in topks:
        lps = [lp for lp, _ in t.candidates]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True) and lps[0] <= 0
    assert b"".join(t.candidates[0][1] for t in topks) == out.text  # greedy: the best one is emitted
    assert await engine.close() == 0


async def test_a_tokens_lines_come_in_one_write(nursery):
    """DATA and its TOPK leave the engine in one write (one wake-up of the server a token, not two):
    no read of a prompt reader ends between them."""
    engine = await EngineProcess.start(nursery, *engine_args(None), env={"SERVE_TOPK": "1"})
    out = await engine.run(1, chat_prompt(QUESTIONS[1]), max_tokens=40)
    assert out.final.emitted > 10 and len(engine.read_ends) > 10
    assert Data not in engine.read_ends, engine.read_ends
    assert await engine.close() == 0


async def test_every_error_code_and_the_engine_goes_on(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=2, ctx=64))
    p = chat_prompt("hi").encode()
    cases = [
        (b"BOGUS 1 2\n", 0, ErrorCode.BAD_REQUEST),
        (b"SUBMIT 1 0 x 5 0 1\n", 1, ErrorCode.BAD_REQUEST),  # non-numeric byte count
        (b"SUBMIT 2 0 2 5 0 1 0 9 1 9\nhi\n", 0, ErrorCode.BAD_REQUEST),  # wrong field count
        (b"SUBMIT 0 0 2 5 0 1\nhi\n", 0, ErrorCode.BAD_REQUEST),  # id 0
        (b"SUBMIT 3 0 2 5 -1 1\nhi\n", 3, ErrorCode.BAD_REQUEST),  # temperature out of range
        (b"SUBMIT 4 0 2 5 0 1.5\nhi\n", 4, ErrorCode.BAD_REQUEST),  # top_p out of range
        (b"SUBMIT 5 9 2 5 0 1\nhi\n", 5, ErrorCode.BAD_REQUEST),  # slot out of range
        (b"SUBMIT 6 0 2 5 0 1\n\xff\xfe\n", 6, ErrorCode.BAD_REQUEST),  # invalid UTF-8
        (b"SUBMIT 7 0 5 5 0 1\nhi\nCANCEL 8\n", 7, ErrorCode.BAD_FRAME),  # the byte count lies
        (b"SUBMIT 9 0 0 5 0 1\n\n", 9, ErrorCode.EMPTY_PROMPT),
        (b"CANCEL 10\n", 10, ErrorCode.NOT_FOUND),
        (b"SUBMIT 11 0 %d 5 0 1\n%s\n" % (len(p) * 8, p * 8), 11, ErrorCode.CONTEXT_EXCEEDED),
    ]
    for frame, rid, code in cases:
        before = len(engine.errors)
        await engine.send(frame)
        with trio.fail_after(60):
            while len(engine.errors) == before:
                await trio.sleep(0.01)
        assert (engine.errors[before].id, engine.errors[before].code) == (rid, code), frame
    assert engine.outcomes[11].final.args[1] == 64 and engine.outcomes[11].final.args[0] > 64
    # a busy slot and a duplicate id, while request 20 runs in slot 0
    await engine.submit(20, chat_prompt("Write a long story."), slot=0, max_tokens=60)
    await engine.submit(21, chat_prompt("hi"), slot=0)
    assert (await engine.result(21)).final == Error(21, ErrorCode.SLOT_BUSY)
    await engine.submit(20, chat_prompt("hi"), slot=1)
    with trio.fail_after(60):
        while not any(e.code == ErrorCode.DUPLICATE_ID for e in engine.errors):
            await trio.sleep(0.01)
    await engine.send(b"CANCEL 20\n")  # the first request 20 is still the one in flight
    with trio.fail_after(60):
        while Error(20, ErrorCode.CANCELLED) not in engine.errors:
            await trio.sleep(0.01)
    assert not any(isinstance(e, Done) for e in engine.outcomes[20].events)
    ok = await engine.run(22, chat_prompt("What is 2+2?"), slot=1, max_tokens=4)
    assert isinstance(ok.final, Done)  # and after all that, the engine serves
    assert await engine.close() == 0
