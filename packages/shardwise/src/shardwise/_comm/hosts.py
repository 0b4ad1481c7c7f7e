"""This process's host, as :meth:`Group.hosts` compares hosts."""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["this_host"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def this_host() -> list[str]:
    """``[host name, boot id]`` of this process's host; the boot id is ``""`` where there is none (not Linux)."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return [socket.gethostname(), boot]
