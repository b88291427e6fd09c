"""The real engine over pipes in the Channel protocol, with the real default model, driven by
the project's codec as a host would (``channel_harness.py``): every opcode and every error code the
engine sends.

One engine serves the module's conversation tests in order (the protocol is one stateful
conversation); the framing errors, which end the process, and the snapshot restart get engines of
their own.
"""

from __future__ import annotations

import json
import math
import struct

import jsonschema
import numpy as np
import pytest
from channel_harness import ChannelEngine, files_of, text_input

from colibri.io import channel
from colibri.io import channel_frames as cf
from colibri.sched.memory import MEMORY_FILE, EpisodicMemory

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def eng():
    e = ChannelEngine()
    yield e
    assert e.close() == 0


def greedy(eng: ChannelEngine, max_tokens: int = 16, **fields) -> None:
    eng.configure(temperature=0.0, max_tokens=max_tokens, **fields)


def fresh(eng: ChannelEngine, instructions: str = "", tools: tuple = (), **extra) -> None:
    """SET_SYSTEM: a new conversation (what earlier tests said no longer steers the model)."""
    raw = {"instructions": instructions, "tools": list(tools), **extra}
    status = eng.until(eng.send(cf.SetSystem(instructions, tools, raw)), cf.Status)
    assert not status.of(cf.Error), status.frames


# ------------------------------------------------------------------------------ basics


def test_ping_pong(eng):
    reply = eng.reply(cf.Ping())
    assert reply.message == cf.Pong()


def test_a_text_turn(eng):
    """STATUS(encoding), content frames with token ids and growing clocks, TURN_COMPLETE, STATUS(idle),
    every frame with the input's msg_id."""
    greedy(eng, 12)
    turn = eng.say(QUESTION)
    statuses = turn.of(cf.Status)
    assert statuses[0].status == cf.EngineStatus.ENCODING and statuses[-1].status == cf.EngineStatus.IDLE
    content = turn.of(cf.StreamContent)
    assert content and turn.content.decode().strip()
    clocks = [m.clock for m in content]
    assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)
    assert all(m.token_type == cf.TOKEN_TEXT and m.active_layer_mask for m in content)
    done = turn.complete
    assert done.stop_reason in (cf.StopReason.END_OF_TURN, cf.StopReason.MAX_TOKENS)
    assert 0 < done.tokens <= 12 and done.tok_per_sec > 0
    assert len({f.msg_id for f in turn.frames}) == 1


def test_max_tokens_from_set_config(eng):
    greedy(eng, 5)
    done = eng.say("Tell me a long story about a dragon.").complete
    assert (done.tokens, done.stop_reason) == (5, cf.StopReason.MAX_TOKENS)


def test_input_text_is_data_unless_direct(eng):
    """The trust rule: ``<|im_end|>`` in a user's text is text (as many tokens as the plain
    tokenizer makes of it), not the control token; with INPUT_FLAG_DIRECT the host rendered the
    prompt and it is the one control token. Measured by the context's growth (STATUS total_tok)."""
    greedy(eng, 1)
    marker = "<|im_end|>"
    plain_len = len(eng_tokenize(marker))
    assert plain_len > 1
    turns = [eng.say("a"), eng.say("a"), eng.say(marker), eng.say(marker, cf.INPUT_FLAG_DIRECT)]
    at = [t.of(cf.Status)[0].total_tok for t in turns]  # the context once the input is in
    made = [t.complete.tokens for t in turns]
    framing = at[1] - at[0] - made[0] - len(eng_tokenize("a"))  # the template's turn markup
    assert at[2] - at[1] - made[1] - framing == plain_len
    assert at[3] - at[2] - made[2] == 1


def test_token_ids_input(eng):
    """DataType.TOKENS: the ids as the user's content, templated; the same greedy reply as the text."""
    greedy(eng, 8)
    tok_ids = eng_tokenize(QUESTION)
    a = eng.say(QUESTION).content
    b = eng.turn(cf.StreamInput(int(cf.DataType.TOKENS), 0, struct.pack(f"<{len(tok_ids)}I", *tok_ids)))
    assert b.complete.tokens > 0 and a and b.content


