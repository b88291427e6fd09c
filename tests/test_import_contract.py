"""The layers as the running processes have them: the API process of ``coli serve`` never loads the
scheduler, numba or the kernels (the engine child does), and the codecs in ``colibri.io`` import
nothing of ours. ``lint-imports`` (``make test``) holds the static arrows; this checks what a real
server, having answered a chat and served the console, actually imported."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grimp
from serve_harness import STARTUP_TIMEOUT, ServerProcess, serve_command, server_env, user

# What only the engine process may load (DESIGN.md: "the API never touches a tensor").
ENGINE_ONLY = ("numba", "llvmlite", "colibri.sched", "colibri.model.kernels", "colibri.model.network",
               "colibri.model.loader", "colibri.store.packed", "colibri.store.experts")


def _imported(stderr_lines: list[str]) -> set[str]:
    """Module names from ``python -X importtime``'s report (``import time: self | cumulative | name``)."""
    out = set()
    for line in stderr_lines:
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name and name != "imported package":
                out.add(name)
    return out


def _start_traced_server() -> ServerProcess:
    cmd = serve_command()
    cmd[1:1] = ["-X", "importtime"]  # this process only: the engine child is started without it
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=server_env(), start_new_session=True)
    server = ServerProcess(proc)
    threading.Thread(target=server._drain, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not server._serving.wait(0.1):
        assert proc.poll() is None, server.log
        assert time.monotonic() < deadline, server.log
    return server


def test_the_api_process_loads_no_engine_code():
    server = _start_traced_server()
    try:
        reply = server.client().chat.completions.create(model="m", messages=user("Hi"), max_tokens=4)
        assert reply.choices[0].message.content is not None
        with server.http() as http:
            assert http.get("/").status_code == 200
            assert http.get("/health").status_code == 200
        assert server.stop() == 0
    finally:
        server.kill()
    imported = _imported(server.lines)
    assert "colibri.api.http_server" in imported and "trio" in imported  # the report was read
    loaded = sorted(m for m in imported if any(m == p or m.startswith(p + ".") for p in ENGINE_ONLY))
    assert loaded == []


def test_the_report_parser_sees_an_engine_import():
    """The check above can fail: the same report of a process that imports the scheduler names it."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", "import colibri.sched.engine"],
                         capture_output=True, text=True, check=True)
    imported = _imported(run.stderr.splitlines())
    assert "colibri.sched.engine" in imported and "numba" in imported


def test_the_codecs_import_nothing_of_ours():
    graph = grimp.build_graph("colibri")
    outside = {(m, i) for m in graph.find_descendants("colibri.io") | {"colibri.io"}
               for i in graph.find_modules_directly_imported_by(m)
               if i.startswith("colibri") and not (i == "colibri.io" or i.startswith("colibri.io."))}
    assert outside == set()
