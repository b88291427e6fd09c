"""``coli engine`` as a drop-in for colibri's own Python gateway (``openai_server.py``).

The gateway reads lines with a strict dispatcher: after READY and a STAT of at least five fields it
accepts DATA, ACCEPT, DONE, HWINFO, EMAP and HITS of exactly four fields, PROF of at least ten,
TIERS and ERROR, and fails every later request on anything else. It opens its streaming response
on ACCEPT, sends STOP when a stop string matched, and a grammar as the SUBMIT's seventh field (the
byte length of an extra payload after the prompt). ``GatewayView`` below reads the engine's stdout
exactly so, from raw bytes, with none of our codec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import trio
from engine_harness import STARTUP_TIMEOUT, chat_prompt, engine_args

from colibri.model.json_grammar import json_grammar

MAX_WAIT = 300
# Each kind the gateway knows, and the field counts (with the verb) it accepts.
KINDS = {
    "ACCEPT": lambda n: n == 3,
    "DONE": lambda n: n >= 8,
    "HWINFO": lambda n: n >= 7,
    "EMAP": lambda n: n == 4,
    "HITS": lambda n: n == 4,
    "PROF": lambda n: n >= 10,
    "TIERS": lambda n: n == 6,
    "ERROR": lambda n: n >= 3,
}


@dataclass
class Turn:
    lines: list[list[str]] = field(default_factory=list)  # this request's lines, split
    text: bytes = b""
    data_lines: int = 0
    done: trio.Event = field(default_factory=trio.Event)


class GatewayView:
    """The engine's stdout as the gateway's dispatcher sees it; any line it would refuse fails."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.buf = b""
        self.turns: dict[int, Turn] = {}
        self.order: list[str] = []  # every line's kind, in order
        self.handshake: list[bytes] = []
        self.ready = trio.Event()

    async def _line(self) -> bytes | None:
        while b"\n" not in self.buf:
            chunk = await self.proc.stdout.receive_some(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    async def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n + 1:
            self.buf += await self.proc.stdout.receive_some(1 << 16)
        data, self.buf = self.buf[:n], self.buf[n + 1 :]
        return data

    async def read(self) -> None:
        while len(self.handshake) < 2:
            self.handshake.append(await self._line())
        self.ready.set()
        while (line := await self._line()) is not None:
            fields = line.decode().split(" ")
            kind = fields[0]
            self.order.append(kind)
            if kind == "DATA":
                assert len(fields) == 3, line
                turn = self.turns.setdefault(int(fields[1]), Turn())
                turn.text += await self._exactly(int(fields[2]))
                turn.data_lines += 1
                turn.lines.append(fields)
                continue
            assert kind in KINDS and KINDS[kind](len(fields)), f"the gateway refuses {line!r}"
            if kind in ("ACCEPT", "DONE", "PROF", "ERROR"):
                turn = self.turns.setdefault(int(fields[1]), Turn())
                turn.lines.append(fields)
                if kind in ("DONE", "ERROR"):
                    turn.done.set()

    async def send(self, data: bytes) -> None:
        await self.proc.stdin.send_all(data)

    async def submit(self, rid: int, prompt: str, max_tokens: int, grammar: str = "",
                     temperature: float = 0.0, seed: int | None = None) -> Turn:
        """The gateway's SUBMIT: six fields, a seventh with a grammar after the prompt, an eighth
        with a seed."""
        p, g = prompt.encode(), grammar.encode()
        extra = f" {len(g)}" if g or seed is not None else ""
        extra += f" {seed}" if seed is not None else ""
        head = f"SUBMIT {rid} 0 {len(p)} {max_tokens} {temperature} 1.0{extra}\n".encode()
        turn = self.turns.setdefault(rid, Turn())
        await self.send(head + p + g + b"\n")
        return turn

    async def finished(self, rid: int) -> Turn:
        with trio.fail_after(MAX_WAIT):
            await self.turns[rid].done.wait()
        return self.turns[rid]


async def start(nursery: trio.Nursery, env: dict[str, str] | None = None) -> GatewayView:
    cmd = [sys.executable, "-m", "colibri", "engine", *engine_args(None)]
    proc = await trio.lowlevel.open_process(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "SERVE_PERF": "0", "SERVE_TOPK": "0", **(env or {})},
    )
    view = GatewayView(proc)
    nursery.start_soon(view.read)
    with trio.fail_after(STARTUP_TIMEOUT):
        await view.ready.wait()
    return view


def kinds(turn: Turn) -> list[str]:
    return [f[0] for f in turn.lines]


