"""``coli engine`` as a drop-in for colibri's own Python gateway (``openai_server.py``).

The gateway (colibri's public ``c/openai_server.py``) starts its engine as ``<engine> <cap>`` with
``SNAP`` (the model), ``SERVE=1``, ``SERVE_BATCH=1``, ``NGEN`` and ``KV_SLOTS`` in the environment,
then reads its stdout with a strict dispatcher. Its rules, restated here from its source (commit
99625c7e; its code stays out of this repository):

- Startup: everything up to the READY sentinel line is skipped; the next line must be ``STAT`` with
  at least five fields: an int, three floats, then an optional int and an optional 0/1.
- Each later line is stripped and split on whitespace; a blank line is skipped. The kind is the
  first field; the count below includes it, and each typed field is read by ``int`` or ``float``:
  - ``DATA <id> <n>``: exactly 3; ``n`` an int from 0 to 65536, then ``n`` bytes and ``\\n``;
  - ``ACCEPT <id> <int>``: at least 3;
  - ``DONE <id> STAT <int> <float> <float> <float> [<int> [<int>]] ...``: at least 7, the third
    field ``STAT``; anything after the eighth typed field is ignored (our ``saved``);
  - ``HWINFO <int> <float> <float> <int> <float> <text>...``: at least 7;
  - ``EMAP <int> <int> <map>`` and ``HITS <a> <b> <map>``: exactly 4 (an empty map is 3: refused);
  - ``PROF <float> <int> <int> <float>x5 <int>``: at least 10, no request id;
  - ``TIERS <int> <int> <int> <float> <float>``: at least 6;
  - ``ERROR <id> ...``: at least 2.
- Anything else (an unknown kind, a wrong count, a field ``int``/``float`` refuses, a DATA size out
  of range or without its ``\\n``) stops the dispatcher for good: every request from then on fails.
  So PERF, ENTROPY, GPUS and TOPK must never come unless asked for (``SERVE_PERF``/``SERVE_TOPK``,
  which the gateway never sets).
- Requests: ``SUBMIT <id> <slot> <bytes> <max_tokens> <temperature> <top_p> [<extra_bytes>]``, the
  extra payload (a grammar) after the prompt; ``STOP <id>`` on a stop string; ``CANCEL <id>`` when
  the client leaves. ``response_format: json_schema`` sends the schema itself as the grammar.

``GatewayView`` applies exactly these rules to the engine's raw stdout, with none of our codec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from engine_harness import STARTUP_TIMEOUT, chat_prompt, engine_args

from colibri.convert.writer import convert
from colibri.io.events import Prof
from colibri.io.mux import encode_response
from colibri.model.json_grammar import json_grammar
from colibri.settings import default_model_path

MAX_WAIT = 300
READY = b"\x01\x01READY\x01\x01"
MAX_DATA = 65536  # the gateway's largest DATA payload
FLOAT, INT = float, int


def _bool_int(text: str) -> bool:
    return bool(int(text))


@dataclass(frozen=True)
class Rule:
    count: Callable[[int], bool]  # the accepted field counts, the kind included
    types: dict[int, Callable[[str], object]] = field(default_factory=dict)  # field index: reader
    literal: dict[int, str] = field(default_factory=dict)  # field index: the text it must be


STAT_TYPES = {1: INT, 2: FLOAT, 3: FLOAT, 4: FLOAT, 5: INT, 6: _bool_int}  # fields past 4 optional
RULES = {
    "ACCEPT": Rule(lambda n: n >= 3, {2: INT}),
    "DONE": Rule(lambda n: n >= 7, {k + 2: t for k, t in STAT_TYPES.items()}, {2: "STAT"}),
    "HWINFO": Rule(lambda n: n >= 7, {1: INT, 2: FLOAT, 3: FLOAT, 4: INT, 5: FLOAT}),
    "EMAP": Rule(lambda n: n == 4, {1: INT, 2: INT}),
    "HITS": Rule(lambda n: n == 4),
    "PROF": Rule(lambda n: n >= 10, {1: FLOAT, 2: INT, 3: INT, 4: FLOAT, 5: FLOAT, 6: FLOAT, 7: FLOAT,
                                     8: FLOAT, 9: INT}),
    "TIERS": Rule(lambda n: n >= 6, {1: INT, 2: INT, 3: INT, 4: FLOAT, 5: FLOAT}),
    "ERROR": Rule(lambda n: n >= 2),
}


def gateway_refuses(fields: list[str], rules: dict[str, Rule] = RULES) -> str | None:
    """Why the gateway's dispatcher would stop on this line (split as it splits), or None."""
    rule = rules.get(fields[0])
    if rule is None:
        return f"unknown line kind {fields[0]!r}"
    if not rule.count(len(fields)):
        return f"{fields[0]} with {len(fields)} fields"
    for i, text in rule.literal.items():
        if fields[i] != text:
            return f"{fields[0]} field {i} is {fields[i]!r}, not {text!r}"
    for i, read in rule.types.items():
        if i < len(fields):
            try:
                read(fields[i])
            except ValueError:
                return f"{fields[0]} field {i} {fields[i]!r} is not {getattr(read, '__name__', read)}"
    return None


