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


TEMPLATE = UNIT.with_name("coli@.service")


def test_template_gives_each_instance_its_port_and_state():
    text = TEMPLATE.read_text()
    assert "--port %i" in text and "--replica-id %H:%i" in text
    assert "StateDirectory=colibri/%i" in text and "COLI_STATE_DIR=/var/lib/colibri/%i" in text
    assert "Type=notify" in text and "RestartPreventExitStatus=2" in text  # as the single unit


# The units name /opt/colibri; verify checks that ExecStart exists, so each is pointed at this
# checkout. An instance file beside its template loads as coli@8001, with %i = 8001.
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("source,name,marker", [(UNIT, "coli.service", "coli.service"),
                                                (TEMPLATE, "coli@8001.service", "coli@")],
                         ids=["unit", "instance"])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, source: Path, name: str, marker: str):
    coli = Path(sys.executable).parent / "coli"
    unit = tmp_path / name
    unit.write_text(source.read_text().replace("/opt/colibri/.venv/bin/coli", str(coli)))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if marker in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
