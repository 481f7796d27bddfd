"""Shared-memory segments that carry tensor data between a client and the daemon.

Segments are named ``mccl-<job>-<rank>-<pid>-<gen>`` (short: macOS caps names at 31
characters). On Linux the name only labels a sealed memfd that the client hands to mccld by
descriptor (``Segment``, fd_handover.py); nothing is in /dev/shm. Where the memory is a named
POSIX shm object (macOS until handed over, clients older than this), the owner pid in the
name lets any daemon tell a live client's segment from one a crash left behind, so a sweep
never frees memory that is still in use.

Every segment starts with a control header, then the data (``Segment.addr``):

    offset 0    ``ready`` ticket: bytes of input the client has copied in (u64)
    offset 64   ``done`` ticket: bytes of results the daemon has finished (u64)
    offset 4096 data

Each ticket (libmccl/csrc/core/ticket.h) is a monotonic counter on its own cache line, counted
in cumulative bytes over the segment's life: an op covers [base, base + its bytes), where
base is the bytes of the pipelined ops before it in this segment. The header fills a page
so the data stays page-aligned for whatever maps it next (a GPU registration, an MTLBuffer).

Where ``shm_open`` is used it is called directly rather than through
``multiprocessing.shared_memory``: its resource tracker would unlink a segment when the
*daemon's* reference goes away, pulling it from under the client.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import sys
from pathlib import Path
from typing import Any, Callable

import _posixshmem

from .attach_protocol import SEGMENT_RE
from .errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

PREFIX = "mccl-"
MAX_NAME = 31
READY_OFF = 0
DONE_OFF = 64
HEADER_BYTES = 4096


def segment_name(job: str, rank: int, pid: int, gen: int) -> str:
    name = f"{PREFIX}{job}-{rank}-{pid}-{gen}"
    if not SEGMENT_RE.match(name) or len(name) > MAX_NAME:
        raise ConfigError(f"[daemon] shared-memory name {name!r} is malformed or longer than "
                          f"{MAX_NAME} characters; job ids must be short hex strings")
    return name


def owner_pid(name: str) -> int | None:
    m = SEGMENT_RE.match(name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (killed, not yet reaped by its parent) counts as dead:
    its memory and sockets are gone, and a launcher may take a while to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])
    return True


class Segment:
    """One mapped segment: ``nbytes`` of data at ``addr`` after the control header.

    The client creates it (``create=True``) and hands its descriptor to mccld over the runtime
    dir's Unix socket (fd_handover.py); mccld maps what it was handed (``Segment.adopt``) and
    never opens a segment by name. On Linux the memory is a memfd sealed against shrinking and
    growing before anyone else sees it, so nobody (its client included) can truncate it under
    mccld's mapping: the SIGBUS that would kill mccld cannot happen, and mccld refuses a
    descriptor without the seal. Nothing names it in /dev/shm, so only the client and mccld
    (and root) can reach it. macOS has no memfd: a 0600 POSIX shm object, unlinked once handed
    over (macOS cannot resize a shm object after its first ftruncate, so it cannot shrink).

    ``ticket_at`` (the engine's ``_core.Ticket.at``) makes ``ready`` and ``done`` views of
    the header's words; this package knows the layout, not the engine, so a caller that
    moves data through the tickets passes it, one that only maps the segment need not."""

    def __init__(self, name: str, nbytes: int, create: bool = True, ticket_at: Callable[[int], Any] | None = None,
                 fd: int = -1):
        if not SEGMENT_RE.match(name):
            raise ProtocolError(f"[daemon] refused shared-memory segment name {name!r}; "
                                "expected mccl-<job>-<rank>-<pid>-<gen>")
        self.name = name
        self.nbytes = nbytes
        self._fd = -1      # the daemon's side keeps it: check_size() asks the file, not our memory
        self.handover_fd = -1   # the client's, until handed over (fd_handover.hand_over closes it)
        if create:
            fd = _create(name, HEADER_BYTES + nbytes)
        elif fd < 0:
            raise ProtocolError(f"[daemon] segment {name} was not handed over to mccld; a client hands "
                                "over each segment's descriptor before registering it")
        try:
            if not create:
                self._fd = fd
                check_sealed(fd, name)
                self.check_size()
            self._map = mmap.mmap(fd, HEADER_BYTES + nbytes)
        except BaseException:
            self._fd = -1
            os.close(fd)
            if create:
                unlink(name)
            raise
        if create:
            self.handover_fd = fd
        self._buf = (ctypes.c_char * (HEADER_BYTES + nbytes)).from_buffer(self._map)
        start = ctypes.addressof(self._buf)
        self.addr = start + HEADER_BYTES
        # Views of the header's words; valid while the mapping is (close() drops them).
        self.ready = ticket_at(start + READY_OFF) if ticket_at is not None else None
        self.done = ticket_at(start + DONE_OFF) if ticket_at is not None else None

    @classmethod
    def adopt(cls, name: str, nbytes: int, fd: int, ticket_at: Callable[[int], Any] | None = None) -> "Segment":
        """mccld's side: map the segment a client handed over as ``fd`` (owned from here on,
        closed even on failure). ProtocolError if it is too small or not sealed."""
        return cls(name, nbytes, create=False, ticket_at=ticket_at, fd=fd)

    def handed_over(self) -> None:
        """The client's descriptor went to mccld: drop ours (the mapping keeps the memory) and,
        where the memory has a name (macOS), the name, so nobody else can open it."""
        fd, self.handover_fd = self.handover_fd, -1
        if fd >= 0:
            os.close(fd)
            if not _MEMFD:
                unlink(self.name)

    def check_size(self) -> None:
        """ProtocolError unless the file still holds the whole segment. With sealed memory this
        is a check of what the client sent; it stays for an OS without seals (it cannot close
        the window while an op runs there, see the class comment)."""
        if self._fd < 0:
            raise ProtocolError(f"[daemon] segment {self.name} is no longer mapped by mccld; its rank left")
        have = os.fstat(self._fd).st_size
        if have < HEADER_BYTES + self.nbytes:
            raise ProtocolError(f"[daemon] segment {self.name} holds {have} bytes, the client registered "
                                f"{self.nbytes} after the {HEADER_BYTES}-byte header; the client truncated "
                                "it: a registered segment must keep its size until its rank "
                                "leaves (register a new one under a new name to resize)")

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        end = self.nbytes if nbytes is None else offset + nbytes
        if offset < 0 or end > self.nbytes:
            raise ProtocolError(f"[daemon] range [{offset}, {end}) outside segment {self.name} "
                                f"of {self.nbytes} bytes")
        return memoryview(self._map)[HEADER_BYTES + offset:HEADER_BYTES + end]

    @property
    def closed(self) -> bool:
        return self._map is None

    def close(self) -> None:
        if self._map is None:
            return
        self.ready = self.done = None
        for attr in ("_fd", "handover_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)
        del self._buf
        try:
            self._map.close()
        except BufferError:
            # A view is still exported (an in-flight numpy array); the mapping goes when it does.
            log.debug("segment %s still referenced; unmapped later", self.name)
        self._map = None

    def unlink(self) -> None:
        unlink(self.name)


_MEMFD = hasattr(os, "memfd_create") and sys.platform.startswith("linux")
_SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) |
          getattr(fcntl, "F_SEAL_SEAL", 0))


def _create(name: str, size: int) -> int:
    if _MEMFD:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)   # a memfd starts 0777; /proc/<pid>/fd/N would reopen it by that mode
            os.ftruncate(fd, size)
            # Before anyone else holds it: from here on nobody can change its size.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        return fd
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    return fd


def check_sealed(fd: int, name: str) -> None:
    """mccld maps only memory its client cannot shrink (Linux: the memfd seal)."""
    if not _MEMFD:
        return
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ProtocolError(f"[daemon] segment {name} is not sealed against shrinking: its client could "
                            "truncate it under mccld, refused; the client must create segments with "
                            "mccl_common.shm (a sealed memfd)")


def unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False
    except PermissionError:
        # A daemon running as a service user cannot remove a client's segment from the sticky
        # /dev/shm; the client removes its own, and its next attach sweeps those a crash left.
        log.debug("segment %s belongs to another user; its owner removes it", name)
        return False


def sweep(names: list[str] | None = None) -> list[str]:
    """Unlink MCCL segments whose owner process is gone; returns what was removed.

    Linux lists /dev/shm; macOS cannot list POSIX shm, so the daemon passes the names
    it recorded in its runtime directory.
    """
    if names is None:
        names = []
    if sys.platform.startswith("linux") and Path("/dev/shm").is_dir():
        names = list(names) + [p.name for p in Path("/dev/shm").glob(PREFIX + "*")]
    removed = []
    for name in sorted(set(names)):
        pid = owner_pid(name)
        if pid is not None and not pid_alive(pid) and unlink(name):
            removed.append(name)
    if removed:
        log.info("swept %d shared-memory segment(s) left by dead processes", len(removed))
    return removed
