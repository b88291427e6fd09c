"""Simon Willison's ``llm`` CLI, unchanged, against ``coli serve``.

The server is registered as an OpenAI-compatible model the documented way: an
``extra-openai-models.yaml`` (``api_base``, ``supports_schema``, ``supports_tools``) in a private
``LLM_USER_PATH``. Then the real CLI runs as a subprocess: a prompt, ``llm chat`` fed by stdin (the
second turn carries the first), ``--schema`` (llm's DSL and a JSON schema), and a Python function
given with ``--functions`` that the model calls and llm runs, the result going back in the chain.
What llm logged (``llm logs --json``) is read back to check what it saw. One real server, shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

MODEL = "colibri"
TIMEOUT = 120
FUNCTIONS = '''
import json, os

def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    with open(os.environ["COLI_TEST_TOOL_LOG"], "a") as f:
        f.write(json.dumps({"a": a, "b": b}) + "\\n")
    return a * b
'''


@pytest.fixture(scope="module")
def llm_env(server, tmp_path_factory) -> dict[str, str]:
    """The environment of an ``llm`` that knows the server as model ``colibri`` (and nothing else:
    no key, no plugins, its own database)."""
    home = tmp_path_factory.mktemp("llm-user")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: {MODEL}\n"
        f"  model_name: {server.model_id}\n"
        f"  api_base: {server.base_url}/v1\n"
        "  supports_schema: true\n"
        "  supports_tools: true\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LLM_"))}
    env.update(LLM_USER_PATH=str(home), LLM_LOAD_PLUGINS="", COLI_TEST_TOOL_LOG=str(home / "tool.log"))
    return env


def llm(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    """Run the real ``llm`` CLI; its stdout (a non-zero exit fails the test with its stderr)."""
    r = subprocess.run([sys.executable, "-m", "llm", *args], env=env, input=stdin, text=True,
                       capture_output=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"llm {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def logged(env: dict[str, str], count: int) -> list[dict]:
    """The last ``count`` responses llm logged, oldest first."""
    return json.loads(llm(env, "logs", "-n", str(count), "--json"))


def test_prompt(llm_env):
    """``llm -m colibri PROMPT``: the reply is printed and logged with its usage."""
    out = llm(llm_env, "-m", MODEL, "-o", "max_tokens", "8", "-o", "temperature", "0", "Say hi")
    assert out.strip()
    [entry] = logged(llm_env, 1)
    assert entry["model"] == MODEL and entry["response"].strip() == out.strip()
    assert entry["output_tokens"] == 8 and entry["input_tokens"] > 0


def test_chat_from_stdin(llm_env):
    """``llm chat`` fed two lines then ``quit``: two replies in one conversation, the second
    prompt carrying the first turn (its input is longer than the first turn's input and reply)."""
    out = llm(llm_env, "chat", "-m", MODEL, "-o", "max_tokens", "8", "-o", "temperature", "0",
              stdin="My name is Ann.\nWhat is my name?\nquit\n")
    assert out.startswith("Chatting with colibri"), out
    first, second = logged(llm_env, 2)
    assert first["prompt"] == "My name is Ann." and second["prompt"] == "What is my name?"
    assert first["conversation_id"] == second["conversation_id"]
    assert first["response"] and second["response"]
    assert second["input_tokens"] > first["input_tokens"] + first["output_tokens"], (first, second)


@pytest.mark.parametrize("schema, temperature", [
    # llm's DSL has no string bounds: sampled, the default model may ramble inside the free string
    # until max_tokens cuts it, so this one is greedy; the bounded JSON schema is sampled
    ("name, age int", "0"),
    (json.dumps({"type": "object",
                "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["colour", "count"], "additionalProperties": False}), "1"),
], ids=["dsl", "json-schema"])
def test_schema(llm_env, schema, temperature):
    """``--schema`` (llm's DSL or a JSON schema): llm sends it as a ``json_schema``
    response_format; the printed reply parses and validates against the schema llm logged."""
    out = llm(llm_env, "-m", MODEL, "--schema", schema, "-o", "max_tokens", "150",
              "-o", "temperature", temperature, "Invent one")
    [entry] = logged(llm_env, 1)
    assert entry["response_json"]["finish_reason"] == "stop", entry["response_json"]
    assert entry["schema_json"]["required"], entry["schema_json"]
    jsonschema.validate(json.loads(out), entry["schema_json"])


def test_tools_with_functions(llm_env):
    """``--functions``: the model calls ``multiply`` with integer arguments, llm runs it and sends
    the result back in the chain's next request, which the server takes (a refused history would be
    an HTTP error, not another call); no call envelope leaks into what llm prints.

    The default model (135M, no tool training) does not stop calling: given the result it asks for
    the same call again, at temperature 0 and 1, whatever the system prompt says (tried: four
    prompts). So llm's own guard, the chain limit, is what ends the chain here, and the test holds
    llm to that: a clean exit, or "Chain limit of 2 exceeded", which llm says only once the second
    response, to the request carrying the first result, came back as another call."""
    log = Path(llm_env["COLI_TEST_TOOL_LOG"])
    log.unlink(missing_ok=True)
    r = subprocess.run(
        [sys.executable, "-m", "llm", "-m", MODEL, "--functions", FUNCTIONS, "--cl", "2", "--td",
         "-o", "max_tokens", "120", "-o", "temperature", "0",
         "-s", "Use the multiply tool to answer.", "What is 6 times 7?"],
        env=llm_env, text=True, capture_output=True, timeout=TIMEOUT)
    assert log.exists(), f"multiply was never called; llm printed:\n{r.stdout}\n{r.stderr}"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for args in calls:
        jsonschema.validate(args, {
            "type": "object", "required": ["a", "b"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    first = calls[0]
    # --td prints each execution (on stderr): the call llm parsed and the result it sends back
    assert f"multiply({{'a': {first['a']}, 'b': {first['b']}}})" in r.stderr, r.stderr
    assert f"\n  {first['a'] * first['b']}\n" in r.stderr, r.stderr
    assert '"tool_calls"' not in r.stdout and '"arguments"' not in r.stdout, r.stdout
    if r.returncode != 0:
        assert "Chain limit of 2 exceeded" in r.stderr, r.stderr
    else:
        recent = logged(llm_env, 5)
        chain = [e for e in recent if e["conversation_id"] == recent[-1]["conversation_id"]]
        assert chain[-1]["tool_results"][0]["output"] == str(first["a"] * first["b"]), chain
