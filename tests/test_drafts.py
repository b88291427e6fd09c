"""The NextN pass's bookkeeping (``colibri/sched/drafts.py``), against a model that records what
it is given: which of a step's rows the layer takes (a decoding stream's token and accepted draft
tokens, not the rejected; a prompt chunk's every row), the token after each (the draft's, the one
drawn, the next prompt token), the positions and slots, the decode rows first, and the chained
passes of a draft longer than one token (each feeding the last token drafted and the layer's own
output row). The real layer and engine: tests/test_nextn.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibri.sched.drafts import nextn_pass
from colibri.sched.planner import plan_step
from colibri.sched.speculation import Drafting, Speculation, StepCost

V = 64


@dataclass
class FakeSlot:
    index: int
    history: list[int]


@dataclass
class FakeSubmit:
    max_tokens: int = 100


@dataclass
class FakeRequest:
    slot: FakeSlot
    todo: list[int]
    draft: list[int] = field(default_factory=list)
    emitted: int = 0
    submit: FakeSubmit = field(default_factory=FakeSubmit)
    drafting: Drafting = field(default_factory=lambda: Drafting(None, nextn=True))


class RecordingModel:
    """``hidden[t]`` holds t; the layer's output for a logit row is its hidden row + 1000; each
    logit row's best token is the row's token + 1."""

    def __init__(self, rows: int) -> None:
        self._hidden = np.arange(rows, dtype=np.float32)[:, None].repeat(4, axis=1)
        self.calls: list[tuple[list[int], list[float], list[int], list[int], list[int], int]] = []

    def hidden(self, rows):
        return self._hidden[rows]

    def draft(self, tokens, hidden, slots, positions, kv, logit_rows, n_direct):
        self.calls.append((tokens.tolist(), hidden[:, 0].tolist(), slots.tolist(), positions.tolist(),
                           logit_rows.tolist(), n_direct))
        logits = np.zeros((len(logit_rows), V), np.float32)
        logits[np.arange(len(logit_rows)), tokens[logit_rows] + 1] = 1.0
        return logits, hidden[logit_rows] + 1000.0


class FakeKV:
    n_ctx = 50

    def check_rows(self, slots, positions) -> None:
        assert (np.asarray(positions) < self.n_ctx).all()


def _sure(req: FakeRequest) -> FakeRequest:
    req.drafting.nextn.accepted = 1000.0  # drafts all but certain: as long as the room allows
    return req


def test_the_layer_takes_the_verified_rows_and_the_token_after_each():
    decoding = _sure(FakeRequest(FakeSlot(0, list(range(5))), [10], draft=[11, 12, 13]))
    prompt = _sure(FakeRequest(FakeSlot(1, [1, 2]), [30, 31, 32]))
    plan = plan_step([decoding, prompt], prefill_chunk=8)
    model = RecordingModel(len(plan.tokens))
    # the walk: 11 and 12 accepted, 20 drawn where the draft said 13; the prompt's first token 40
    drawn = [[(11, None), (12, None), (20, None)], [(40, None)]]
    nextn_pass(model, FakeKV(), plan, drawn, Speculation("mtp", 3), StepCost(), stop_ids={2})
    first = model.calls[0]
    assert first == ([11, 12, 20, 31, 32, 40], [0, 1, 2, 4, 5, 6], [0, 0, 0, 1, 1, 1], [5, 6, 7, 2, 3, 4],
                     [2, 5], 3)
    # then one row a stream a pass: the token drafted last, the layer's row, the next position
    assert model.calls[1] == ([21, 41], [1002.0, 1006.0], [0, 1], [8, 5], [0, 1], 2)
    assert model.calls[2] == ([22, 42], [2002.0, 2006.0], [0, 1], [9, 6], [0, 1], 2)
    assert len(model.calls) == 3
    assert decoding.drafting.layer_draft == [21, 22, 23] and prompt.drafting.layer_draft == [41, 42, 43]


def test_mid_prompt_rows_fill_the_layer_and_draft_nothing_and_stops_end_drafts():
    prompt = _sure(FakeRequest(FakeSlot(0, []), [5, 6, 7, 8, 9]))
    plan = plan_step([prompt], prefill_chunk=3)
    model = RecordingModel(len(plan.tokens))
    nextn_pass(model, FakeKV(), plan, [None], Speculation("mtp", 3), StepCost(), stop_ids={2})
    assert model.calls == [([6, 7, 8], [0, 1, 2], [0, 0, 0], [0, 1, 2], [], 0)]
    assert prompt.drafting.layer_draft == []
    # a stream whose drawn token ends its turn: rows for the layer's K/V, no draft
    ending = _sure(FakeRequest(FakeSlot(0, [1, 2, 3]), [4]))
    going = _sure(FakeRequest(FakeSlot(1, [1, 2, 3]), [4]))
    plan = plan_step([ending, going], prefill_chunk=3)
    model = RecordingModel(len(plan.tokens))
    drawn = [[(2, None)], [(0, None)]]
    nextn_pass(model, FakeKV(), plan, drawn, Speculation("mtp", 4), StepCost(), stop_ids={2})
    assert model.calls[0][0] == [2, 0] and model.calls[0][4] == [1]
    # the draft 1, 2: a stop token drafted ends the draft there
    assert going.drafting.layer_draft == [1, 2] and ending.drafting.layer_draft == []


def test_drafts_stay_inside_the_slot_and_the_answers_length():
    near_end = _sure(FakeRequest(FakeSlot(0, list(range(46))), [7]))
    short = _sure(FakeRequest(FakeSlot(1, [1]), [7], submit=FakeSubmit(max_tokens=3), emitted=1))
    plan = plan_step([near_end, short], prefill_chunk=3)
    model = RecordingModel(len(plan.tokens))
    nextn_pass(model, FakeKV(), plan, [[(8, None)], [(8, None)]], Speculation("mtp", 16), StepCost(),
               stop_ids={2})
    # position 46 fed; the next step feeds 47 and may draft 48, 49: two tokens
    assert near_end.drafting.layer_draft == [9, 10]
    assert short.drafting.layer_draft == []  # 2 of 3 tokens emitted: the next step's token is the last


def test_a_paused_stream_runs_no_layer():
    paused = FakeRequest(FakeSlot(0, [1, 2, 3]), [4], emitted=10)
    paused.drafting.nextn.pause(emitted=10)
    plan = plan_step([paused], prefill_chunk=3)
    model = RecordingModel(len(plan.tokens))
    nextn_pass(model, FakeKV(), plan, [[(5, None)]], Speculation("mtp", 4), StepCost(), stop_ids={2})
    assert model.calls == []
