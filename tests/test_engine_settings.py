"""``coli engine`` started as the C engine is: the model from SNAP (a file, or a directory holding
one GGUF), CTX and NGEN, and the positional cap; their precedence against flags and ``COLI_*``.
The engine speaking to the gateway is tests/test_engine_gateway.py; here, the settings, and the
refusals that come before any model loads."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colibri import settings
from colibri.cli import build_parser
from colibri.errors import ConfigError
from colibri.store.experts import ExpertsPerLayer

ENGINE_VARS = ("SNAP", "CTX", "NGEN", "COLI_MODEL", "COLI_CTX", "COLI_MAX_TOKENS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENGINE_VARS:
        monkeypatch.delenv(name, raising=False)


def engine_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["engine", *argv])


def gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_snap_wins_over_coli_model_and_a_flag_over_both(monkeypatch, tmp_path: Path):
    a, b, c = gguf(tmp_path / "a.gguf"), gguf(tmp_path / "b.gguf"), gguf(tmp_path / "c.gguf")
    monkeypatch.setenv("COLI_MODEL", str(a))
    assert settings.model_path(engine_args(), host=True) == a
    monkeypatch.setenv("SNAP", str(b))
    assert settings.model_path(engine_args(), host=True) == b
    assert settings.model_path(engine_args("--model", str(c)), host=True) == c
    # only ``coli engine`` reads the C engine's variables
    assert settings.model_path(build_parser().parse_args(["run", "x"]), host=False) == a


def test_ctx_and_ngen_follow_the_same_order(monkeypatch):
    assert settings.resolve(engine_args(), settings.MAX_TOKENS, host=True) == 512
    monkeypatch.setenv("COLI_MAX_TOKENS", "100")
    assert settings.resolve(engine_args(), settings.MAX_TOKENS, host=True) == 100
    monkeypatch.setenv("NGEN", "64")
    assert settings.lookup(engine_args(), settings.MAX_TOKENS, host=True) == (64, "NGEN")
    assert settings.resolve(engine_args("--max-tokens", "7"), settings.MAX_TOKENS, host=True) == 7
    monkeypatch.setenv("COLI_CTX", "2048")
    monkeypatch.setenv("CTX", "1024")
    assert settings.lookup(engine_args(), settings.CTX, host=True) == (1024, "CTX")
    assert settings.lookup(engine_args(), settings.CTX, host=False) == (2048, "COLI_CTX")
    monkeypatch.setenv("CTX", "lots")
    with pytest.raises(Exception, match="CTX='lots' is not a valid int"):
        settings.resolve(engine_args(), settings.CTX, host=True)


def test_a_directory_with_one_gguf_is_that_file(tmp_path: Path):
    one = gguf(tmp_path / "one" / "model-q4_1.gguf")
    (tmp_path / "one" / "README.md").write_text("not a model")
    assert settings.model_file(tmp_path / "one", "SNAP") == one


@pytest.mark.parametrize(("layout", "message"), [
    ({"a.gguf": b"GGUF", "b.GGUF": b"GGUF"}, "holds 2 GGUF files (a.gguf, b.GGUF): name one"),
    ({"config.json": b"{}", "model.safetensors": b""},
     "is a Hugging Face checkpoint, which the engine does not load: convert it once with `coli convert"),
    ({"notes.txt": b""}, "is a directory with no GGUF file in it"),
    (None, "does not exist"),
])
def test_a_directory_that_is_not_one_model_is_refused_with_the_reason(tmp_path: Path, layout, message):
    where = tmp_path / "snap"
    if layout is not None:
        where.mkdir()
        for name, data in layout.items():
            (where / name).write_bytes(data)
    with pytest.raises(ConfigError, match="^" + re.escape(f"SNAP {str(where)!r} {message}")):
        settings.model_file(where, f"SNAP {str(where)!r}")


def test_the_cap_is_an_optional_positional_count():
    assert engine_args().cap is None
    assert engine_args("0").cap == 0
    assert engine_args("8", "--no-persist").cap == 8
    assert ExpertsPerLayer(8).n == 8


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["-1"], {}, "the cap (experts per MoE layer kept in RAM) must be >= 0, got -1"),
    (["4", "--ram-budget", "1"], {}, "give the cap (experts per MoE layer) or --ram-budget (GB), not both"),
    ([], {"NGEN": "0"}, "--max-tokens/COLI_MAX_TOKENS/NGEN must be positive, got 0"),
    ([], {"SNAP": "/no/such/model"}, "SNAP '/no/such/model' does not exist"),
    (["--draft-max", "4", "--draft-min", "5"], {},
     "--draft-min/COLI_DRAFT_MIN must be 0..--draft-max (4), got 5"),
    ([], {"COLI_DRAFT_MIN": "-1"}, "--draft-min/COLI_DRAFT_MIN must be 0..--draft-max (16), got -1"),
])
def test_refusals_come_before_the_model_loads(argv, env, message):
    proc = subprocess.run([sys.executable, "-m", "colibri", "engine", *argv, "--no-persist"],
                          env={**{k: v for k, v in os.environ.items() if k not in ENGINE_VARS}, **env},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"coli: error: {message}" and proc.stdout == ""


@pytest.mark.parametrize(("command", "module", "function"), [
    ("chat", "colibri.terminal_chat", "chat"), ("channel", "colibri.terminal_channel", "channel_chat")])
def test_the_terminal_clients_tell_their_engine_the_model_and_context(monkeypatch, tmp_path: Path, command,
                                                                       module, function):
    """``coli chat`` and ``coli channel`` start a ``coli engine`` that would read the C engine's SNAP
    and CTX: they pass the model and context their own rule resolves, so a shell that exports
    those for the C engine does not change what they run."""
    import importlib

    from colibri.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(importlib.import_module(module), function, lambda argv: seen.append(argv) or 0)
    monkeypatch.setenv("SNAP", str(gguf(tmp_path / "c-engine-model.gguf")))
    monkeypatch.setenv("CTX", "99")
    assert main([command]) == 0
    argv = seen[0]
    assert argv[argv.index("--model") + 1] == str(settings.default_model_path())
    assert argv[argv.index("--ctx") + 1] == str(settings.CTX.default)
