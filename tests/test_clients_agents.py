"""Coding agents, unchanged, against ``coli serve`` on the default model: each finishes a turn.

The real clients as a user runs them non-interactively, installed by the Makefile's agents stamp
(``agents_harness``): ``codex exec`` (OpenAI Codex CLI, Responses API only) with a provider block in
a scratch ``CODEX_HOME``; ``opencode run`` with a provider in a scratch ``opencode.json`` and no
``limit`` (so it asks for 32,000 max tokens); Continue's ``cn -p`` with a scratch ``config.yaml``;
``aider --message`` in a scratch git repository. Each talks to the server through a recording proxy,
so the test sees every request it sent and the status it got.

What is asserted is the protocol, not the answers (a 135M model's are poor). aider (no tools):
exit 0, every request answered 2xx. The tool-using agents (Codex, opencode, Continue): a tool
round trip (an answer's call id came back in a later request as that call's result), every
request answered 2xx, no raw ``{"tool_call": …`` envelope printed as the answer, and exit 0 — or,
where the model's own answers ended the turn, the client's report of that: after a tool's result
this model mostly calls tools again until the context is full (the server then answers the 400
``context_length_exceeded`` that OpenAI gives; Continue and Codex stop there, opencode compacts
and goes on until the test stops it), or rambles inside a call until its answer's budget (Codex
says so; measured on Codex: 2 of 14 turns exited 0, both without a call). That the clients'
turns end with exit 0 when the model ends them is ``test_clients_agents_trained.py``'s, on a tiny
model trained on these turns. The tasks ask for a tool by name so the model is likely to call
one; as it samples, a turn without a call is repeated (up to TURNS, each one checked), its
prompt's prefix still in a KV slot. ``make test`` takes one turn each (``COLI_AGENT_TURNS=1``),
stopped at 150 s (``COLI_AGENT_TURN_S``): that turn's requests and ending are checked, and the
round trip is asserted by ``make test-long`` here and by ``test_clients_agents_trained.py`` on
every run (greedy, deterministic). One server
for the module, at its default context (the model's own: 8,192 tokens; Codex's prompt with its
own instructions is ~6,500 tokens, with the test's short ones ~2,700; opencode's ~7,700 with every
tool, ~3,000 with the read-only ones). A failure prints the exchanges, each request's status and
the start of its answer.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import agents_clients
import pytest
from agents_clients import (
    CODEX_MODEL_ENDS,
    Setup,
    codex,
    continue_cn,
    no_envelope,
    opencode,
    round_trips,
    turn,
)
from agents_harness import Exchange, RecordingProxy, Run, aider_bin, scratch_env
from serve_harness import running_server

CODEX_S = 600
OPENCODE_S = 90  # a turn of a model that keeps calling tools is stopped here (a round trip takes ~25 s)
CONTINUE_S = 360
AIDER_S = 240
# Turns of a tool-using agent, until one makes a tool round trip (one without a call is quick,
# ~25 s): the model samples, and opencode's turns made no call six times in a row in one CI run.
# Repeated turns cost the suite up to 500 s of a CI run, so `make test` takes one (FAST_COUNTS).
TURNS = int(os.environ.get("COLI_AGENT_TURNS", "10"))
# Where a turn of a tool-using agent is stopped at the latest, beside each client's own time: a
# model that keeps calling tools runs its turn until the context is full (Codex: 116 and 208 s in
# two CI runs), so `make test` stops each at 150 s (FAST_COUNTS; a round trip takes ~25 s).
TURN_CAP_S = float(os.environ.get("COLI_AGENT_TURN_S", "inf"))


@pytest.fixture(scope="module")
def proxied():
    """``coli serve`` with its defaults (but no persistence) behind a recording proxy."""
    with running_server() as server:
        proxy = RecordingProxy(server.base_url).start()
        try:
            yield server, proxy
        finally:
            proxy.stop()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return agents_clients.workdir(tmp_path)


def check_turn(run: Run, exchanges: list[Exchange], path: str) -> None:
    """Exit 0, at least one request to ``path``, every request answered 2xx."""
    report = f"{run.describe()}\n--- requests\n{RecordingProxy.report(exchanges)}"
    assert run.code == 0, report
    assert any(e.path == path for e in exchanges), report
    failed = [e for e in exchanges if not 200 <= e.status < 300]
    assert not failed, f"answered non-2xx:\n{RecordingProxy.report(failed)}\n\n{report}"


def check_tool_turn(run: Run, exchanges: list[Exchange], path: str, model_ends: tuple[str, ...],
                    ending_tools: tuple[str, ...] = ()) -> None:
    """A tool-using agent's turn: requests to ``path``, each answered 2xx or, where the model's tool
    loop outgrew the context, OpenAI's 400 ``context_length_exceeded``; no raw envelope printed.
    Exit 0, or else an end that is the model's: that 400 came (Continue and Codex stop there), the
    client says the answer was cut by its budget (``model_ends``: the client's own words), the
    model called a tool that ends the client (``ending_tools``: Continue's ``Exit``, after which
    ``cn -p`` exits 1 saying nothing), or the client was still looping when the test stopped it
    (opencode compacts its history at the context's end and goes on calling tools). Never a
    refused field."""
    report = f"{run.describe()}\n--- requests\n{RecordingProxy.report(exchanges)}"
    assert any(e.path == path for e in exchanges), report
    refused = [e for e in exchanges if not 200 <= e.status < 300]
    for e in refused:
        assert e.status == 400 and b"context_length_exceeded" in e.answer, f"refused:\n{report}"
    if run.code != 0:
        stopped = run.code == -1
        ended = any(f'"name": "{name}"'.encode() in e.answer for e in exchanges for name in ending_tools)
        assert refused or stopped or ended or any(end in run.out + run.err for end in model_ends), report
    no_envelope(run)


def tool_turns(proxy: RecordingProxy, setup: Setup, cwd: Path, timeout: float, path: str,
               model_ends: tuple[str, ...] = (), ending_tools: tuple[str, ...] = ()) -> None:
    """Turns until one holds a tool round trip, at most TURNS, every one checked
    (``check_tool_turn``). The model samples (temperature 1 unless the client sets one): it may
    answer in text, or call tools until the context is full; a repeated turn starts quickly, its
    prompt's prefix in a KV slot. With one turn (``make test``) only that turn's checks apply: a
    round trip is then one sampled turn's luck, asserted where turns repeat."""
    seen = []
    for _ in range(TURNS):
        run, exchanges = turn(proxy, setup, cwd, min(timeout, TURN_CAP_S))
        check_tool_turn(run, exchanges, path, model_ends, ending_tools)
        if round_trips(exchanges):
            return
        seen.append(f"{run.describe()}\n--- requests\n{RecordingProxy.report(exchanges)}")
    if TURNS > 1:
        raise AssertionError(f"no tool result answered a call the server made, in {TURNS} turns:\n"
                             + "\n\n".join(seen))


def test_codex_exec(proxied, workdir, tmp_path):
    """``codex exec`` through a ``wire_api = "responses"`` provider: its requests with ``include``,
    ``client_metadata``, ``reasoning.summary`` and a ``web_search`` tool, then its tool results, and
    a command's result sent back as a ``function_call_output``."""
    server, proxy = proxied
    setup = codex(tmp_path, server.model_id, proxy.base_url)
    tool_turns(proxy, setup, workdir, CODEX_S, "/v1/responses", CODEX_MODEL_ENDS)


def test_opencode_run(proxied, workdir, tmp_path):
    """``opencode run`` with no ``limit`` on its model: its agent loop (``max_tokens: 32000``,
    capped to what the context leaves) answered, a tool's result sent back. A turn whose model keeps
    calling tools does not end (opencode compacts its history at the context's end and goes on,
    ``steps`` or not): the test stops it after OPENCODE_S."""
    server, proxy = proxied
    setup = opencode(workdir, tmp_path, server.model_id, proxy.base_url)
    tool_turns(proxy, setup, workdir, OPENCODE_S, "/v1/chat/completions")


def test_continue_cn(proxied, workdir, tmp_path):
    """``cn -p`` with an ``openai`` provider at the server: its tool loop all 2xx, a tool's result
    sent back, and no raw ``{"tool_call": …`` envelope printed as the answer."""
    server, proxy = proxied
    setup = continue_cn(tmp_path, server.model_id, proxy.base_url)
    tool_turns(proxy, setup, workdir, CONTINUE_S, "/v1/chat/completions", ending_tools=("Exit",))


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args],
                   cwd=repo, check=True, capture_output=True)


