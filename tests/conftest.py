"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri.settings import default_model_path

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def model(model_path: Path):
    from colibri.model.loader import Model

    return Model(model_path)


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads((DATA / "golden" / "smollm2-llamacpp.json").read_text())
