"""The processes of a launched job: its torchrun and everything below it.

torchrun starts each worker in a session of its own, so the job's process group is not the
job: once torchrun is gone its workers are orphans no group signal reaches. The job is the
tree under torchrun, walked by parent pid, and remembered with each process's start time so a
pid the kernel reused for someone else's process is never signalled.

Linux reads /proc; macOS asks ``ps`` (NOT VERIFIED ON A MAC: the ``ps -A -o pid=,ppid=,lstart=``
parser is tested on captured text only; ``pytest tests/daemon/test_reclaim.py -k macos`` on a
Mac runs it on real processes).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

PS_TIMEOUT_S = 3.0          # a hung ps must not stall the lease it runs for

# pid -> (parent pid, start identity): what one scan of the process table says
Table = dict[int, tuple[int, str]]


def _linux_table(proc: Path = Path("/proc")) -> Table:
    table: Table = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue        # exited between the listing and the read
        parsed = parse_linux_stat(stat)
        if parsed is not None:
            table[int(d.name)] = parsed
    return table


def parse_linux_stat(text: str) -> tuple[int, str] | None:
    """(ppid, starttime) of a /proc/PID/stat line; the command name may hold spaces and parens,
    so the fields are counted after its last ')'."""
    rest = text.rpartition(")")[2].split()
    if len(rest) < 20:
        return None
    try:
        return int(rest[1]), rest[19]
    except ValueError:
        return None


def parse_ps(text: str) -> Table:
    """``ps -A -o pid=,ppid=,lstart=`` (macOS): pid, ppid, then the start date as words."""
    table: Table = {}
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        table[int(parts[0])] = (int(parts[1]), parts[2].strip() if len(parts) > 2 else "")
    return table


def _ps_table() -> Table:
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,lstart="], capture_output=True, text=True,
                         timeout=PS_TIMEOUT_S, check=False)
    return parse_ps(out.stdout)


def process_table() -> Table:
    if sys.platform.startswith("linux"):
        return _linux_table()
    try:
        return _ps_table()
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("ps failed: %s", e)
        return {}


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
    if not sys.platform.startswith("linux"):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    rest = stat.rpartition(")")[2].split()
    return bool(rest) and rest[0] in ("Z", "X")


__all__ = ["JobTree", "descendants", "parse_linux_stat", "parse_ps", "process_table"]
