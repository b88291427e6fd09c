"""The import contract (pyproject.toml, ``[tool.importlinter]``) holds on the tree, and fails on a
wrong-way import: run on a copy of the package with one such import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=300)


def copy_with(tmp_path: Path, module: str, line: str) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "colibri", tree / "colibri", ignore=shutil.ignore_patterns("__pycache__"))
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return tree


def test_the_tree_keeps_every_contract(tmp_path: Path):
    result = lint(copy_with(tmp_path, "colibri/errors.py", "# unchanged"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("colibri/store/experts.py", "import colibri.model.kernels.quant_matmul", "Layers"),
    ("colibri/model/loader.py", "import colibri.sched.engine", "Layers"),
    ("colibri/io/mux.py", "import colibri.store.gguf", "io:"),
    ("colibri/api/stop.py", "import colibri.sched.engine", "api:"),
    ("colibri/api/stop.py", "import colibri.model.loader", "api:"),
    ("colibri/sched/engine.py", "import colibri.store.experts", "sched:"),
])
def test_a_wrong_way_import_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str):
    result = lint(copy_with(tmp_path, module, line))
    assert result.returncode != 0
    broken = [ln for ln in result.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), result.stdout
