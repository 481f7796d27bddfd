"""Handing a harvested host back to its user: yield at once, leave by a deadline.

From the harvest sample that sees the user (state busy or draining), every launched job on the
host runs at background priority (priority.py). Draining starts a clock of MCCL_RECLAIM_GRACE
seconds: a job that uses libmccl.elastic leaves at its next step boundary long before (the
drain file); one that never looks at the drain file is removed when the clock runs out
(``Removal``): SIGTERM to its torchrun, which stops its workers with SIGTERM and whose
rendezvous handler takes the host out of the run as it exits, then SIGKILL to whatever of the
job still runs KILL_AFTER_S later. The other hosts see the peer lost; torchrun restarts their
workers in the smaller world.

``ReclaimWatch`` is the host's view, fed every harvest sample: it lowers priorities, arms the
launcher's deadline, and times each hand-back (draining start to the last job process gone)
for ``mcclctl status``/``capacity`` and the mccl_reclaim_seconds histogram.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Protocol

from .proctree import JobTree

log = logging.getLogger(__name__)

KILL_AFTER_S = 5.0          # SIGTERM to SIGKILL of a job removed at the deadline
YIELD_STATES = ("busy", "draining")     # the user is at the host: jobs run in the background


class Removal:
    """Ends one job that did not leave in time. Started: SIGTERM to torchrun alone. Signalling
    its workers too would race it: seeing a worker die before its own SIGTERM is handled, it
    restarts them and joins the others' next round, which then waits for a host that is about
    to vanish (seen in 1 of 3 trials: the survivors re-formed at world 3 and timed out again and
    again). torchrun passes the SIGTERM to its workers and leaves the run at exit (the drain
    file exists). ``tick`` sends SIGKILL to every process of the job once KILL_AFTER_S passed;
    ``finish`` (the lease ends) kills whatever is left at once."""

    def __init__(self, tree: JobTree, kill_after_s: float = KILL_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self._tree = tree
        self._kill_after_s = kill_after_s
        self._clock = clock
        self.started = clock()
        self._killed = False
        tree.scan()     # know the workers now: they outlive a torchrun that dies first
        _kill(tree.root, signal.SIGTERM)

    def tick(self) -> None:
        if not self._killed and self._clock() - self.started >= self._kill_after_s:
            self._killed = True
            n = self._tree.signal(signal.SIGKILL)
            if n:
                log.warning("[reclaim] %d process(es) of the job survived SIGTERM for %.0f s: killed",
                            n, self._kill_after_s)

    def finish(self) -> None:
        if self._tree.alive():
            self._tree.signal(signal.SIGKILL)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher(Protocol):
    """What the watch needs of mccld's launch endpoint (launcher.LaunchServer)."""
    removed: int

    def background(self) -> int: ...

    def reclaim_after(self, grace_s: float) -> int: ...


class ReclaimWatch:
    """Fed every harvest snapshot; returns the fields it adds to it:

    - ``reclaim_grace_s``: MCCL_RECLAIM_GRACE;
    - ``leaves_in_s``: while draining, seconds until the jobs still here are removed;
    - ``last_reclaim``: the last hand-back: ``seconds`` from the user's return to the host free
      of job processes, ``how`` ("left": the jobs left or ended by themselves; "removed": the
      deadline ended them), ``at`` (epoch s).
    ``record(seconds, how)`` gets each finished hand-back (the metrics histogram)."""

    def __init__(self, grace_s: float, record: Callable[[float, str], None] = lambda s, how: None,
                 clock: Callable[[], float] = time.time):
        self.grace_s = grace_s
        self._record = record
        self._clock = clock
        self._since: float | None = None       # epoch s the current draining began
        self._removed_before = 0
        self._last: dict[str, Any] | None = None
        self._yielding = False
        self._lock = threading.Lock()   # update runs on the harvest thread, fields on status requests

    def update(self, snapshot: dict, changed: bool, launcher: Launcher | None) -> dict:
        with self._lock:
            self._update(snapshot, changed, launcher)
        return self.fields(snapshot.get("state"))

    def _update(self, snapshot: dict, changed: bool, launcher: Launcher | None) -> None:
        state = snapshot.get("state")
        now = self._clock()
        if launcher is not None:
            self._yield(state, launcher)
            if changed and state == "draining":
                self._since = float(snapshot.get("since") or now)
                self._removed_before = launcher.removed
                n = launcher.reclaim_after(max(0.0, self._since + self.grace_s - now))
                log.warning("[reclaim] the user is back: %d job(s) here leave at their next step boundary or "
                            "are removed in %.0f s (MCCL_RECLAIM_GRACE)", n, self.grace_s)
        if self._since is not None and state != "draining":
            seconds = max(0.0, now - self._since)
            how = "removed" if launcher is not None and launcher.removed > self._removed_before else "left"
            self._last = {"seconds": round(seconds, 3), "how": how, "at": now}
            self._since = None
            log.info("[reclaim] host handed back to its user %.1f s after the return (jobs %s)", seconds, how)
            self._record(seconds, how)

    def fields(self, state: str | None) -> dict:
        now = self._clock()
        with self._lock:
            since, last = self._since, self._last
        out: dict[str, Any] = {"reclaim_grace_s": self.grace_s, "last_reclaim": last, "leaves_in_s": None}
        if state == "draining" and since is not None:
            out["leaves_in_s"] = round(max(0.0, since + self.grace_s - now), 1)
        return out

    def _yield(self, state: str | None, launcher: Launcher) -> None:
        if state in YIELD_STATES:
            n = launcher.background()
            if n and not self._yielding:
                log.info("[reclaim] the user is here: %d job process(es) now run at background priority", n)
            self._yielding = self._yielding or bool(n)
        else:
            self._yielding = False


__all__ = ["KILL_AFTER_S", "ReclaimWatch", "Removal", "YIELD_STATES"]
