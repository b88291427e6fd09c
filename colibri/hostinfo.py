"""Facts about the host, read from /proc and /sys with no dependencies: memory, the process's
resident size, the CPU's name. The RAM budget's default and the protocol's telemetry both use them."""

from __future__ import annotations

import os
import resource
from pathlib import Path

GIB = 1 << 30
CGROUP = Path("/sys/fs/cgroup")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (``MemTotal``, ``MemAvailable`` …); empty where it cannot be read."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def available_ram() -> int | None:
    """Bytes of RAM free for us: MemAvailable, capped by a cgroup v2 memory limit (a container sees
    the host's MemAvailable); None when neither can be read."""
    available = meminfo().get("MemAvailable")
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            available = None
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((CGROUP / "memory.current").read_text())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def rss_gb() -> float:
    """Resident set size now (not the peak), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


def os_cpu_count() -> int:
    return os.cpu_count() or 1
