"""Coding agents, unchanged, against ``coli serve`` on a model that ends its tool turns: exit 0.

The default model mostly calls tools again after a tool's result until the context is full
(``test_clients_agents.py``), so there a turn's end is the model's doing. Here the server runs the
tiny model trained on these clients' own turns (``tests/data/tiny_hf/agent``,
``tools/make_tiny_agent.py``): on the task it calls the client's file tool, on the result it answers
in words. So every part but the model's wits is the real one — the clients from npm at their pinned
releases, their requests and settings as a user's (``agents_clients``), ``coli convert``'s file, the
engine's forward pass, the grammar-held tool envelope, the HTTP server behind a recording proxy —
and each turn must end as a user expects: exit 0 after one round trip (the call's id back as its
result), every request answered 2xx, the model's answer printed, no raw envelope. Greedy decoding
(``--temperature 0``: none of these clients sends a temperature), so one turn each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agents_clients import codex, continue_cn, no_envelope, opencode, round_trips, turn, workdir
from agents_harness import RecordingProxy
from serve_harness import running_server

from colibri.cli import main

SRC = Path(__file__).parent / "data" / "tiny_hf" / "agent"
LEARNED = {c["name"]: c["reply"]
           for c in json.loads((SRC / "conversations.json").read_text())["conversations"]}
ANSWER = json.loads(LEARNED["codex-answer"].removesuffix("<|im_end|>"))["response"]
TURN_S = 300  # a turn is seconds long; this bounds a hung one


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    model = tmp_path_factory.mktemp("agent") / "agent.gguf"
    assert main(["convert", str(SRC), "-o", str(model), "--type", "f32"]) == 0
    with running_server("--model", str(model), "--temperature", "0") as server:
        proxy = RecordingProxy(server.base_url).start()
        try:
            yield server, proxy
        finally:
            proxy.stop()


def check_exit_0(proxy: RecordingProxy, setup, work: Path, path: str) -> None:
    run, exchanges = turn(proxy, setup, work, TURN_S)
    report = f"{run.describe()}\n--- requests\n{RecordingProxy.report(exchanges)}"
    assert run.code == 0, report
    assert any(e.path == path for e in exchanges), report
    failed = [e for e in exchanges if not 200 <= e.status < 300]
    assert not failed, f"answered non-2xx:\n{RecordingProxy.report(failed)}\n\n{report}"
    assert len(round_trips(exchanges)) == 1, report
    assert ANSWER in run.out, report
    no_envelope(run)


# The clients as the default model's tests trim them (short instructions, read-only tools), and as
# they come (Codex's own ~4,000-token instructions and every feature's tools, opencode's every
# tool, cn outside plan mode): the model calls the file tool either way, which runs read-only.
SETTINGS = pytest.mark.parametrize("trimmed", [True, False], ids=["trimmed", "as-installed"])


@SETTINGS
def test_codex_exec_runs_the_command_and_exits_0(proxied, tmp_path, trimmed):
    server, proxy = proxied
    work = workdir(tmp_path)
    check_exit_0(proxy, codex(tmp_path, server.model_id, proxy.base_url, trimmed), work, "/v1/responses")


@SETTINGS
def test_opencode_run_reads_the_file_and_exits_0(proxied, tmp_path, trimmed):
    server, proxy = proxied
    work = workdir(tmp_path)
    check_exit_0(proxy, opencode(work, tmp_path, server.model_id, proxy.base_url, trimmed), work,
                 "/v1/chat/completions")


@SETTINGS
def test_continue_cn_reads_the_file_and_exits_0(proxied, tmp_path, trimmed):
    server, proxy = proxied
    work = workdir(tmp_path)
    check_exit_0(proxy, continue_cn(tmp_path, server.model_id, proxy.base_url, trimmed), work,
                 "/v1/chat/completions")
