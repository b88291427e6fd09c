"""Each coding agent's turn as a user sets it up: its scratch configuration, arguments and
environment, and what a test reads back from a turn (the requests it sent, its round trips).

Shared by ``test_clients_agents.py`` (the default model) and ``test_clients_agents_trained.py`` (the
tiny model trained on these very turns: ``tools/make_tiny_agent.py``, whose ``requests.json`` holds
the first requests these set-ups sent; a task changed here must be recorded there again).
"""

from __future__ import annotations

import json
from pathlib import Path

from agents_harness import Exchange, RecordingProxy, Run, agent_bin, run_agent, scratch_env

NOTES = "The secret word is lighthouse.\n"  # (tools/make_tiny_agent.py draws tool outputs alike)
SETTLE_S = 120  # an agent may exit with a request still running (opencode's title)
CODEX_TASK = "Use the exec_command tool to run `cat notes.txt`, then say the secret word."
OPENCODE_TASK = "Use the read tool to read notes.txt, then say the secret word."
CONTINUE_TASK = "Use the Read tool to read notes.txt, then say the secret word."
# Codex's own instructions (~4,000 tokens) replaced by these (`model_instructions_file`): with its
# tools they leave an 8,192-token model room for a tool loop (docs/api.md, "Coding agents").
CODEX_INSTRUCTIONS = """You are a coding agent in a terminal. Run commands with the tools to read and \
change files in the working directory. When the task is done, answer in one short sentence.
"""
# Codex's words when the model's answer reached its budget (the server's `response.incomplete`:
# 1,024 tokens when the request sets none, as Codex's never do).
CODEX_MODEL_ENDS = ("Incomplete response returned, reason: max_output_tokens",)

Setup = tuple[list[str], dict[str, str]]  # an agent's arguments and environment


def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(NOTES)
    return work


def turn(proxy: RecordingProxy, setup: Setup, cwd: Path, timeout: float) -> tuple[Run, list[Exchange]]:
    """Run the agent's turn; what it did and every request it sent, each ended."""
    mark = proxy.mark()
    run = run_agent(setup[0], cwd, setup[1], timeout)
    proxy.settle(SETTLE_S)
    return run, proxy.since(mark)


def round_trips(exchanges: list[Exchange]) -> list[str]:
    """Call ids an answer gave that a later request sent back as a tool result (chat's ``tool``
    message ``tool_call_id``; Responses' ``function_call_output`` ``call_id``)."""
    given: set[str] = set()
    back: list[str] = []
    for e in exchanges:
        body = e.body()
        results = [m.get("tool_call_id") for m in body.get("messages", []) if m.get("role") == "tool"]
        results += [i.get("call_id") for i in body.get("input", [])
                    if isinstance(i, dict) and i.get("type") == "function_call_output"]
        back += [r for r in results if r in given and r not in back]
        given |= e.call_ids
    return back


def no_envelope(run: Run) -> None:
    """The answer printed holds no raw ``{"tool_call": …`` envelope (a call cut by the budget)."""
    assert '"tool_call"' not in run.out, run.describe()


def codex(tmp_path: Path, model_id: str, base_url: str, trimmed: bool = True) -> Setup:
    """``codex exec`` through a ``wire_api = "responses"`` provider in a scratch ``CODEX_HOME``.
    ``trimmed``: short instructions, and the features whose tools a small model only derails on
    (goals, images, skills, subagents) off; else Codex's own instructions and features."""
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "instructions.md").write_text(CODEX_INSTRUCTIONS)
    trim = (
        f'model_instructions_file = "{home / "instructions.md"}"\n'
        "[features]\ngoals = false\nview_image = false\nskill_search = false\nimage_generation = false\n"
        # Its subagent tools (a `namespace` of ~2,500 tokens) are off too: an 8,192-token model.
        "[agents]\nenabled = false\n")
    (home / "config.toml").write_text(
        f'model = "{model_id}"\n'
        'model_provider = "colibri"\n'
        + (trim if trimmed else "")
        + "[analytics]\nenabled = false\n"
        "[model_providers.colibri]\n"
        'name = "colibri"\n'
        f'base_url = "{base_url}/v1"\n'
        'env_key = "COLIBRI_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"  # a refused request fails the turn at once, not after retries
        "stream_max_retries = 0\n")
    env = scratch_env(tmp_path / "home", CODEX_HOME=str(home), COLIBRI_API_KEY="local")
    return [str(agent_bin("codex")), "exec", "--skip-git-repo-check", CODEX_TASK], env


def opencode(work: Path, tmp_path: Path, model_id: str, base_url: str, trimmed: bool = True) -> Setup:
    """``opencode run`` with an ``@ai-sdk/openai-compatible`` provider and no ``limit`` on its model
    (so it asks for 32,000 max tokens). Its session title goes to a ``small_model`` entry, the same
    server with an output limit (unlimited, the default model's title ran 8 minutes on a loaded
    host). ``trimmed``: read-only tools, as a small model's calls run on this machine (and the
    prompt is ~3,000 tokens instead of ~7,700); else every tool of opencode's."""
    small = f"{model_id}-title"
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"colibri": {
            "npm": "@ai-sdk/openai-compatible", "name": "colibri",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": "local"},
            "models": {model_id: {"name": model_id},
                       # its session title: the same server, an answer of a title's length
                       small: {"name": small, "limit": {"context": 8192, "output": 32}}}}},
        "small_model": f"colibri/{small}",
    }
    if trimmed:
        config["tools"] = {name: False for name in ("bash", "edit", "write", "webfetch", "task",
                                                    "todowrite", "skill")}
        config["permission"] = {"bash": "deny", "edit": "deny", "webfetch": "deny",
                                "external_directory": "deny"}
    (work / "opencode.json").write_text(json.dumps(config))
    env = scratch_env(tmp_path / "home", OPENCODE_DISABLE_AUTOUPDATE="1")
    return [str(agent_bin("opencode")), "run", "-m", f"colibri/{model_id}", OPENCODE_TASK], env


def continue_cn(tmp_path: Path, model_id: str, base_url: str, trimmed: bool = True) -> Setup:
    """``cn -p`` with an ``openai`` provider at the server. ``trimmed``: plan mode (``--readonly``)
    without shell or web, as a small model's calls run on this machine; else cn's defaults."""
    config = tmp_path / "continue.yaml"
    config.write_text(
        "name: colibri\nversion: 0.0.1\nschema: v1\nmodels:\n"
        f"  - name: colibri\n    provider: openai\n    model: {model_id}\n"
        f"    apiBase: {base_url}/v1\n    apiKey: local\n    roles: [chat, edit, apply]\n"
        "    defaultCompletionOptions:\n      maxTokens: 512\n")
    trim = ["--readonly", "--exclude", "Bash", "--exclude", "Fetch"] if trimmed else []
    args = [str(agent_bin("cn")), "--config", str(config), *trim, "-p", CONTINUE_TASK]
    return args, scratch_env(tmp_path / "home")
