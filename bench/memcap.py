"""A memory cap for one benchmark process, the way this machine allows: a cgroup limiting RSS plus
page cache, as a small machine's RAM would.

``MemoryCap.detect()`` picks the first method that works here, and says which:

- cgroup v2: a child of this process's cgroup in the unified hierarchy, ``memory.max`` (and
  ``memory.swap.max = 0``), peak from ``memory.peak`` where the kernel has it;
- cgroup v1: a child of the memory controller's hierarchy, ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` where swap accounting is on), peak ``memory.max_usage_in_bytes``;
- ``systemd-run --scope -p MemoryMax=`` where systemd runs the machine (no peak of its own: the
  worker's peak RSS stands in).

A capped process is started inside its cgroup (it joins before exec), so nothing it maps is
charged elsewhere; the cgroup is removed after it exits, its page cache going back to the parent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_MEMORY = CGROUP_ROOT / "memory"
NAME_PREFIX = "colibri-bench-"


@dataclass
class Capped:
    """One capped run's result: the process's exit status and output, and the cgroup's peak."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int | None  # RSS + page cache charged at most (None: the method has no peak)
    oom_killed: bool


class MemoryCap:
    """How this machine caps a process's memory: ``method`` is "cgroup2", "cgroup1", "systemd-run"
    or None (``why`` then says why not)."""

    def __init__(self, method: str | None, base: Path | None, why: str = "") -> None:
        self.method, self.base, self.why = method, base, why

    @classmethod
    def detect(cls) -> MemoryCap:
        reasons = []
        for probe in (cls._cgroup2, cls._cgroup1, cls._systemd_run):
            cap, why = probe()
            if cap is not None:
                return cap
            reasons.append(why)
        return cls(None, None, "; ".join(reasons))

    @classmethod
    def _cgroup2(cls) -> tuple[MemoryCap | None, str]:
        if not (CGROUP_ROOT / "cgroup.controllers").exists():
            return None, "cgroup v2: not the unified hierarchy"
        own = Path(open("/proc/self/cgroup").read().split("0::", 1)[-1].split("\n")[0].strip() or "/")
        base = CGROUP_ROOT / own.relative_to("/")
        if "memory" not in (base / "cgroup.subtree_control").read_text().split():
            return None, f"cgroup v2: the memory controller is not delegated to {base}"
        if not cls._can_make(base):
            return None, f"cgroup v2: {base} not writable"
        return cls("cgroup2", base), ""

    @classmethod
    def _cgroup1(cls) -> tuple[MemoryCap | None, str]:
        if not (V1_MEMORY / "memory.limit_in_bytes").exists():
            return None, "cgroup v1: no memory controller mounted"
        if not cls._can_make(V1_MEMORY):
            return None, f"cgroup v1: {V1_MEMORY} not writable"
        return cls("cgroup1", V1_MEMORY), ""

    @classmethod
    def _systemd_run(cls) -> tuple[MemoryCap | None, str]:
        if shutil.which("systemd-run") is None or not Path("/run/systemd/system").is_dir():
            return None, "systemd-run: systemd is not this machine's init"
        return cls("systemd-run", None), ""

    @staticmethod
    def _can_make(base: Path) -> bool:
        probe = base / f"{NAME_PREFIX}probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return True
        except OSError:
            return False

    def describe(self) -> str:
        names = {"cgroup2": "cgroup v2 memory.max", "cgroup1": "cgroup v1 memory.limit_in_bytes",
                 "systemd-run": "systemd-run --scope -p MemoryMax="}
        return names.get(self.method or "", f"none ({self.why})")

    def run(self, argv: list[str], limit_bytes: int | None, timeout: float,
            also_join: Path | None = None) -> Capped:
        """``argv`` under ``limit_bytes`` (None: no limit, but still in its own cgroup, for the peak);
        ``also_join``: another hierarchy's ``cgroup.procs`` it joins too (``readcap.py``'s)."""
        if also_join is not None and self.method not in ("cgroup1", None):
            raise ValueError(f"a second cgroup to join needs cgroup v1 memory caps, not {self.describe()}")

        def join(procs: Path | None = None) -> None:
            """In the child, before exec: everything it maps or reads is charged to these groups."""
            for name in (procs, also_join):
                if name is not None:
                    name.write_text(str(os.getpid()))

        if self.method == "systemd-run":
            prefix = ["systemd-run", "--scope", "--quiet"]
            if limit_bytes is not None:
                prefix += ["-p", f"MemoryMax={limit_bytes}", "-p", "MemorySwapMax=0"]
            p = subprocess.run(prefix + argv, capture_output=True, text=True, timeout=timeout)
            return Capped(p.returncode, p.stdout, p.stderr, None, p.returncode in (-9, 137))
        if self.base is None:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                               preexec_fn=join if also_join is not None else None)
            return Capped(p.returncode, p.stdout, p.stderr, None, False)
        group = self.base / f"{NAME_PREFIX}{uuid.uuid4().hex[:12]}"
        group.mkdir()
        try:
            self._limit(group, limit_bytes)
            procs = group / "cgroup.procs"
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                               preexec_fn=lambda: join(procs))
            return Capped(p.returncode, p.stdout, p.stderr, self._peak(group), self._oom(group, p.returncode))
        finally:
            group.rmdir()

    def _limit(self, group: Path, limit_bytes: int | None) -> None:
        if limit_bytes is None:
            return
        if self.method == "cgroup2":
            (group / "memory.max").write_text(str(limit_bytes))
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
        else:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = group / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))

    def _peak(self, group: Path) -> int | None:
        name = "memory.peak" if self.method == "cgroup2" else "memory.max_usage_in_bytes"
        try:
            return int((group / name).read_text())
        except (OSError, ValueError):
            return None

    def _oom(self, group: Path, returncode: int) -> bool:
        name = "memory.events" if self.method == "cgroup2" else "memory.oom_control"
        try:
            for line in (group / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in ("oom_kill", "oom") and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return returncode in (-9, 137)
