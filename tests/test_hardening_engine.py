"""A configuration that cannot work fails at once with one error line and
exit status 2 (no restart loop), and the engine bounds what one SUBMIT can make it hold."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from engine_harness import EngineProcess, chat_prompt, engine_args
from serve_harness import server_env

from colibri.io.events import Cancel, Error, ErrorCode, Submit
from colibri.io.mux import encode_request
from colibri.model.text import ModelText
from colibri.settings import default_model_path

QUICK_S = 30  # "within seconds": a restart loop would never end; a cold numba cache is not involved


def coli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "colibri", *args], capture_output=True, text=True,
                          timeout=QUICK_S, env=env or server_env())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("coli: error:")]


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["engine"], ["chat"]])
@pytest.mark.parametrize("make", ["file", "under_a_file"])
def test_a_bad_state_dir_is_one_error_and_exit_2(tmp_path: Path, command: list[str], make: str):
    afile = tmp_path / "afile"
    afile.write_text("")
    state = afile if make == "file" else afile / "sub"
    start = time.monotonic()
    result = coli(*command, "--state-dir", str(state))
    assert result.returncode == 2, result.stderr
    assert error_lines(result.stderr) == result.stderr.strip().splitlines()
    assert len(error_lines(result.stderr)) == 1 and str(state) in result.stderr
    assert time.monotonic() - start < QUICK_S


def test_a_missing_model_is_one_error_and_exit_2(tmp_path: Path):
    result = coli("serve", "--port", "0", "--model", str(tmp_path / "nothing.gguf"))
    assert result.returncode == 2 and len(error_lines(result.stderr)) == 1


def test_an_engine_that_cannot_start_stops_the_server_with_its_message():
    """The server validates what it can; what only the engine sees (here COLI_PREFILL_CHUNK=0) makes
    it fail at start the same way twice: the server stops with its message instead of looping."""
    result = coli("serve", "--port", "0", "--no-persist", env=server_env(COLI_PREFILL_CHUNK="0"))
    assert result.returncode == 2, result.stderr
    assert error_lines(result.stderr)[-1] == (
        "coli: error: the engine cannot start: --ctx and --prefill-chunk must be positive")
    assert "serving" not in result.stderr


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_a_payload_past_the_context_is_refused_before_it_is_read(nursery):
    """A 16 MiB SUBMIT read and tokenized would cost 4.4 GB and 21 s before CONTEXT_EXCEEDED; its
    size alone condemns it: BAD_REQUEST, the payload skipped unbuffered, RSS bounded."""
    engine = await EngineProcess.start(nursery, *engine_args(None, ctx=512))
    before = vm_hwm_mb(engine.proc.pid)
    big = "word " * ((16 << 20) // 5)
    await engine.submit(1, big)
    out = await engine.result(1)
    assert isinstance(out.final, Error) and out.final.code == ErrorCode.BAD_REQUEST
    assert vm_hwm_mb(engine.proc.pid) - before < 64  # the 16 MiB were never held
    ok = await engine.run(2, chat_prompt("Say hi."), max_tokens=4)  # the stream is in step
    assert ok.final is not None and not isinstance(ok.final, Error)


async def test_a_count_of_a_terabyte_does_not_kill_the_stream(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None))
    await engine.send(f"SUBMIT 3 0 {10**12} 4 0.0 1.0\n".encode())
    await engine.send(encode_request(Cancel(99)))  # read as a line: answered, the stream is alive
    with trio.fail_after(30):
        while not any(e.id == 99 for e in engine.errors):
            await trio.sleep(0.05)
    assert [(e.id, e.code) for e in engine.errors] == [(3, ErrorCode.BAD_REQUEST), (99, ErrorCode.NOT_FOUND)]


async def test_submit_ids_generates_as_the_same_prompt_in_text(nursery):
    engine = await EngineProcess.start(nursery, *engine_args(None, slots=2))
    prompt = chat_prompt("Name a colour.")
    ids = tuple(ModelText.open(default_model_path()).tokenizer.encode(prompt, special=True))
    text = await engine.run(1, prompt, max_tokens=12)
    await engine.send(encode_request(Submit(2, 1, 12, 0.0, 1.0, "", None, ids)))
    by_ids = await engine.result(2)
    assert by_ids.text == text.text and by_ids.final.prompt_tokens == len(ids)
    await engine.send(encode_request(Submit(3, 1, 12, 0.0, 1.0, "", None, (1, 10**9))))
    out = await engine.result(3)
    assert isinstance(out.final, Error) and out.final.code == ErrorCode.BAD_REQUEST  # not a token

