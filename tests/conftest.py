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


# -- the real server a test module shares: it names its flags as SERVER_ARGS (default: the harness's)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest):
    from serve_harness import SHARED_SERVER_ARGS, running_server

    with running_server(*getattr(request.module, "SERVER_ARGS", SHARED_SERVER_ARGS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h