def test_the_rules_refuse_the_old_prof_and_take_ours():
    """The PROF that stopped the gateway carried the request id first; ours has none."""
    old = "PROF 1 0.4304 28 32 0.0000 0.0000 0.0000 0.0000 0.0000 32".split()
    assert gateway_refuses(old) == "PROF field 2 '0.4304' is not int"
    ours = encode_response(Prof(0.4304, 28, 32, 0.001, 0.0, 0.002, 0.003, 0.004, 32)).decode().split()
    assert gateway_refuses(ours) is None and len(ours) == 10
    assert gateway_refuses(["EMAP", "0", "0"]) == "EMAP with 3 fields"  # an empty map's line
    assert gateway_refuses(["ENTROPY"]) == "unknown line kind 'ENTROPY'"


@dataclass
class Turn:
    lines: list[list[str]] = field(default_factory=list)  # this request's lines, split
    text: bytes = b""
    data_lines: int = 0
    done: trio.Event = field(default_factory=trio.Event)


class GatewayView:
    """The engine's stdout as the gateway's dispatcher reads it; any line it would refuse fails.
    PROF has no id: it is kept with the DONE that follows it (the engine writes a turn's end
    block whole)."""

    def __init__(self, proc: trio.Process, rules: dict[str, Rule]) -> None:
        self.proc = proc
        self.rules = rules
        self.buf = b""
        self.turns: dict[int, Turn] = {}
        self.order: list[str] = []  # every line's kind, in order
        self.lines: list[list[str]] = []  # every line but DATA's, split
        self.stat: list[str] = []
        self.ready = trio.Event()
        self._prof: list[str] | None = None

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
            chunk = await self.proc.stdout.receive_some(1 << 16)
            assert chunk, "the engine's output ended inside a DATA payload"
            self.buf += chunk
        data, end, self.buf = self.buf[:n], self.buf[n : n + 1], self.buf[n + 1 :]
        assert end == b"\n", "the gateway refuses a DATA payload without its newline"
        return data

    async def read(self) -> None:
        while (line := await self._line()) != READY:
            assert line is not None, "the engine ended before READY"
        self.stat = (await self._line()).decode().split()
        assert self.stat[0] == "STAT" and len(self.stat) >= 5, self.stat
        for i, read in STAT_TYPES.items():
            if i < len(self.stat):
                read(self.stat[i])
        self.ready.set()
        while (line := await self._line()) is not None:
            fields = line.decode("utf-8", "replace").strip().split()
            if not fields:
                continue
            kind = fields[0]
            self.order.append(kind)
            if kind == "DATA":
                assert len(fields) == 3 and 0 <= int(fields[2]) <= MAX_DATA, f"the gateway refuses {line!r}"
                turn = self.turns.setdefault(int(fields[1]), Turn())
                turn.text += await self._exactly(int(fields[2]))
                turn.data_lines += 1
                turn.lines.append(fields)
                continue
            why = gateway_refuses(fields, self.rules)
            assert why is None, f"the gateway refuses {line!r}: {why}"
            self.lines.append(fields)
            if kind == "PROF":
                assert self._prof is None, "two PROF lines before a DONE"
                self._prof = fields
            if kind in ("ACCEPT", "DONE", "ERROR"):
                turn = self.turns.setdefault(int(fields[1]), Turn())
                if kind == "DONE" and self._prof is not None:
                    turn.lines.append(self._prof)
                    self._prof = None
                turn.lines.append(fields)
                if kind in ("DONE", "ERROR"):
                    turn.done.set()

    async def send(self, data: bytes) -> None:
        await self.proc.stdin.send_all(data)

    async def submit(self, rid: int, prompt: str, max_tokens: int, grammar: str = "",
                     temperature: float = 0.0, seed: int | None = None, slot: int = 0) -> Turn:
        """The gateway's SUBMIT: six fields, a seventh with a grammar after the prompt (an eighth,
        a seed, is ours)."""
        p, g = prompt.encode(), grammar.encode()
        extra = f" {len(g)}" if g or seed is not None else ""
        extra += f" {seed}" if seed is not None else ""
        head = f"SUBMIT {rid} {slot} {len(p)} {max_tokens} {temperature:.8g} 1{extra}\n".encode()
        turn = self.turns.setdefault(rid, Turn())
        await self.send(head + p + g + b"\n")
        return turn

    async def finished(self, rid: int) -> Turn:
        with trio.fail_after(MAX_WAIT):
            await self.turns[rid].done.wait()
        return self.turns[rid]


