"""Growing an elastic run: while ``mcclctl run --min A --max B`` has fewer than B hosts, lease
hosts that have turned idle (a Mac whose artist went home, a host that left earlier and is idle
again), so their torchrun joins the rendezvous and the job re-forms with them at its next step
boundary (libmccl.elastic.rdzv asks the workers to save first).

The search runs on a thread of its own: fetching every daemon's status takes a round trip per
host, and the loop streaming the job's output must not stall on it. Leases it opens are handed
to that loop; whatever it holds when stopped is given back for cancelling.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from mccl_common.errors import MCCLError
from mccl_common.launch_protocol import Lease

log = logging.getLogger(__name__)

RECRUIT_EVERY_S = 5.0       # how often a short run looks for idle hosts
REFUSED_COOLDOWN_S = 60.0   # a host that refused a lease is not asked again for this long
FAILED_COOLDOWN_S = 300.0   # nor one whose torchrun failed in this run (it may fail again at once)


class Recruiter:
    """Finds idle hosts for a run below its maximum and leases them; see the module docstring."""

    def __init__(self, find: Callable[[], list], open_lease: Callable[[object], Lease], n_max: int,
                 every_s: float = RECRUIT_EVERY_S):
        self._find = find               # -> hosts that pass the run's --where terms, best first
        self._open = open_lease         # host -> an open Lease, or raises MCCLError
        self._n_max = n_max
        self._every_s = every_s
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._pending: set[str] = set()     # leased here, not yet taken by the run
        self._refused: dict[str, float] = {}
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mcclctl-recruit", daemon=True)

    def start(self) -> "Recruiter":
        self._thread.start()
        return self

    def active(self, names: set[str]) -> None:
        """The hosts the run holds now (it calls this on every turn of its loop)."""
        with self._lock:
            self._active = set(names)

    def avoid(self, name: str) -> None:
        """``name``'s torchrun failed in this run: do not lease it again for a while."""
        with self._lock:
            self._refused[name] = time.monotonic() + FAILED_COOLDOWN_S

    def take(self) -> list[tuple[object, Lease]]:
        """Leases opened since the last call, each with its host."""
        out = []
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._pending.difference_update(h.name for h, _ in out)
        return out

    def stop(self, timeout_s: float = 15.0) -> list[tuple[object, Lease]]:
        """Stops searching; returns the leases opened but not taken (the caller cancels them)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return self.take()

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            with self._lock:
                active = self._active | self._pending
            want = self._n_max - len(active)
            if want <= 0:
                continue
            try:
                hosts = self._find()
            except (MCCLError, OSError) as e:
                log.debug("looking for idle hosts failed: %s", e)
                continue
            now = time.monotonic()
            for h in hosts:
                if want <= 0 or self._stop.is_set():
                    break
                with self._lock:
                    cooling = self._refused.get(h.name, 0.0) > now
                if h.name in active or cooling:
                    continue
                try:
                    lease = self._open(h)
                except MCCLError as e:
                    with self._lock:
                        self._refused[h.name] = now + REFUSED_COOLDOWN_S
                    log.warning("could not lease idle host %s for the run: %s", h.name, e)
                    continue
                with self._lock:
                    self._pending.add(h.name)
                self._ready.put((h, lease))
                want -= 1
