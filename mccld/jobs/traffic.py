"""Bytes each job's engine sent to and received from each peer host, as increments for the
exporter: the engine keeps running totals, the exporter counts per peer address (and what
each job sent, per job)."""

from __future__ import annotations

import threading
from typing import Callable

from .job import Job


class PeerTraffic:
    """``stat("record_peer_traffic", link_addr, sent, received)`` gets each increment."""

    def __init__(self, stat: Callable[..., None]):
        self._stat = stat
        self._last: dict[tuple[str, int], tuple[int, int]] = {}
        self._lock = threading.Lock()   # job threads and the checker both poll

    def poll(self, job: Job) -> None:
        engine = job.engine
        if engine is None:
            return
        try:
            per_peer = engine.stats().get("per_peer", {})
        except Exception:  # noqa: BLE001 - stats are best effort
            return
        job_sent = 0
        for rank, counters in per_peer.items():
            rank = int(rank)
            sent, recv = int(counters.get("sent", 0)), int(counters.get("received", 0))
            with self._lock:
                last = self._last.get((job.id, rank), (0, 0))
                self._last[(job.id, rank)] = (sent, recv)
            if (sent, recv) != last and 0 <= rank < len(job.hosts):
                self._stat("record_peer_traffic", job.hosts[rank].link_addr,
                           max(0, sent - last[0]), max(0, recv - last[1]))
                job_sent += max(0, sent - last[0])
        if job_sent:
            self._stat("record_job_wire", job.id, job_sent)

    def forget(self, job_id: str) -> None:
        with self._lock:
            for key in [k for k in self._last if k[0] == job_id]:
                del self._last[key]
