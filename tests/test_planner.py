"""Step planning on its own (no engine, no trio): decode rows first, then one prompt chunk, in the
order requests arrived, each row at its slot's next position."""

from __future__ import annotations

from dataclasses import dataclass, field

from colibri.sched.planner import plan_step


@dataclass
class FakeSlot:
    index: int
    history: list[int] = field(default_factory=list)


@dataclass
class Feeding:
    slot: FakeSlot
    todo: list[int]
    draft: list[int] = field(default_factory=list)


def test_decode_rows_first_then_one_prompt_chunk():
    prompt_a = Feeding(FakeSlot(0), list(range(100, 110)))
    decode = Feeding(FakeSlot(1, [1, 2, 3]), [7])
    prompt_b = Feeding(FakeSlot(2), [5, 6, 7])
    plan = plan_step([prompt_a, decode, prompt_b], prefill_chunk=4)
    assert plan.n_direct == 1
    assert plan.tokens == [7, 100, 101, 102, 103]
    assert plan.slots == [1, 0, 0, 0, 0]
    assert plan.positions == [3, 0, 1, 2, 3]
    # the decode row samples; the first prompt is mid-way (no logits); the second waits its turn
    assert [(r is decode, n, list(rows)) for r, n, rows in plan.shares] == [(True, 1, [0]), (False, 4, [])]
    assert plan.logit_rows == [0]


def test_a_prompt_alone_takes_the_larger_chunk_and_beside_a_decoding_stream_the_smaller():
    prompt = Feeding(FakeSlot(0), list(range(100, 120)))
    assert plan_step([prompt], prefill_chunk=4, alone_chunk=16).tokens == list(range(100, 116))
    decode = Feeding(FakeSlot(1, [1]), [7])
    plan = plan_step([prompt, decode], prefill_chunk=4, alone_chunk=16)
    assert plan.tokens == [7, 100, 101, 102, 103]  # the decoding stream waits on a small step only
    assert plan_step([prompt], prefill_chunk=4).tokens == [100, 101, 102, 103]  # no alone_chunk: the same


def test_the_last_chunk_of_a_prompt_samples_from_its_last_row():
    req = Feeding(FakeSlot(3, [9] * 8), [1, 2, 3])
    plan = plan_step([req], prefill_chunk=128)
    assert plan.n_direct == 0 and plan.positions == [8, 9, 10]
    assert plan.shares == [(req, 3, range(2, 3))] and plan.logit_rows == [2]


def test_every_decoding_request_gets_a_row_and_nothing_is_planned_for_none():
    reqs = [Feeding(FakeSlot(i, [0] * i), [i]) for i in range(16)]
    plan = plan_step(reqs, prefill_chunk=128)
    assert plan.n_direct == 16 and plan.slots == list(range(16)) and plan.positions == list(range(16))
    assert plan_step([], prefill_chunk=128).tokens == []


def test_a_draft_follows_its_token_as_decode_rows_each_sampled():
    """A draft's tokens are decode rows after the request's token, at the next positions, every one
    with logits (row i verifies draft token i+1); the prompt chunk still comes after every decode row."""
    prompt = Feeding(FakeSlot(0), [5, 6, 7])
    drafting = Feeding(FakeSlot(1, [1, 2, 3]), [7], draft=[8, 9])
    plain = Feeding(FakeSlot(2, [4]), [3])
    plan = plan_step([prompt, drafting, plain], prefill_chunk=128)
    assert plan.n_direct == 4
    assert plan.tokens == [7, 8, 9, 3, 5, 6, 7]
    assert plan.slots == [1, 1, 1, 2, 0, 0, 0]
    assert plan.positions == [3, 4, 5, 1, 0, 1, 2]
    assert [(n, list(rows)) for _, n, rows in plan.shares] == [(3, [0, 1, 2]), (1, [3]), (3, [6])]
    assert plan.logit_rows == [0, 1, 2, 3, 6]
