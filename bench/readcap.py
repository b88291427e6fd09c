"""A slow disk for one benchmark process: its reads of one block device throttled to a rate, the
way this machine allows, so that read-ahead can be measured where it would matter (a SATA disk, a
network volume) on a machine whose own disk is fast.

``ReadCap.detect(path, bytes_per_s)`` says whether this machine can do it for the device holding
``path``, and how: cgroup v1's ``blkio`` hierarchy, a child group with
``blkio.throttle.read_bps_device``, which the process joins beside its memory cap's group
(``MemoryCap.run``'s ``also_join``). It throttles the reads a process submits, its page-cache
misses and the read-ahead it asks the kernel for (``MADV_WILLNEED``) alike; pages already cached
are not reads, so a benchmark drops the file's pages first. (Under cgroup v2 a process has one
group, so the throttle would be ``io.max`` in the memory cap's own group: not done, and said so.)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memcap import CGROUP_ROOT

V1_BLKIO = CGROUP_ROOT / "blkio"
# The benchmark's groups by name: a run that died before removing its group leaves one that says
# whose it is.
NAME_PREFIX = "colibri-bench-read-"


def block_device(path: Path) -> str:
    """``MAJ:MIN`` of the whole disk holding ``path`` (a partition's parent: throttles apply to
    disks)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


class ReadCap:
    """How this machine throttles a process's reads of one device: ``method`` "cgroup1", or None
    (``why`` says why not)."""

    def __init__(self, method: str | None, device: str, bytes_per_s: int, why: str = "") -> None:
        self.method, self.device, self.bytes_per_s, self.why = method, device, bytes_per_s, why

    @classmethod
    def detect(cls, path: Path, bytes_per_s: int) -> ReadCap:
        device = block_device(path)
        if not (V1_BLKIO / "blkio.throttle.read_bps_device").exists():
            why = ("cgroup v2: io.max in the memory cap's own group, not done here"
                   if (CGROUP_ROOT / "cgroup.controllers").exists() else "no blkio controller mounted")
            return cls(None, device, bytes_per_s, why)
        cap = cls("cgroup1", device, bytes_per_s)
        try:  # the kernel refuses a device it cannot throttle (a RAM disk, an overlay)
            with cap.group():
                return cap
        except OSError as e:
            return cls(None, device, bytes_per_s, f"blkio refused {device}: {e}")

    def describe(self) -> str:
        if self.method is None:
            return f"none ({self.why})"
        rate = f"{self.bytes_per_s / 1e6:.0f} MB/s reads of {self.device}"
        return f"cgroup v1 blkio.throttle.read_bps_device, {rate}"

    @contextmanager
    def group(self) -> Iterator[Path]:
        """A new throttled cgroup for one run; yields its ``cgroup.procs``, removed after."""
        group = V1_BLKIO / f"{NAME_PREFIX}{uuid.uuid4().hex[:12]}"
        group.mkdir()
        try:
            (group / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.bytes_per_s}")
            yield group / "cgroup.procs"
        finally:
            group.rmdir()
