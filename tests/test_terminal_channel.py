"""``coli channel``, the terminal client of the Channel protocol, over the real engine and default model.

Each engine test is one start of the real ``coli channel`` (the engine a child of it), fed lines
on stdin: stdout holds the replies, stderr the stats lines, acknowledgements and errors.
"""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

from colibri.io import channel_frames as cf
from colibri.terminal_channel import Printer, parse_settings, stats_line, unescape

TIMEOUT = 180  # the first engine start compiles the numba kernels
COMMAND = [sys.executable, "-m", "colibri", "channel", "--no-persist", "--ctx", "1024"]
STATS = re.compile(r"^\[\d+ tokens, [\d.]+ tok/s, \d+ ms, ([a-z ]+)\]", re.M)


def _run(lines: str) -> tuple[int, str, str]:
    proc = subprocess.run(COMMAND, input=lines.encode(), capture_output=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def _read_some(proc: subprocess.Popen, n: int) -> bytes:
    """At least ``n`` bytes of stdout, within TIMEOUT (a hung client fails the test, not the suite)."""
    got, deadline = b"", time.monotonic() + TIMEOUT
    while len(got) < n:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no output within {TIMEOUT} s: {got!r}"
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        assert chunk, f"the client exited: {got!r}"
        got += chunk
    return got


def test_turns_thought_probe_ping_and_quit():
    rc, out, err = _run("/set temperature=0 max_tokens=12\n"
                        "What is the capital of France?\n"
                        "/think Why is the sky blue?\n"
                        "/probe 1 Is the sky blue?\n"
                        "/ping\n"
                        "/quit\n")
    assert rc == 0, err
    assert "Traceback" not in err
    assert "/think TEXT" in err  # the HELP
    assert "max_tokens=12" in err  # the /set acknowledgement
    lines = out.splitlines()
    assert "Paris" in lines[0]  # the answer streams to stdout
    assert any(line.startswith("[thought] ") and len(line) > 12 for line in lines)  # not a TTY: prefixed
    reasons = STATS.findall(err)
    assert len(reasons) == 2 and set(reasons) <= {"max tokens", "end of turn"}, err
    probe = next(line for line in lines if line.startswith("probe: "))
    assert re.match(r"probe: winner=\d+ confidence=[\d.]+ entropy=[\d.]+ cost_ms=[\d.]+", probe), probe
    assert any(re.fullmatch(r"pong \([\d.]+ ms\)", line) for line in lines)


def test_errors_and_ctrl_c_keep_the_client_going():
    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file)
        proc.stdin.write(b"/load /nonexistent/snap\n"  # the engine refuses: an ERROR frame
                         b"/return 7 nothing\n"  # no such tool call: ERROR
                         b"/set bogus=1\n"  # refused here, nothing sent
                         b"/frob\n"
                         b"/set temperature=0 max_tokens=400\n"
                         b"Write a long story about a dragon who bakes bread.\n")
        proc.stdin.flush()
        _read_some(proc, 20)  # the story is streaming
        proc.send_signal(signal.SIGINT)  # Ctrl-C: ABORT; the engine (its own session) never sees it
        out, _ = proc.communicate(b"/ping\n/quit\n", timeout=TIMEOUT)
        err_file.seek(0)
        err = err_file.read().decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert re.search(r"^error: SNAPSHOT_LOAD_FAILED: .+", err, re.M), err
    assert re.search(r"^error: MALFORMED_PAYLOAD: .*tool call", err, re.M), err
    assert "error: /set: 'bogus=1'" in err and "unknown command /frob" in err
    assert STATS.findall(err) == ["aborted"], err
    assert re.search(r"^pong \(", out.decode(), re.M)  # the engine still answers after the abort


def test_printer_settings_and_stats_without_an_engine():
    out = io.StringIO()
    printer = Printer(out, tty=False)
    printer.write("thought", b"I think\nso \xe2")  # a token ending inside a character
    printer.write("thought", b"\x9c\x93")
    printer.write("content", b"Yes, ")
    printer.write("content", "caf\u00e9".encode()[:-1])
    printer.end()
    assert out.getvalue() == "[thought] I think\n[thought] so \u2713\nYes, caf\ufffd\n"
    config = parse_settings(cf.SetConfig(), ["temperature=0", "top_k=5", "gate=on"])
    assert (config.temperature, config.top_k, config.top_p) == (0.0, 5, cf.SetConfig().top_p)
    assert config.flags & cf.CONFIG_THINKING_GATE
    assert not parse_settings(config, ["gate=off"]).flags & cf.CONFIG_THINKING_GATE
    for bad in (["top_k=x"], ["nope=1"], ["temperature"], ["gate=maybe"]):
        try:
            parse_settings(config, bad)
        except ValueError as e:
            assert bad[0] in str(e)
        else:
            raise AssertionError(bad)
    assert unescape(r"a\nb\\n\t") == "a\nb\\n\t"
    yielded = stats_line(cf.TurnComplete(9, 120, 75.0, cf.StopReason.ELASTIC_YIELD))
    assert yielded.startswith("[9 tokens, 75.0 tok/s, 120 ms, elastic yield]") and "/resume" in yielded
    assert stats_line(cf.TurnComplete(1, 1, 1.0, 9)).endswith("#9]")
