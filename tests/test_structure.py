"""The tree stays readable: modules and functions of a size one can hold in mind.

A module over MAX_MODULE_LINES holds more than one concept; a function over MAX_FUNCTION_LINES
must say why it is kept whole, in a docstring sentence starting with KEPT_WHOLE (a numba kernel
whose loop nest must stay one compiled unit, say).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("colibri", "tests", "bench", "tools", "fuzz")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
KEPT_WHOLE = "Kept whole:"


def _modules() -> list[Path]:
    out = []
    for tree in TREES:
        out += [p for p in (ROOT / tree).rglob("*.py") if "data" not in p.relative_to(ROOT).parts]
    return sorted(out)


def test_the_scan_finds_the_tree():
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert "colibri/cli.py" in names and "tests/test_structure.py" in names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{lines} lines: split it by concept"


def _long_functions(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if length > MAX_FUNCTION_LINES and KEPT_WHOLE not in doc:
                out.append(f"{node.name} ({length} lines)")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_function_size(path: Path):
    assert _long_functions(path.read_text()) == []


def test_the_function_check_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n") == ["f (61 lines)"]
    kept = f'def f():\n    """{KEPT_WHOLE} a reason."""\n{body}\n'
    assert _long_functions(kept) == []