def test_aider_message(proxied, workdir, tmp_path):
    """``aider --message`` on ``openai/<model>`` with ``OPENAI_API_BASE`` in a scratch git repository:
    the edit request (streamed) answered 2xx and aider exits 0; no tools (aider edits by text)."""
    server, proxy = proxied
    git(workdir, "init", "-q")
    git(workdir, "add", "notes.txt")
    git(workdir, "commit", "-qm", "notes")
    settings = tmp_path / "aider.model.settings.yml"
    settings.write_text(f"- name: openai/{server.model_id}\n  extra_params:\n    max_tokens: 256\n")
    env = scratch_env(tmp_path / "home", OPENAI_API_BASE=f"{proxy.base_url}/v1", OPENAI_API_KEY="local",
                      GIT_AUTHOR_NAME="test", GIT_AUTHOR_EMAIL="test@example.invalid",
                      GIT_COMMITTER_NAME="test", GIT_COMMITTER_EMAIL="test@example.invalid")
    args = [str(aider_bin()), "--model", f"openai/{server.model_id}", "--model-settings-file",
            str(settings), "--no-check-update", "--no-analytics", "--yes-always", "--no-gitignore",
            "--no-show-model-warnings", "--no-pretty", "--no-fancy-input", "--map-tokens", "0",
            "notes.txt", "--message", "Add a line saying hello to notes.txt."]
    run, exchanges = turn(proxy, (args, env), workdir, AIDER_S)
    check_turn(run, exchanges, "/v1/chat/completions")
    assert not re.search(r"BadRequestError|APIError|litellm\.\w+Error", run.out + run.err), run.describe()