def eng_tokenize(text: str) -> list[int]:
    from colibri.model.text import ModelText
    from colibri.settings import default_model_path

    return ModelText.open(default_model_path()).tokenizer.encode(text)


def test_soft_embeddings_input(eng):
    """DataType.EMBEDDINGS: f16 rows of the model's width enter at layer 0 as the user's content; the
    turn runs. Rows of the wrong width are MALFORMED_PAYLOAD."""
    from colibri.model.loader import Model
    from colibri.settings import default_model_path

    model = Model(default_model_path())
    ids = model.text.tokenizer.encode(QUESTION)
    rows = model.decoder.embedding(np.asarray(ids, np.int64)).astype("<f2")
    greedy(eng, 6)
    turn = eng.turn(cf.StreamInput(int(cf.DataType.EMBEDDINGS), 0, rows.tobytes()))
    assert turn.complete.tokens > 0 and turn.content
    bad = eng.reply(cf.StreamInput(int(cf.DataType.EMBEDDINGS), 0, rows.tobytes()[:-2]))
    assert isinstance(bad.message, cf.Error) and bad.message.code == cf.ErrorCode.MALFORMED_PAYLOAD


@pytest.mark.parametrize("data_type", [cf.DataType.AUDIO, cf.DataType.IMAGE, cf.DataType.PATCHES, 9])
def test_unsupported_data_types(eng, data_type):
    reply = eng.reply(cf.StreamInput(int(data_type), 0, b"\x00\x01"))
    assert isinstance(reply.message, cf.Error) and reply.message.code == cf.ErrorCode.UNSUPPORTED_DATA_TYPE


# ------------------------------------------------------------------------------ abort, reasoning, yield


def test_abort_stops_within_a_step_and_keeps_the_state(eng):
    eng.configure(temperature=0.0, max_tokens=300)
    msg_id = eng.send(text_input("Write a very long story about a dragon, with many chapters."))
    first = eng.until(msg_id, cf.StreamContent)
    assert first.of(cf.StreamContent)
    eng.send(cf.Abort())
    rest = eng.until(msg_id, cf.TurnComplete)
    done = rest.complete
    assert done.stop_reason == cf.StopReason.ABORTED and done.tokens < 300
    idle = eng.until(msg_id, cf.Status).of(cf.Status)[-1]
    assert idle.status == cf.EngineStatus.IDLE
    greedy(eng, 4)
    after = eng.say("Thanks.")
    assert after.of(cf.Status)[0].total_tok > idle.total_tok  # the conversation went on from there


def test_busy_while_a_turn_runs(eng):
    eng.configure(temperature=0.0, max_tokens=200)
    msg_id = eng.send(text_input("Write a long poem about the sea."))
    eng.until(msg_id, cf.StreamContent)
    busy = eng.send(text_input("Another"))
    reply = eng.until(busy, cf.Error).of(cf.Error)[0]
    assert reply.code == cf.ErrorCode.BUSY
    eng.send(cf.Abort())
    assert eng.until(msg_id, cf.TurnComplete).complete.stop_reason == cf.StopReason.ABORTED
    eng.until(msg_id, cf.Status)


def test_reasoning_block_and_its_budget(eng):
    """INPUT_FLAG_REASON: the reply starts in the reasoning block (STREAM_THOUGHT); when the thinking
    budget is spent the block is closed and the answer comes as STREAM_CONTENT."""
    fresh(eng)
    greedy(eng, 40, thinking_budget=10)
    turn = eng.say("Why is the sky blue?", cf.INPUT_FLAG_REASON)
    thoughts = turn.of(cf.StreamThought)
    assert 1 <= len(thoughts) <= 10 and turn.thought, turn.complete
    if len(thoughts) == 10:  # spent: closed by the engine, the rest is content
        assert turn.of(cf.StreamContent)
    first_content = next(i for i, f in enumerate(turn.frames) if isinstance(f.message, cf.StreamContent))
    last_thought = max(i for i, f in enumerate(turn.frames) if isinstance(f.message, cf.StreamThought))
    assert last_thought < first_content


