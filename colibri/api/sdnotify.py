"""systemd's notify protocol (sd_notify(3)) without libsystemd: one datagram to ``$NOTIFY_SOCKET``.

Lets ``Type=notify`` units know when the model is loaded (READY=1), show a status line, and feed the
watchdog. Outside systemd, or if the socket is gone, every call is a silent no-op returning False:
notification is advisory and must never take the server down.
"""

from __future__ import annotations

import os
import socket


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("/"):
        return addr
    if addr.startswith("@") and len(addr) > 1:
        return "\0" + addr[1:]  # Linux abstract namespace
    return None  # unset, or a kind we don't speak (vsock:, relative paths — sd_notify rejects those too)


def notify(state: str) -> bool:
    """Send ``state`` (newline-separated ``KEY=value`` assignments); True if the datagram was sent."""
    addr = _address()
    if addr is None or not state or not hasattr(socket, "AF_UNIX"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Non-blocking: a full receive queue means systemd isn't reading; dropping one notification
            # beats stalling the event loop that serves requests.
            sock.setblocking(False)
            sock.sendto(state.encode("utf-8"), addr)
    except (OSError, ValueError):  # ValueError: an embedded NUL in a path
        return False
    return True


def ready() -> bool:
    """Startup finished: systemd marks the unit active and starts its dependents."""
    return notify("READY=1")


def stopping() -> bool:
    """Shutdown began, so systemd reports 'deactivating' rather than a crash."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """A one-line status for ``systemctl status``; newlines would start new assignments."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def watchdog() -> bool:
    """Keep-alive ping for ``WatchdogSec=``."""
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between required pings (``$WATCHDOG_USEC``) if the watchdog targets this process."""
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None  # meant for another process (a parent that exec'd us, say)
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None
