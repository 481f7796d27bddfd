"""What mccld keeps in its runtime dir besides its sockets: the lock that makes it the dir's
only daemon, and the record of the segments its jobs map (swept at the next start when a
crash left them behind)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from mccl_common import shm
from mccl_common.errors import ConfigError

SEGMENT_RECORD = "segments"
LOCK_NAME = "mccld.lock"
_LOCK_PID_WAIT_S = 1.0      # for the winner of a simultaneous start to write its pid


def lock_runtime_dir(runtime_dir: Path) -> int:
    """The descriptor of the runtime dir's lock file, flock'ed (close it to let go).

    Two daemons on one runtime dir would steal each other's clients, and the one that
    gives up would remove the socket and token the other serves with. An flock taken
    before anything is written there decides, even for two started at the same moment
    (asking "does a daemon answer?" does not: both can ask before either listens). The
    kernel drops it when the process dies, so a crashed daemon never blocks the next.
    The file is never removed: a daemon unlinking it while another waits would let a
    third lock a new file of the same name."""
    path = runtime_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            other = b""
            until = time.monotonic() + _LOCK_PID_WAIT_S
            while not (other := os.pread(fd, 32, 0).strip()) and time.monotonic() < until:
                time.sleep(0.02)
        finally:
            os.close(fd)
        raise ConfigError(f"[daemon] another mccld already serves {runtime_dir}: pid "
                          f"{other.decode(errors='replace') or 'unknown'} holds {path}; stop it first "
                          "(or give this one its own MCCL_RUNTIME_DIR)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class SegmentRecord:
    """The names of segments that may outlive mccld (those of live jobs). Not thread-safe:
    the daemon writes it under its lock."""

    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / SEGMENT_RECORD

    def sweep(self) -> None:
        """At start: unlink what a previous daemon's jobs left, then start an empty record."""
        try:
            names = self.path.read_text().split()
        except FileNotFoundError:
            names = []
        shm.sweep(names)
        self.path.write_text("")

    def add(self, name: str) -> None:
        with open(self.path, "a") as fh:
            fh.write(name + "\n")

    def keep_only(self, names: list[str]) -> None:
        self.path.write_text("".join(n + "\n" for n in names))