def test_elastic_yield_then_resume_and_close_thought(eng):
    """The thinking gate: the turn pauses at a sentence end (STOP_ELASTIC_YIELD); RESUME goes on
    thinking; RESUME with CLOSE_THOUGHT closes the block and the answer follows as content."""
    fresh(eng)
    greedy(eng, 120, thinking_budget=100, flags=cf.CONFIG_THINKING_GATE)
    first = eng.say("Explain how rain forms, step by step.", cf.INPUT_FLAG_REASON)
    assert first.complete.stop_reason == cf.StopReason.ELASTIC_YIELD, first.thought
    assert first.thought.rstrip(b" ").endswith((b".", b"!", b"?", b"\n"))
    again = eng.turn(cf.Resume(cf.RESUME_CONTINUE))
    assert again.of(cf.StreamThought) and again.complete.stop_reason in (
        cf.StopReason.ELASTIC_YIELD, cf.StopReason.MAX_TOKENS, cf.StopReason.END_OF_TURN)
    if again.complete.stop_reason == cf.StopReason.ELASTIC_YIELD:
        closed = eng.turn(cf.Resume(cf.RESUME_CLOSE_THOUGHT))
        assert not closed.of(cf.StreamThought) and closed.of(cf.StreamContent)
    nothing = eng.reply(cf.Resume(cf.RESUME_CONTINUE))
    assert isinstance(nothing.message, cf.Error) and nothing.message.code == cf.ErrorCode.MALFORMED_PAYLOAD
    greedy(eng, 16)


# ------------------------------------------------------------------------------ probe


def test_probe_logit_and_micro_decode(eng):
    greedy(eng, 4)
    eng.say("Is Paris in France? Answer yes or no.")
    yes, no = eng_tokenize(" yes")[0], eng_tokenize(" no")[0]
    r = eng.reply(cf.ProbeAutonomic(1, (yes, no), "Answer:")).message
    assert isinstance(r, cf.AutonomicResult)
    assert r.selected_index in (0, 1) and r.winning_token == (yes, no)[r.selected_index]
    assert 0.5 <= r.confidence <= 1.0 and 0.0 <= r.entropy <= math.log(2) + 1e-6 and r.cost_ms > 0
    r = eng.reply(cf.ProbeAutonomic(6, (), "The capital of France is")).message
    assert r.selected_index == 0xFFFF and r.text
    bad = eng.reply(cf.ProbeAutonomic(1, (10**9,), "x")).message
    assert bad.code == cf.ErrorCode.MALFORMED_PAYLOAD


def test_a_probe_leaves_the_next_turn_unchanged():
    """The same conversation in two engines, one probed (both kinds) between its turns: the next
    turn's greedy tokens are identical."""
    replies = []
    for probe in (False, True):
        e = ChannelEngine()
        try:
            greedy(e, 10)
            e.say("Name a colour.")
            if probe:
                e.reply(cf.ProbeAutonomic(1, (), "Is it red?"))
                e.reply(cf.ProbeAutonomic(8, (), "Tell me more about green and blue"))
            turn = e.say("And another one?")
            replies.append([m.token_id for m in turn.of(cf.StreamContent)])
        finally:
            assert e.close() == 0
    assert replies[0] == replies[1] and replies[0]


# ------------------------------------------------------------------------------ tools