async def start(nursery: trio.Nursery, args: list[str] | None = None, env: dict[str, str] | None = None,
                rules: dict[str, Rule] = RULES, stderr: int | None = None) -> GatewayView:
    """``coli engine`` as the gateway starts it: the environment it inherits, and what it adds."""
    cmd = [sys.executable, "-m", "colibri", "engine", *(engine_args(None) if args is None else args)]
    base = {k: v for k, v in os.environ.items() if k not in ("SERVE_PERF", "SERVE_TOPK")}
    proc = await trio.lowlevel.open_process(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        env={**base, "SERVE": "1", "SERVE_BATCH": "1", **(env or {})},
    )
    view = GatewayView(proc, rules)
    nursery.start_soon(view.read)
    with trio.fail_after(STARTUP_TIMEOUT):
        await view.ready.wait()
    return view


def kinds(turn: Turn) -> list[str]:
    return [f[0] for f in turn.lines]


async def test_a_turn_as_the_gateway_reads_it(nursery):
    view = await start(nursery)
    await view.submit(1, chat_prompt("Name a colour."), 12)
    turn = await view.finished(1)
    seen = kinds(turn)
    assert seen[0] == "ACCEPT" and seen.index("ACCEPT") < seen.index("DATA")
    accept = turn.lines[0]
    assert int(accept[2]) > 5  # the prompt's tokens
    assert seen[-2:] == ["PROF", "DONE"]
    prof, done = turn.lines[-2], turn.lines[-1]
    # PROF <wall> <prompt> <completion> <edisk> <ewait> <emm> <attn> <head> <forwards>: ten fields
    assert len(prof) == 10 and float(prof[1]) > 0
    assert int(prof[2]) == int(accept[2]) and int(prof[3]) == int(done[3]) and int(prof[9]) >= 1
    # DONE: the spec's eight fields and our ninth, ``saved``, which the gateway ignores
    assert len(done) == 10 and done[9] == "0"
    # TIERS of a dense model, and nothing of the spec's optional telemetry: the gateway knows none
    assert ["TIERS", "0", "0", "0", "0.00", "0.00"] in view.lines
    assert not {"PERF", "ENTROPY", "GPUS", "TOPK", "EMAP", "HITS"} & set(view.order)
    await view.proc.stdin.aclose()


