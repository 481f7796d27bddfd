"""What a host offers a job: cores, memory, device kind. mDNS advertises it, and the
daemon's capacity answer (``mcclctl capacity``) reports it."""

from __future__ import annotations

import os
import platform
import sys


def cpu_cores() -> int:
    return os.cpu_count() or 0


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def device_kind() -> str:
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "apple-silicon"
    return f"cpu-{platform.machine() or 'unknown'}"


def host_facts() -> dict[str, int | str]:
    return {"cores": cpu_cores(), "memory_bytes": memory_bytes(), "device": device_kind()}
