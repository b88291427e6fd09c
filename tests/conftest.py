"""Shared fixtures: the real default model, loaded once per test session; the real servers."""

from __future__ import annotations

import json
from contextlib import ExitStack
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


# -- the real servers the end-to-end modules share. A module names its flags as SERVER_ARGS (default:
# the harness's SHARED_SERVER_ARGS); the modules that name the same flags share one server for the
# whole session (each start loads the model and warms the engine: seconds apiece), so a module must
# leave its server as it found it (no signals, no settings). The servers stop at the session's end,
# each with SIGTERM, which must exit 0.


@pytest.fixture(scope="session")
def shared_servers():
    """The session's servers by their flags: a function from the flags to the running server."""
    from serve_harness import running_server

    servers: dict[tuple[str, ...], object] = {}
    with ExitStack() as stack:
        def get(*args: str):
            if args not in servers:
                servers[args] = stack.enter_context(running_server(*args))
            return servers[args]

        yield get


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, shared_servers):
    from serve_harness import SHARED_SERVER_ARGS

    return shared_servers(*getattr(request.module, "SERVER_ARGS", SHARED_SERVER_ARGS))


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h

