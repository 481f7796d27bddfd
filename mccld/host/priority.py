"""Background priority for a harvested job's processes while the host's user is at it.

The artist's applications must not compete with training: the job keeps running (it may still
leave at its next step boundary), but only on what the user leaves unused.

- Linux: nice 19, SCHED_IDLE and the idle I/O class. All three are per thread on Linux, so
  every thread of every process gets them; threads and processes started later inherit them
  from their parent thread. A process may lower its own user's processes without privileges.
- macOS: ``taskpolicy -b -p PID`` (background QoS: lowest CPU priority, throttled I/O and, on
  Apple silicon, the efficiency cores) and nice 19, per process. NOT VERIFIED ON A MAC: run
  ``.venv/bin/python -m pytest tests/daemon/test_reclaim.py -k macos`` there.

``Background`` is the one entry point; ``lower(pids)`` is idempotent and cheap enough to call
on every harvest sample.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import subprocess
import sys

from ..logutil import OnceLogger

log = logging.getLogger(__name__)

NICE = 19
TASKPOLICY_TIMEOUT_S = 2.0
IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
# ioprio_set / ioprio_get have no libc wrapper; their numbers differ per architecture.
_IOPRIO_NR = {"x86_64": (251, 252), "aarch64": (30, 31), "arm64": (30, 31), "i686": (289, 290),
              "i386": (289, 290), "ppc64le": (273, 274), "riscv64": (30, 31)}


class Background:
    """Lowers processes to background priority; remembers what it did so a repeated call costs
    little (macOS: one ``taskpolicy`` per process, not per call)."""

    def __init__(self, platform_name: str = sys.platform):
        self._platform = platform_name
        self._once = OnceLogger(log)
        self._done: set[int] = set()        # macOS: pids already under taskpolicy -b
        self._libc = _libc() if self._platform.startswith("linux") else None
        self._ioprio_nr = _IOPRIO_NR.get(platform.machine(), (None, None))[0]

    def lower(self, pids: list[int]) -> int:
        """Background priority for every process in ``pids``; returns how many were lowered
        (or already were). A process that is gone or not ours is skipped."""
        if self._platform.startswith("linux"):
            return sum(self._lower_linux(pid) for pid in pids)
        if self._platform == "darwin":
            self._done &= set(pids)
            return sum(self._lower_darwin(pid) for pid in pids)
        self._once.warn("platform", "[harvest] no background priority on %s: the job keeps its priority "
                        "while the user is back", self._platform)
        return 0

    # ---- Linux -----------------------------------------------------------------------

    def _lower_linux(self, pid: int) -> bool:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return False
        ok = False
        for tid in tids:
            ok = self._lower_thread(tid) or ok
        return ok

    def _lower_thread(self, tid: int) -> bool:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < NICE:
                os.setpriority(os.PRIO_PROCESS, tid, NICE)
            if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            return False
        except PermissionError as e:
            self._once.warn("perm", "[harvest] cannot lower the priority of job thread %d (%s); mccld must run "
                            "as the jobs' user (MCCL_LAUNCH_USER) or as root", tid, e)
            return False
        self._idle_io(tid)
        return True

    def _idle_io(self, tid: int) -> None:
        if self._ioprio_nr is None:
            self._once.warn("ioprio", "[harvest] idle I/O priority is not known on %s; the job keeps its I/O "
                            "priority while the user is back", platform.machine())
            return
        rc = self._libc.syscall(self._ioprio_nr, IOPRIO_WHO_PROCESS, tid, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)
        if rc != 0:
            err = ctypes.get_errno()
            if err != 3:    # ESRCH: the thread ended meanwhile
                self._once.warn("ioprio-set", "[harvest] ioprio_set(idle) of job thread %d failed: %s", tid,
                                os.strerror(err))

    # ---- macOS -----------------------------------------------------------------------

    def _lower_darwin(self, pid: int) -> bool:
        if pid in self._done:
            return True
        try:
            os.setpriority(os.PRIO_PROCESS, pid, NICE)
            subprocess.run(["taskpolicy", "-b", "-p", str(pid)], capture_output=True,
                           timeout=TASKPOLICY_TIMEOUT_S, check=True)
        except ProcessLookupError:
            return False
        except (OSError, subprocess.SubprocessError) as e:
            self._once.warn("taskpolicy", "[harvest] cannot put job process %d in the background (%s)", pid, e)
            return False
        self._done.add(pid)
        return True


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def is_background(tid: int) -> bool:
    """Linux: does this thread run at nice 19, SCHED_IDLE and idle I/O (what tests check)?
    Raises ProcessLookupError when it is gone."""
    if os.getpriority(os.PRIO_PROCESS, tid) < NICE or os.sched_getscheduler(tid) != os.SCHED_IDLE:
        return False
    nr = _IOPRIO_NR.get(platform.machine(), (None, None))[1]
    if nr is None:
        return True     # nothing to check it with: the CPU part holds
    prio = _libc().syscall(nr, IOPRIO_WHO_PROCESS, tid)
    if prio < 0:
        raise ProcessLookupError(tid)
    return prio >> IOPRIO_CLASS_SHIFT == IOPRIO_CLASS_IDLE


__all__ = ["Background", "NICE", "is_background"]