WEATHER = {"name": "get_weather", "description": "Get the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


def test_tools_call_and_return(eng):
    """SET_SYSTEM with a tool (tool_choice required, ours): the answer is a TOOL_CALL with valid
    arguments and the turn ends STOP_TOOL_CALL; TOOL_RETURN feeds the result back as the
    template's tool message and the model answers."""
    fresh(eng, "Be helpful.", (WEATHER,), tool_choice="required")
    greedy(eng, 60)
    turn = eng.say("What is the weather in Paris?")
    assert turn.complete.stop_reason == cf.StopReason.TOOL_CALL, turn.frames
    [call] = turn.of(cf.ToolCall)
    assert call.name == "get_weather" and not turn.of(cf.StreamContent)
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    greedy(eng, 8)
    follow = eng.turn(cf.ToolReturn(str(call.call_id), False, '{"temperature_c": 21}'))
    assert follow.complete.tokens > 0
    again = eng.reply(cf.ToolReturn(str(call.call_id), False, "twice"))
    assert again.message.code == cf.ErrorCode.MALFORMED_PAYLOAD
    fresh(eng)  # back to no tools


# ------------------------------------------------------------------------------ errors that go on


def test_unknown_opcode_and_malformed_payloads_are_answered_and_the_engine_goes_on(eng):
    eng.write(struct.pack("<IHHHHI", cf.MAGIC, cf.VERSION, 4242, 0x0077, 0, 0))
    err = eng.next_event()
    assert err.msg_id == 4242 and err.message.code == cf.ErrorCode.UNKNOWN_OPCODE
    eng.write(struct.pack("<IHHHHI", cf.MAGIC, cf.VERSION, 4243, int(cf.Op.SET_CONFIG), 0, 3) + b"abc")
    err = eng.next_event()
    assert err.msg_id == 4243 and err.message.code == cf.ErrorCode.MALFORMED_PAYLOAD
    bad_config = eng.reply(cf.SetConfig(temperature=-1.0))
    assert bad_config.message.code == cf.ErrorCode.MALFORMED_PAYLOAD
    assert eng.reply(cf.Ping()).message == cf.Pong()


def test_abort_and_mem_commit_while_idle(eng):
    eng.send(cf.Abort())  # nothing to stop: no reply
    commit = eng.send(cf.MemCommit())
    frames = eng.until(commit, cf.Status)
    assert frames.of(cf.Status)[0].status == cf.EngineStatus.CONSOLIDATING
    assert eng.reply(cf.Ping()).message == cf.Pong()


# ------------------------------------------------------------------------------ memory


def test_memory_commit_and_query(tmp_path):
    """Turns are staged at their end, MEM_COMMIT makes them durable (a new engine on the same
    state directory finds them), MEM_QUERY injects the best and says so."""
    e = ChannelEngine("--state-dir", str(tmp_path))
    try:
        empty = e.reply(cf.MemQuery(0, 3, 0, 0, 1.0, 0.0, 0.0, "dragons")).message
        assert empty.status == cf.MemStatus.ARCHIVE_EMPTY and empty.timestamps == ()
        greedy(e, 6)
        e.say("My cat is called Whiskers.")
        e.say("I like green tea.")
        e.send(cf.MemCommit())
    finally:
        assert e.close() == 0
    e = ChannelEngine("--state-dir", str(tmp_path))
    try:
        hit = e.reply(cf.MemQuery(0, 3, 0, 0, 1.0, 0.0, 0.0, "what is my cat called")).message
        assert hit.status == cf.MemStatus.OK and len(hit.timestamps) >= 1 and hit.total_injected_tokens > 0
        miss = e.reply(cf.MemQuery(0, 3, 0, 0, 1.0, 0.0, 0.0, "zeppelin")).message
        assert miss.status == cf.MemStatus.NO_MATCHES
        report = e.reply(cf.MemQuery(1, 3, 0, 0, 1.0, 0.0, 0.0, "cat")).message
        assert report.status == cf.MemStatus.OK and report.total_injected_tokens == 0
        odd = e.reply(cf.MemQuery(7, 3, 0, 0, 1.0, 0.0, 0.0, "cat")).message
        assert odd.code == cf.ErrorCode.UNSUPPORTED_FEATURE
    finally:
        assert e.close() == 0


def test_a_memory_that_cannot_be_written_is_an_internal_error(tmp_path):
    """The memory's file cannot be created (a directory took its name): MEM_COMMIT is ERROR INTERNAL
    with the reason, and the engine goes on."""
    (tmp_path / MEMORY_FILE).mkdir()
    e = ChannelEngine("--state-dir", str(tmp_path))
    try:
        greedy(e, 3)
        e.say("Remember this.")
        failed = e.reply(cf.MemCommit()).message
        assert failed.code == cf.ErrorCode.INTERNAL and "memory" in failed.detail
        assert e.reply(cf.Ping()).message == cf.Pong()
    finally:
        e.close()


# ------------------------------------------------------------------------------ snapshots


def test_snapshot_save_restart_load_continue(tmp_path):
    """A conversation saved, the engine stopped, a new one loads the snapshot and the next turn is
    the one the first engine gives (greedy), as if it had never stopped."""
    path = tmp_path / "conv.snap"
    e = ChannelEngine()
    try:
        greedy(e, 8)
        e.say("My name is Ann. Remember it.")
        saved = e.reply(cf.SnapshotSave(str(path), "stream-7")).message
        assert saved == cf.SnapshotStatus(int(cf.SnapshotState.SAVED), 1, saved.clock, "stream-7")
        assert saved.clock > 0
        expected = e.say("What is my name?").content
    finally:
        assert e.close() == 0
    e = ChannelEngine()
    try:
        greedy(e, 8)
        loaded = e.reply(cf.SnapshotLoad(str(path))).message
        assert loaded == cf.SnapshotStatus(int(cf.SnapshotState.LOADED), 1, saved.clock, "stream-7")
        assert e.say("What is my name?").content == expected
        fail = e.reply(cf.SnapshotLoad(str(tmp_path / "missing.snap"))).message
        assert fail.code == cf.ErrorCode.SNAPSHOT_LOAD_FAILED
        damaged = tmp_path / "damaged.snap"
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        damaged.write_bytes(bytes(raw))
        fail = e.reply(cf.SnapshotLoad(str(damaged))).message
        assert fail.code == cf.ErrorCode.SNAPSHOT_LOAD_FAILED and "checksum" in fail.detail
        nowhere = e.reply(cf.SnapshotSave(str(tmp_path / "no" / "such" / "dir" / ".." / "x"), "s")).message
        blocked = tmp_path / "file"
        blocked.write_text("x")
        not_a_dir = e.reply(cf.SnapshotSave(str(blocked / "snap"), "s")).message
        assert not_a_dir.code == cf.ErrorCode.SNAPSHOT_SAVE_FAILED, (nowhere, not_a_dir)
        assert e.reply(cf.Ping()).message == cf.Pong()  # the engine survived all of it
    finally:
        assert e.close() == 0


# ------------------------------------------------------------------------------ framing errors end it


@pytest.mark.parametrize("header, code", [
    (struct.pack("<IHHHHI", 0xDEADBEEF, 1, 9, 0x000E, 0, 0), cf.ErrorCode.BAD_MAGIC),
    (struct.pack("<IHHHHI", cf.MAGIC, 2, 9, 0x000E, 0, 0), cf.ErrorCode.BAD_VERSION),
    (struct.pack("<IHHHHI", cf.MAGIC, 1, 9, 0x0001, 0, cf.MAX_PAYLOAD + 1), cf.ErrorCode.PAYLOAD_TOO_LARGE),
], ids=["magic", "version", "length"])
def test_a_broken_stream_is_an_error_and_a_nonzero_exit_with_the_state_intact(tmp_path, header, code):
    e = ChannelEngine("--state-dir", str(tmp_path))
    try:
        greedy(e, 4)
        e.say("Hello there.")
        e.send(cf.MemCommit())
        assert e.reply(cf.Ping()).message == cf.Pong()  # the commit's STATUS frames are behind us
        before = kv_files(tmp_path)
        assert before, files_of(tmp_path)
        e.write(header)
        err = e.next_event()
        assert err.msg_id == 0 and err.message.code == code
        assert e.proc.wait(60) != 0
        assert kv_files(tmp_path) == before
        # the memory's file is SQLite's to lay out (a checkpoint at close moves pages): its turns are
        # what must be intact
        with EpisodicMemory(tmp_path / MEMORY_FILE) as memory:
            assert memory.stored == 1
    finally:
        e.close()


def kv_files(directory):
    return {k: v for k, v in files_of(directory).items() if k.startswith(".coli_kv")}


def test_shutdown_exits_zero(tmp_path):
    e = ChannelEngine("--state-dir", str(tmp_path))
    greedy(e, 3)
    e.say("Hi")
    e.send(cf.Shutdown())
    assert e.proc.wait(60) == 0
    e.close()


def test_the_codec_serves_the_host_side():
    """What the harness does, in one line: requests encoded and replies decoded by ``colibri.io``."""
    frame = channel.encode(3, cf.Ping())
    [event] = channel.FrameReader("inbound").receive_data(frame)
    assert event == cf.Frame(3, cf.Ping())