async def test_a_turn_as_the_gateway_reads_it(nursery):
    view = await start(nursery)
    assert view.handshake[0] == b"\x01\x01READY\x01\x01"
    assert view.handshake[1].startswith(b"STAT ") and len(view.handshake[1].split(b" ")) >= 5
    await view.submit(1, chat_prompt("Name a colour."), 12)
    turn = await view.finished(1)
    seen = kinds(turn)
    assert seen[0] == "ACCEPT" and seen.index("ACCEPT") < seen.index("DATA")
    accept = turn.lines[0]
    assert int(accept[2]) > 5  # the prompt's tokens
    assert seen[-1] == "DONE" and "PROF" in seen
    prof = next(f for f in turn.lines if f[0] == "PROF")
    done = turn.lines[-1]
    # PROF <id> <wall> <prompt> <completion> <edisk> <ewait> <emm> <attn> <head> <forwards>
    assert int(prof[3]) == int(accept[2]) and int(prof[4]) == int(done[3]) and int(prof[10]) >= 1
    # the gateway's dispatcher accepted every line; nothing of the spec's optional telemetry came
    assert not {"PERF", "ENTROPY", "GPUS", "TOPK", "EMAP", "HITS"} & set(view.order)
    await view.proc.stdin.aclose()


async def test_stop_ends_the_request_with_done_within_a_step(nursery):
    view = await start(nursery)
    await view.submit(2, chat_prompt("Write a long story about a lighthouse keeper."), 400)
    turn = view.turns[2]
    with trio.fail_after(MAX_WAIT):
        while turn.data_lines < 3:
            await trio.sleep(0.005)
    at_stop = turn.data_lines
    await view.send(b"STOP 2\n")
    turn = await view.finished(2)
    done = turn.lines[-1]
    assert done[0] == "DONE"
    emitted = int(done[3])
    # the step in flight when STOP arrived may still deliver its token; ``at_stop`` counts the lines
    # this reader had read, which on two busy cores may trail what the engine had written by a few
    # steps: the bound allows that lag, and ``done[8]`` below says the host ended it
    assert at_stop <= emitted <= at_stop + 16 < 400
    assert done[8] == "0"  # ended by the host: not length-limited
    # the engine goes on serving
    await view.submit(3, chat_prompt("Say hi."), 4)
    assert (await view.finished(3)).lines[-1][0] == "DONE"
    await view.proc.stdin.aclose()


@pytest.mark.parametrize(("grammar", "check"), [
    ('root ::= "yes" | "no"', lambda text: text in ("yes", "no")),
    # bounded: an unbounded [0-9]+ sampled at temperature 1 may run to max_tokens in digits
    ('root ::= [0-9] [0-9]? [0-9]? "." [0-9]',
     lambda text: text.count(".") == 1 and text.replace(".", "").isdigit() and len(text) <= 5),
    # as every front end builds it (json_grammar): whitespace fixed; left free, a small model at
    # temperature 1 may ramble in newlines until max_tokens and stop mid-object
    (json_grammar({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}),
     lambda text: set(json.loads(text)) == {"city"}),
])
async def test_a_grammar_in_the_extra_payload_constrains_the_output(nursery, grammar, check):
    view = await start(nursery)
    for rid in range(1, 6):  # sampled at temperature 1: every output keeps to the grammar
        # seeded: a string bound counts characters, not tokens (a rare run of multi-token
        # characters could reach max_tokens and cut the output)
        await view.submit(rid, chat_prompt("Is Paris in France? Answer."), 48, grammar, temperature=1.0,
                          seed=rid)
        turn = await view.finished(rid)
        assert turn.lines[-1][0] == "DONE", turn.lines[-1]
        assert check(turn.text.decode()), turn.text
    await view.proc.stdin.aclose()


async def test_a_bad_grammar_is_refused_and_the_engine_goes_on(nursery):
    view = await start(nursery)
    await view.submit(1, chat_prompt("Hi"), 4, grammar="root ::= undefined_rule")
    turn = await view.finished(1)
    assert turn.lines == [["ERROR", "1", "BAD_REQUEST"]]
    await view.submit(2, chat_prompt("Hi"), 4)
    assert (await view.finished(2)).lines[-1][0] == "DONE"
    await view.proc.stdin.aclose()


async def test_serve_perf_asks_for_the_specs_telemetry(nursery):
    view = await start(nursery, {"SERVE_PERF": "1"})
    KINDS.update(PERF=lambda n: n >= 8, ENTROPY=lambda n: n >= 1, GPUS=lambda n: n >= 2)
    try:
        await view.submit(1, chat_prompt("Hi"), 4)
        await view.finished(1)
        assert {"PERF", "ENTROPY", "GPUS"} <= set(view.order)
    finally:
        for k in ("PERF", "ENTROPY", "GPUS"):
            KINDS.pop(k)
    await view.proc.stdin.aclose()
