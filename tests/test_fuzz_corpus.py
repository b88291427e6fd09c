"""Replay the fuzzers' seed corpora (fuzz/corpus/) through their ``check`` functions: no atheris
needed, so every ``make test`` re-checks the invariants of fuzz/fuzz_mux.py and fuzz/fuzz_legacy.py
on the protocol's valid frames and known edge cases, those of fuzz/fuzz_http_body.py on request
bodies (valid ones, lone surrogates, deep nesting, huge integers, wrong types), and those of
fuzz/fuzz_channel.py on the Channel binary protocol's frames (every opcode, framing errors)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
HARNESSES = {"mux": "fuzz_mux.py", "legacy": "fuzz_legacy.py", "http": "fuzz_http_body.py",
             "channel": "fuzz_channel.py"}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"colibri_fuzz_{name}", FUZZ / HARNESSES[name])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = [(name, path) for name in HARNESSES for path in sorted((FUZZ / "corpus" / name).iterdir())
         if path.is_file()]


def test_corpora_are_seeded():
    for name in HARNESSES:
        assert len([c for c in CASES if c[0] == name]) >= 20, name


_loaded: dict = {}


def load_cached(name: str):
    if name not in _loaded:
        _loaded[name] = load(name)
    return _loaded[name]


@pytest.mark.parametrize(("name", "path"), CASES, ids=[f"{n}/{p.name}" for n, p in CASES])
def test_replay(name, path):
    load_cached(name).check(path.read_bytes())


@pytest.mark.parametrize("name", list(HARNESSES))
def test_harness_imports_without_atheris(name):
    module = load_cached(name)
    assert "atheris" not in vars(module)
    module.check(b"")
    module.check(b"\x07\x00\xff\n\x01\x02")
