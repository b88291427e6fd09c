"""The Channel protocol's conversation (docs/channel_protocol.md): one stateful conversation on KV
slot 0, driven by binary frames, served by the same engine and step loop as the mux protocol.

The conversation is ``context``, the token ids the slot holds or will hold; it only grows (until
SET_SYSTEM or a snapshot load replaces it), so every turn reuses the whole cached prefix. A turn is
one or more engine requests: closing the reasoning block when the thinking budget is spent is a
new request over the same context, inside the same turn. Replies carry the msg_id of the frame
that started the turn (STREAM_INPUT, TOOL_RETURN or RESUME).

Frames that need the slot (inputs, probes, snapshots, SET_SYSTEM, MEM_QUERY) are BUSY while a turn
runs; SET_CONFIG, ABORT, MEM_COMMIT, PING and SHUTDOWN are taken at any time.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import trio

from colibri.io import channel
from colibri.io import channel_frames as cf
from colibri.io.events import Data, Done, Error, Submit
from colibri.model.grammar import GrammarError, compile_grammar
from colibri.sched import channel_slot
from colibri.sched.channel_tools import CALL_CLOSE, CALL_OPEN, Tools
from colibri.sched.channel_turns import Config, Turn, TurnRenderer
from colibri.sched.engine import Engine
from colibri.sched.memory import EpisodicMemory, MemoryStoreError
from colibri.sched.persist import SnapshotError
from colibri.sched.session import Receive

SLOT = 0
MALFORMED = cf.ErrorCode.MALFORMED_PAYLOAD
MEM_MODES = (0, 1)  # MEM_QUERY: 0 ranks and injects, 1 only ranks and reports
STATUS_EVERY_TOKENS = 16  # the notes' "STATUS(generating) every few tokens": live, not a flood
ELASTIC_MIN_TOKENS = 8  # thought tokens before the gate may yield: a yield per word helps no one
MAX_PROBE_TOKENS = 256  # a micro-decode is a reflex, not a turn
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"  # the reasoning block (docs: templates)
SENTENCE_ENDS = (b".", b"!", b"?", b"\n")  # a token ending one of these ends a sentence or paragraph


class ChannelSession:
    def __init__(self, engine: Engine, out: trio.MemorySendChannel[bytes], work: trio.Nursery,
                 memory: EpisodicMemory) -> None:
        self.engine, self.out, self.work, self.memory = engine, out, work, memory
        self.turns = TurnRenderer(engine.model.text)
        self.config = Config()
        self.tools = Tools(None)  # SET_SYSTEM's instructions and tools
        self.context: list[int] = list(engine.slots[SLOT].history)  # restored with the slot
        self.prev_role: str | None = "assistant" if self.context else None
        self.messages: list[dict[str, str]] = []  # the conversation's text, for snapshots
        self.calls: dict[int, str] = {}  # TOOL_CALL ids not yet answered -> the tool's name
        self.next_call = 1
        self.next_request = 1
        self.turn: Turn | None = None  # generating now
        self.yielded: Turn | None = None  # paused by the gate, waiting for RESUME
        self.running = trio.Event()
        self.running.set()  # set: no turn runs
        self.shutdown = False
        n_layers = engine.model.hp.n_layers
        self.layer_mask = (1 << min(n_layers, 64)) - 1  # every layer is active: no quiescence here

    # ------------------------------------------------------------------ the session

    async def send(self, msg_id: int, message: object) -> None:
        await self.out.send(channel.encode(msg_id, message))

    async def open(self) -> None:
        await self.status(0, cf.EngineStatus.IDLE)

    async def read(self, receive: Receive) -> int:
        """Frames, in order, until SHUTDOWN or EOF (0), or a frame that breaks the stream (ERROR
        with msg_id 0, then 2: nothing after it can be trusted, and nothing persisted is touched)."""
        reader = channel.FrameReader("inbound")
        while not self.shutdown:
            for event in reader.receive_data(await receive()):
                match event:
                    case cf.Frame(msg_id=msg_id, message=message):
                        await self.handle(msg_id, message)
                        if self.shutdown:
                            return 0
                    case cf.BadFrame(msg_id=msg_id, code=code, detail=detail):
                        await self.error(msg_id, code, detail)
                    case cf.FatalFrame(code=code, detail=detail):
                        print(f"colibri: channel: {code.name}: {detail}", file=sys.stderr, flush=True)
                        await self.error(0, code, detail)
                        return 2
                    case cf.EndOfInput():
                        return 0
        return 0

    async def handle(self, msg_id: int, message: object) -> None:
        """One inbound frame (the reader's order); long work goes to a task in ``work``."""
        match message:
            case cf.Ping():
                await self.send(msg_id, cf.Pong())
            case cf.SetConfig():
                await self._set_config(msg_id, message)
            case cf.Abort():
                await self._abort(msg_id)
            case cf.MemCommit():
                await self._commit(msg_id)
            case cf.Shutdown():
                self.shutdown = True
            case _ if self.turn is not None:
                await self.error(msg_id, cf.ErrorCode.BUSY, "a turn is in progress")
            case _ if type(message) in _SLOT_FRAMES:
                await _SLOT_FRAMES[type(message)](self, msg_id, message)
            case _:
                await self.error(msg_id, cf.ErrorCode.UNKNOWN_OPCODE, type(message).__name__)

    @property
    def state(self) -> cf.EngineStatus:
        return cf.EngineStatus.GENERATING if self.turn else cf.EngineStatus.IDLE

    async def error(self, msg_id: int, code: cf.ErrorCode, detail: str) -> None:
        await self.send(msg_id, cf.Error(int(code), detail))

    async def status(self, msg_id: int, state: cf.EngineStatus, turn: Turn | None = None) -> None:
        rate = 0.0
        if turn is not None and turn.tokens:
            rate = turn.tokens / max(time.perf_counter() - turn.t0, 1e-9)
        full = len(self.context) >= self.engine.n_ctx
        await self.send(msg_id, cf.Status(
            int(state), 0, 0 if state == cf.EngineStatus.IDLE else 1, min(self.memory.stored, 0xFFFF),
            1 if full else 0, rate, turn.tokens if turn else 0, min(len(self.context), 0xFFFFFFFF)))

    # ------------------------------------------------------------------ inputs

    async def _input(self, msg_id: int, inp: cf.StreamInput) -> None:
        direct = bool(inp.flags & cf.INPUT_FLAG_DIRECT)
        reason = bool(inp.flags & cf.INPUT_FLAG_REASON)
        tool_mode = self.tools.mode if not direct else "none"
        if tool_mode == "required":
            reason = False  # the call's grammar leaves no room for a reasoning block
        hp = self.engine.model.hp
        content = self.turns.content(inp, direct, hp.n_vocab, hp.n_embd, max(self._room(), 0))
        if isinstance(content, cf.Error):
            return await self.send(msg_id, content)
        body, user, embeds = content
        if direct:
            before, after = [], []
        else:
            framed = self.turns.user_turn(self.prev_role, self.tools.system_text(), None)
            before, after = framed.before, framed.after
        if reason and self.config.frame.thinking_budget > 0:
            after = after + self.turns.markup(THINK_OPEN)
        else:
            reason = False
        n_soft = 0 if embeds is None else len(embeds)
        if not await self._fits(msg_id, len(before) + len(body) + n_soft + len(after), "the input"):
            return
        self.messages.append({"role": "user", "content": user})
        if embeds is not None:
            await self.status(msg_id, cf.EngineStatus.ENCODING)
            await self._sync_slot()
            await channel_slot.extend(self.engine, SLOT, before + body, embeds)
            self.context = list(self.engine.slots[SLOT].history)
            before, body = [], []
            if direct:  # no text to end on: the rows are context; the host's next input starts a turn
                self.prev_role = "user"
                await self.send(msg_id, cf.TurnComplete(0, 0, 0.0, int(cf.StopReason.END_OF_TURN)))
                return await self.status(msg_id, cf.EngineStatus.IDLE)
        self.context += before + body + after
        self.yielded = None
        self._start(Turn(msg_id, user, reason, tool_mode))

    async def _tool_return(self, msg_id: int, ret: cf.ToolReturn) -> None:
        """The result as the template's tool message; one that does not fit leaves the call waiting."""
        try:
            call_id = int(ret.call_id)
            name = self.calls[call_id]
        except (ValueError, KeyError):
            return await self.error(msg_id, cf.ErrorCode.MALFORMED_PAYLOAD,
                                    f"no tool call {ret.call_id!r} is waiting for its result")
        content = json.dumps({"name": name, "error" if ret.is_error else "result": ret.result},
                             ensure_ascii=False)
        framed = self.turns.user_turn(self.prev_role, None, role="tool")
        body = self.turns.fitting(content, max(self._room(), 0))  # a count: too long, untokenized
        n = len(framed.before) + (body if isinstance(body, int) else len(body)) + len(framed.after)
        if not await self._fits(msg_id, n, f"the result of tool call {call_id}") or isinstance(body, int):
            return
        added = framed.before + body + framed.after
        del self.calls[call_id]
        self.context += added
        self.messages.append({"role": "tool", "content": content})
        self._start(Turn(msg_id, content, False, "auto" if self.tools.tools else "none"))

    async def _resume(self, msg_id: int, res: cf.Resume) -> None:
        turn = self.yielded
        if turn is None:
            return await self.error(msg_id, cf.ErrorCode.MALFORMED_PAYLOAD, "no yielded turn to resume")
        if res.action == cf.RESUME_CLOSE_THOUGHT and turn.in_thought:
            close = self.turns.markup(THINK_CLOSE)
            if not await self._fits(msg_id, len(close), "closing the reasoning block"):
                return  # still yielded: RESUME CONTINUE or ABORT
            self.context += close
            turn.in_thought = False
        self.yielded = None
        turn.msg_id, turn.ending, turn.since_yield = msg_id, None, 0
        self._start(turn)

    # ------------------------------------------------------------------ a turn

    def _start(self, turn: Turn) -> None:
        self.turn = turn
        self.running = trio.Event()
        self.work.start_soon(self._run, turn)

    async def _run(self, turn: Turn) -> None:
        try:
            await self.status(turn.msg_id, cf.EngineStatus.ENCODING, turn)
            while True:
                done = await self._generate(turn)
                if done is None:
                    return  # an error frame went out; the turn is over
                if turn.ending == "close" and len(close := self.turns.markup(THINK_CLOSE)) <= self._room():
                    self.context += close
                    turn.in_thought, turn.ending = False, None
                    continue
                if turn.ending == "close":  # no room left to close the block: the context is spent
                    done, turn.ending = replace(done, length_limited=True), None
                break
            await self._complete(turn, done)
        finally:
            self.turn = None
            self.running.set()

    async def _generate(self, turn: Turn) -> Done | None:
        """One engine request over the context; its DONE, or None after an ERROR frame. It asks for
        no more tokens than the context has room for (with none left: a DONE at its limit)."""
        remaining = min(self.config.frame.max_tokens - turn.tokens, self._room())
        rid = self.next_request
        self.next_request += 1
        turn.request = rid
        if remaining <= 0:
            return Done(rid, 0, 0.0, 0.0, 0.0, len(self.context), True)
        grammar = self.tools.grammar() if turn.tool_mode == "required" and not turn.in_thought else None
        sub = Submit(rid, SLOT, remaining, self.config.frame.temperature, self.config.frame.top_p, "",
                     prompt_ids=tuple(self.context), grammar=grammar)
        outcome: list[object] = []
        ended = trio.Event()

        async def on_event(event: object) -> None:
            if isinstance(event, Data) and event.token is None:  # the detokenizer's tail at the end
                await self._text(turn, self.context[-1] if self.context else 0, event.text)
            elif isinstance(event, Data):
                self.context.append(event.token)
                turn.tokens += 1
                await self._text(turn, event.token, event.text)
                if turn.tokens % STATUS_EVERY_TOKENS == 0:
                    await self.status(turn.msg_id, cf.EngineStatus.GENERATING, turn)
                if turn.ending is not None:
                    self.engine.stop(rid)
            elif isinstance(event, Done | Error):
                outcome.append(event)
                ended.set()

        error = self.engine.check(sub, self.config.sampling())
        if error is None:
            self.engine.start(sub, self.work, on_event, self.config.sampling())
            await ended.wait()
            error = outcome[0] if isinstance(outcome[0], Error) else None
        if error is not None:
            detail = str(error.code) + (f" {error.args}" if getattr(error, "args", None) else "")
            await self.error(turn.msg_id, cf.ErrorCode.INTERNAL, f"the engine refused the turn: {detail}")
            await self.status(turn.msg_id, cf.EngineStatus.IDLE)
            return None
        return outcome[0]  # type: ignore[return-value]

    async def _text(self, turn: Turn, token: int, text: bytes) -> None:
        """A token's text: thought or content, the reasoning block's end, the gates."""
        clock = max(len(self.context) - 1, 0)
        if turn.in_thought:
            turn.thought += text
            turn.thought_tokens += 1
            turn.since_yield += 1
            await self.send(turn.msg_id, cf.StreamThought(token, clock, self.layer_mask, cf.TOKEN_TEXT, text))
            if THINK_CLOSE.strip().encode() in turn.thought:
                turn.in_thought = False  # the model closed its reasoning block itself
            elif turn.thought_tokens >= self.config.frame.thinking_budget:
                turn.ending = "close"
            elif (self.config.thinking_gate and turn.since_yield >= ELASTIC_MIN_TOKENS
                  and text.rstrip(b" ").endswith(SENTENCE_ENDS)):
                turn.ending = "yield"
            return
        turn.content += text
        frame = cf.StreamContent(token, clock, self.layer_mask, cf.TOKEN_TEXT, text)
        if turn.tool_mode == "none" or turn.plain:
            await self.send(turn.msg_id, frame)
            return
        start = bytes(turn.content).lstrip()  # short: only until the answer is known to be text
        if turn.calling or start.startswith(CALL_OPEN.encode()):
            turn.calling = True
            turn.held.append(frame)
            if CALL_CLOSE.encode() in start:
                turn.ending = turn.ending or "call"
        elif CALL_OPEN.encode().startswith(start):
            turn.held.append(frame)  # may still become a call
        else:
            turn.plain = True  # text, not a call: no need to look again
            for held in turn.held:
                await self.send(turn.msg_id, held)
            turn.held.clear()
            await self.send(turn.msg_id, frame)

    async def _complete(self, turn: Turn, done: Done) -> None:
        if turn.ending == "yield":
            self.yielded = turn
            await self._turn_complete(turn, cf.StopReason.ELASTIC_YIELD)
            return
        reason = cf.StopReason.MAX_TOKENS if done.length_limited else cf.StopReason.END_OF_TURN
        if turn.ending == "abort":
            reason = cf.StopReason.ABORTED
        content = bytes(turn.content).decode("utf-8", errors="replace")
        call = self.tools.parse(content) if turn.calling else None
        if call is not None:
            call_id = self.next_call
            self.next_call = self.next_call % 0xFFFF + 1
            self.calls[call_id] = call[0]
            await self.send(turn.msg_id, cf.ToolCall(call_id, call[0], call[1]))
            reason = cf.StopReason.TOOL_CALL
        else:
            for held in turn.held:  # not a call after all: it was content
                await self.send(turn.msg_id, held)
        turn.held.clear()
        reply = (bytes(turn.thought) + bytes(turn.content)).decode("utf-8", errors="replace")
        self.messages.append({"role": "assistant", "content": reply})
        self.prev_role = "assistant"
        await trio.to_thread.run_sync(self.memory.stage, turn.user, reply)  # may wait on a commit's lock
        await self._turn_complete(turn, reason)

    async def _turn_complete(self, turn: Turn, reason: cf.StopReason) -> None:
        elapsed = time.perf_counter() - turn.t0
        rate = turn.tokens / elapsed if elapsed > 0 else 0.0
        await self.send(turn.msg_id, cf.TurnComplete(turn.tokens, min(int(elapsed * 1000), 0xFFFFFFFF),
                                                     rate, int(reason)))
        await self.status(turn.msg_id, cf.EngineStatus.IDLE)

    # ------------------------------------------------------------------ control

    async def _set_config(self, msg_id: int, cfg: cf.SetConfig) -> None:
        config = Config(cfg)
        try:
            config.check()
        except ValueError as e:
            return await self.error(msg_id, cf.ErrorCode.MALFORMED_PAYLOAD, str(e))
        self.config = config  # the next turn's; a turn in progress keeps its own
        await self.status(msg_id, self.state, self.turn)

    async def _abort(self, msg_id: int) -> None:
        if self.turn is not None:
            self.turn.ending = "abort"
            self.engine.stop(self.turn.request)
        elif self.yielded is not None:
            turn, self.yielded = self.yielded, None
            turn.msg_id = msg_id
            self.messages.append({"role": "assistant", "content": (bytes(turn.thought) + bytes(
                turn.content)).decode("utf-8", errors="replace")})
            self.prev_role = "assistant"
            await self._turn_complete(turn, cf.StopReason.ABORTED)

    async def _commit(self, msg_id: int) -> None:
        """STATUS(consolidating), the staged turns written, then the engine's state again."""
        await self.status(msg_id, cf.EngineStatus.CONSOLIDATING, self.turn)
        try:
            await trio.to_thread.run_sync(self.memory.commit)
        except Exception as e:  # noqa: BLE001 - the store's failure is reported, the staged turns kept
            return await self.error(msg_id, cf.ErrorCode.INTERNAL, f"memory commit failed: {e}")
        await self.status(msg_id, self.state, self.turn)

    async def _set_system(self, msg_id: int, sys_: cf.SetSystem) -> None:
        """A new conversation under these instructions and tools (the context starts over)."""
        for t in sys_.tools:
            if not isinstance(t.get("parameters", {}), dict):
                return await self.error(msg_id, MALFORMED, "a tool's parameters must be an object")
        self.tools = Tools(dict(sys_.raw) or {"instructions": sys_.instructions, "tools": list(sys_.tools)})
        self.context, self.messages, self.calls, self.prev_role, self.yielded = [], [], {}, None, None
        if self.tools.mode == "required":
            try:
                compile_grammar(self.tools.grammar())
            except GrammarError as e:
                self.tools = Tools(None)
                return await self.error(msg_id, cf.ErrorCode.MALFORMED_PAYLOAD, f"tools: {e}")
        await self.status(msg_id, cf.EngineStatus.IDLE)

    async def _probe(self, msg_id: int, probe: cf.ProbeAutonomic) -> None:
        prompt = self.turns.plain(probe.prompt)
        steps = max(1, probe.max_decode_tokens)
        n_vocab = self.engine.model.hp.n_vocab
        if not prompt:
            return await self.error(msg_id, cf.ErrorCode.MALFORMED_PAYLOAD, "a probe needs a prompt")
        if steps > MAX_PROBE_TOKENS or any(c >= n_vocab for c in probe.candidates):
            return await self.error(msg_id, cf.ErrorCode.MALFORMED_PAYLOAD,
                                    f"at most {MAX_PROBE_TOKENS} tokens, candidates inside the vocabulary")
        if len(self.context) + len(prompt) + steps > self.engine.n_ctx:
            return await self.error(msg_id, MALFORMED, "the probe does not fit the context")
        await self._sync_slot()
        r = await channel_slot.probe(self.engine, SLOT, prompt, list(probe.candidates), steps)
        await self.send(msg_id, r)

    async def _sync_slot(self) -> None:
        await channel_slot.sync(self.engine, SLOT, self.context)

    def _room(self) -> int:
        """Tokens the context can still take: never more than the slot holds (``--ctx``)."""
        return self.engine.n_ctx - len(self.context)

    async def _fits(self, msg_id: int, n: int, what: str) -> bool:
        """Whether ``n`` tokens more leave room for a reply's first token; if not, the ERROR that says
        so (MALFORMED_PAYLOAD: the protocol's refusal of a request not valid now), nothing changed."""
        if n < self._room():
            return True
        await self.error(msg_id, MALFORMED, f"{what} does not fit the context: {n} tokens, "
                                            f"{max(self._room(), 0)} of {self.engine.n_ctx} left")
        return False

    # ------------------------------------------------------------------ snapshots and memory

    async def _snapshot_save(self, msg_id: int, snap: cf.SnapshotSave) -> None:
        meta = channel_slot.meta_of((snap.stream_id, self.messages, self.tools.system, self.prev_role,
                                     self.calls, self.next_call))
        try:
            await self._sync_slot()  # KVBoundsError (a ValueError) if the context outgrew the slot: a bug
            await channel_slot.save_snapshot(self.engine, SLOT, Path(snap.path), meta)
        except (OSError, ValueError) as e:
            return await self.error(msg_id, cf.ErrorCode.SNAPSHOT_SAVE_FAILED, f"{snap.path}: {e}")
        await self.send(msg_id, cf.SnapshotStatus(int(cf.SnapshotState.SAVED), 1, len(self.context),
                                                  snap.stream_id))

    async def _snapshot_load(self, msg_id: int, snap: cf.SnapshotLoad) -> None:
        try:
            raw = await channel_slot.load_snapshot(self.engine, SLOT, Path(snap.path))
            state = channel_slot.state_of(raw)
        except SnapshotError as e:
            return await self.error(msg_id, cf.ErrorCode.SNAPSHOT_LOAD_FAILED, str(e))
        except (ValueError, KeyError, TypeError) as e:  # our own checksummed JSON: another build's
            self.engine.slots[SLOT].history.clear()
            self.context, self.messages, self.prev_role = [], [], None
            return await self.error(msg_id, cf.ErrorCode.SNAPSHOT_LOAD_FAILED, f"{snap.path}: its state: {e}")
        stream_id, self.messages, system, self.prev_role, self.calls, self.next_call = state
        self.tools = Tools(system)
        self.context = list(self.engine.slots[SLOT].history)
        self.yielded = None
        loaded = cf.SnapshotStatus(int(cf.SnapshotState.LOADED), 1, len(self.context), stream_id)
        await self.send(msg_id, loaded)

    async def _mem_query(self, msg_id: int, q: cf.MemQuery) -> None:
        if q.mode not in MEM_MODES:
            return await self.error(msg_id, cf.ErrorCode.UNSUPPORTED_FEATURE,
                                    f"memory query mode {q.mode}: 0 injects, 1 only reports")
        await self.status(msg_id, cf.EngineStatus.MEMORY)
        try:
            recall = await trio.to_thread.run_sync(lambda: self.memory.query(
                q.query, q.top_k, q.cursor, q.timestamp or None, q.w_vec, q.w_temporal, q.w_pinned))
        except MemoryStoreError as e:
            await self.error(msg_id, cf.ErrorCode.INTERNAL, f"memory: {e}")
            return await self.status(msg_id, cf.EngineStatus.IDLE)
        injected = 0
        if recall.turns and q.mode == MEM_MODES[0]:
            lines = ["Relevant earlier turns of this conversation:"]
            for t in recall.turns:
                lines.append(f"- user: {t.user}\n  assistant: {t.assistant}")
            note = self.turns.note(self.prev_role, "system", "\n".join(lines))
            if len(self.context) + len(note) < self.engine.n_ctx:
                self.context += note
                self.prev_role = "system"
                injected = len(note)
        await self.send(msg_id, cf.MemResponse(recall.status, recall.next_cursor, injected,
                                               tuple(t.timestamp for t in recall.turns)))
        await self.status(msg_id, cf.EngineStatus.IDLE)

    async def close(self, status: int) -> None:
        """SHUTDOWN or EOF: the turn in flight ends (state kept), the memory is committed. After a
        frame that broke the stream (``status`` 2) the memory's file is left as it was."""
        if self.turn is not None:
            self.turn.ending = "abort"
            self.engine.stop(self.turn.request)
        await self.running.wait()
        if status != 0:
            return
        try:
            await trio.to_thread.run_sync(self.memory.commit)
        except Exception as e:  # noqa: BLE001 - reported; exiting must not lose the slot's state
            print(f"colibri: warning: memory not committed: {e}", file=sys.stderr, flush=True)


# The frames that need the slot, and their handlers: BUSY while a turn runs (``handle``).
_SLOT_FRAMES = {
    cf.StreamInput: ChannelSession._input, cf.ToolReturn: ChannelSession._tool_return,
    cf.Resume: ChannelSession._resume, cf.SetSystem: ChannelSession._set_system,
    cf.ProbeAutonomic: ChannelSession._probe, cf.SnapshotSave: ChannelSession._snapshot_save,
    cf.SnapshotLoad: ChannelSession._snapshot_load, cf.MemQuery: ChannelSession._mem_query,
}