async def test_the_gateways_invocation_positional_cap_snap_ngen_kv_slots(nursery, tmp_path: Path):
    """``<engine> 0`` with SNAP a model directory (one GGUF in it), NGEN and KV_SLOTS: SNAP wins
    over a COLI_MODEL the user's shell exports; two slots decode in one batch; the cap is reported
    as meaningless on a dense model."""
    snap = tmp_path / "SmolLM2"
    snap.mkdir()
    (snap / "model.gguf").symlink_to(default_model_path())
    log = tmp_path / "stderr"
    with log.open("wb") as err:
        view = await start(nursery, ["0", "--no-persist", "--ctx", "1024"],
                           {"SNAP": str(snap), "NGEN": "64", "KV_SLOTS": "2",
                            "COLI_MODEL": str(tmp_path / "no-such.gguf")}, stderr=err.fileno())
        await view.submit(1, chat_prompt("Write a poem about the sea."), 24, slot=0)
        await view.submit(2, chat_prompt("Write a poem about the hills."), 24, slot=1)
        turns = [await view.finished(1), await view.finished(2)]
        await view.proc.stdin.aclose()
        with trio.fail_after(MAX_WAIT):
            assert await view.proc.wait() == 0
    for turn in turns:
        assert turn.lines[-1][0] == "DONE" and int(turn.lines[-1][3]) == 24 and turn.text
    assert "cap 0 ignored: 'llama' is a dense model" in log.read_text()


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
    # as the gateway sends ``response_format: json_schema``: the schema itself, which the engine
    # compiles as json_grammar does
    (json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
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


@pytest.mark.parametrize("grammar", ["root ::= undefined_rule", '{"type": "object", "properties": ',
                                     '{"type": "no-such-type"}'])
async def test_a_bad_grammar_is_refused_and_the_engine_goes_on(nursery, grammar):
    view = await start(nursery)
    await view.submit(1, chat_prompt("Hi"), 4, grammar=grammar)
    turn = await view.finished(1)
    assert turn.lines == [["ERROR", "1", "BAD_REQUEST"]]
    await view.submit(2, chat_prompt("Hi"), 4)
    assert (await view.finished(2)).lines[-1][0] == "DONE"
    await view.proc.stdin.aclose()


async def test_serve_perf_asks_for_the_specs_telemetry(nursery):
    """With SERVE_PERF=1 (the spec's telemetry, which ``coli serve`` reads and the gateway never
    asks for): PERF, GPUS, and on a dense model an ENTROPY line with no values, exactly ``ENTROPY``."""
    spec = {**RULES, "PERF": Rule(lambda n: n >= 9), "ENTROPY": Rule(lambda n: n >= 1),
            "GPUS": Rule(lambda n: n >= 2, {1: INT})}
    view = await start(nursery, env={"SERVE_PERF": "1"}, rules=spec)
    await view.submit(1, chat_prompt("Hi"), 4)
    await view.finished(1)
    assert {"PERF", "ENTROPY", "GPUS"} <= set(view.order)
    assert ["ENTROPY"] in view.lines and ["GPUS", "0"] in view.lines
    await view.proc.stdin.aclose()


MOE_HF = Path(__file__).parent / "data" / "tiny_hf" / "mixtral"
MOE_PROMPT = "<s>user: hello there</s>\n<s>assistant: "


async def test_a_moe_model_through_the_gateways_rules(nursery, tmp_path: Path):
    """A MoE's EMAP, HITS and TIERS as the gateway reads them, with the positional cap turned into
    the store's budget: 1 expert per layer of 2 keeps at most 2 of the 16 resident."""
    snap = tmp_path / "mixtral"
    snap.mkdir()
    convert(MOE_HF, snap / "tiny-mixtral-q8_0.gguf", "q8_0")
    log = tmp_path / "stderr"
    with log.open("wb") as err:
        view = await start(nursery, ["1", "--no-persist"], {"SNAP": str(snap), "NGEN": "32", "KV_SLOTS": "1"},
                           stderr=err.fileno())
        await view.submit(1, MOE_PROMPT, 20)
        turn = await view.finished(1)
        await view.proc.stdin.aclose()
        with trio.fail_after(MAX_WAIT):
            assert await view.proc.wait() == 0
    assert turn.lines[-1][0] == "DONE"
    assert {"EMAP", "HITS", "TIERS"} <= set(view.order)
    emap = [f for f in view.lines if f[0] == "EMAP"][-1]
    assert (emap[1], emap[2]) == ("2", "8") and len(emap[3]) == 2 * 2 * 8
    tiers = [f for f in view.lines if f[0] == "TIERS"][-1]
    assert int(tiers[2]) <= 2 and int(tiers[2]) + int(tiers[3]) == 16
    assert "cap 1 experts per MoE layer" in log.read_text()
