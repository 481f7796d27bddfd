"""A port for a server that a test starts a little later (a TCPStore in a spawned rank, an
exporter, a status server).

Asking the kernel for port 0 and closing the socket hands out an *ephemeral* port, which
the kernel may give to the next socket bound to port 0 or connecting out before our server
binds it. With the suites running side by side that happened: an mccl listener of another
test took a rank's TCPStore port, rank 0 could not bind it and the other ranks waited on the
wrong server until the test timed out. So the port comes from below the ephemeral range,
which only explicit binds use, and is checked free on every address (where TCPStore listens).
"""

from __future__ import annotations

import random
import socket

# Well-known defaults that other processes may bind explicitly: torchrun's c10d rendezvous,
# torch's MASTER_PORT default, mccld's link and status ports.
_AVOID = set(range(29400, 29410)) | set(range(29500, 29510)) | set(range(29650, 29670))
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and BSDs start at 49152


def free_port() -> int:
    top = min(_ephemeral_low(), 32768)
    base = 10000 if top > 12000 else 1024
    for _ in range(500):
        port = _rng.randrange(base, top)
        if port in _AVOID:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port found in {base}..{top - 1} (below the ephemeral range)")
