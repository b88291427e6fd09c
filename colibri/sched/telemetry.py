"""Host facts for the protocol's telemetry lines (HWINFO, STAT): read from /proc, no dependencies."""

from __future__ import annotations

import os
import resource

from colibri.io.events import HwInfo

GB = 1 << 30


def rss_gb() -> float:
    """Resident set size now (not the peak), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GB
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip().replace("|", "/")
    except OSError:
        pass
    return "unknown"


def hwinfo() -> HwInfo:
    mem = _meminfo()
    return HwInfo(
        cores=os.cpu_count() or 1,
        ram_total_gb=mem.get("MemTotal", 0) / GB,
        ram_avail_gb=mem.get("MemAvailable", 0) / GB,
        ngpu=0,
        vram_total_gb=0.0,
        cpu_name=_cpu_name(),
        gpu_name="",
    )
