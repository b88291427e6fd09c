"""packaging/systemd/coli.service is a unit systemd accepts, of the type the server implements."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "packaging" / "systemd" / "coli.service"


def test_unit_declares_notify_and_drain():
    text = UNIT.read_text()
    assert "Type=notify" in text and "NotifyAccess=main" in text
    assert "KillSignal=SIGTERM" in text and "coli serve" in text
    assert "RestartPreventExitStatus=2" in text  # a configuration error is not retried for ever


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    # the unit names /opt/colibri; verify checks that ExecStart exists, so point it at this checkout
    coli = Path(sys.executable).parent / "coli"
    unit = tmp_path / "coli.service"
    unit.write_text(UNIT.read_text().replace("/opt/colibri/.venv/bin/coli", str(coli)))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "coli.service" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


TEMPLATE = UNIT.with_name("coli@.service")


def test_template_gives_each_instance_its_port_and_state():
    text = TEMPLATE.read_text()
    assert "--port %i" in text and "--replica-id %H:%i" in text
    assert "StateDirectory=colibri/%i" in text and "COLI_STATE_DIR=/var/lib/colibri/%i" in text
    assert "Type=notify" in text and "RestartPreventExitStatus=2" in text  # as the single unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_an_instance(tmp_path):
    coli = Path(sys.executable).parent / "coli"
    # an instance file beside its template: verify loads it as coli@8001 with %i = 8001
    unit = tmp_path / "coli@8001.service"
    unit.write_text(TEMPLATE.read_text().replace("/opt/colibri/.venv/bin/coli", str(coli)))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "coli@" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
