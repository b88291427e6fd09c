"""Unit tests of systemd's notify protocol (``colibri.api.sdnotify``) against a socket standing in
for systemd: every failure is a quiet False, never an exception."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

import pytest

from colibri.api import sdnotify


@pytest.fixture
def fake_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "n.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_sdnotify_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False


def test_sdnotify_path_socket(fake_systemd: socket.socket) -> None:
    assert sdnotify.ready()
    assert fake_systemd.recv(4096) == b"READY=1"
    assert sdnotify.status("loading\nexperts ✓")
    assert fake_systemd.recv(4096) == "STATUS=loading experts ✓".encode()
    assert sdnotify.watchdog()
    assert fake_systemd.recv(4096) == b"WATCHDOG=1"
    assert sdnotify.stopping()
    assert fake_systemd.recv(4096) == b"STOPPING=1"
    assert sdnotify.notify("READY=1\nSTATUS=up")
    assert fake_systemd.recv(4096) == b"READY=1\nSTATUS=up"


def test_sdnotify_empty_state_not_sent(fake_systemd: socket.socket) -> None:
    assert sdnotify.notify("") is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
def test_sdnotify_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"colibri-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert sock.recv(4096) == b"READY=1"
    assert sdnotify.ready() is False  # the listener is gone: False, no exception


@pytest.mark.parametrize(
    "value",
    ["", "@", "relative.sock", "vsock:2:1234", "/nonexistent/dir/notify.sock", "/tmp/\0bad"],
)
def test_sdnotify_unreachable_never_raises(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    if "\0" in value:
        monkeypatch.setattr(os, "environ", {**os.environ, "NOTIFY_SOCKET": value})
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False


def test_sdnotify_not_a_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "plain"
    f.write_text("")
    monkeypatch.setenv("NOTIFY_SOCKET", str(f))
    assert sdnotify.watchdog() is False


def test_sdnotify_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "junk")
    assert sdnotify.watchdog_interval() is None
