"""The processes of a launched job: its torchrun and everything below it.

torchrun starts each worker in a session of its own, so the job's process group is not the
job: once torchrun is gone its workers are orphans no group signal reaches. The job is the
tree under torchrun, walked by parent pid, and remembered with each process's start time so a
pid the kernel reused for someone else's process is never signalled.

The process table comes from psutil, which reads /proc on Linux and asks the kernel (sysctl,
libproc) on macOS: one code path for both (the macOS side is psutil's, NOT VERIFIED HERE ON A
MAC: ``pytest tests/daemon/test_reclaim.py`` on a Mac runs it on real processes).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import psutil

log = logging.getLogger(__name__)

# pid -> (parent pid, start identity): what one scan of the process table says
Table = dict[int, tuple[int, str]]


def process_table() -> Table:
    """Every process now: pid -> (ppid, start time as text). A process that exits during the
    scan is simply missing; one whose details we may not read still counts, by pid and parent."""
    table: Table = {}
    for p in psutil.process_iter(["ppid", "create_time"]):
        ppid, start = p.info.get("ppid"), p.info.get("create_time")
        if ppid is None:
            continue     # gone between the listing and the read
        # repr of the float: the same process gives the same text scan after scan.
        table[p.pid] = (int(ppid), repr(start) if start is not None else "")
    return table


def descendants(root: int, table: Table) -> dict[int, str]:
    """``root`` and every process below it, pid -> start identity."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in out or pid not in table:
            continue
        out[pid] = table[pid][1]
        todo.extend(children.get(pid, ()))
    return out


class JobTree:
    """The processes of one job, accumulated over scans: a worker orphaned by its torchrun's
    death stays known by the pid and start time it had when it was last seen under it."""

    def __init__(self, root: int, table: Callable[[], Table] = process_table):
        self.root = root
        self._table = table
        self._known: dict[int, str] = {}

    def scan(self) -> list[int]:
        """The job's live processes now (new ones added, dead or reused pids dropped)."""
        table = self._table()
        self._known.update(descendants(self.root, table))
        # Re-parented orphans are still ours, judged by their start time, not their parent.
        self._known = {pid: start for pid, start in self._known.items()
                       if pid in table and table[pid][1] == start}
        # Their children, started after the orphaning, hang below them.
        for pid in list(self._known):
            self._known.update(descendants(pid, table))
        return sorted(self._known)

    def signal(self, sig: int) -> int:
        """Sends ``sig`` to every live process of the job; returns how many got it."""
        sent = 0
        for pid in self.scan():
            try:
                os.kill(pid, sig)
                sent += 1
            except (ProcessLookupError, PermissionError):
                pass
        return sent

    def alive(self) -> list[int]:
        """The job's processes that still run (zombies count as gone: they hold no CPU)."""
        pids = self.scan()
        return [p for p in pids if not _zombie(p)]


def _zombie(pid: int) -> bool:
    """Exited but not yet reaped (or gone altogether)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False     # not ours to inspect: it runs, as far as we can tell


__all__ = ["JobTree", "descendants", "process_table"]
