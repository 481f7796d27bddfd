"""Live state of one daemon: what the exporter and the status endpoint read.

The daemon writes from its hot paths (one ``record_collective`` per completed
collective, traffic deltas from the link threads), so every writer takes one lock for
a handful of dict updates and a bisect; once a key exists a call allocates at most
one small list per second. Readers call ``snapshot()``, which copies everything under the same lock into
plain JSON-serialisable data; formatting happens outside the lock.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Any

from mccl_common.status_protocol import HARVEST_STATES

from .. import __version__

# Upper bounds (seconds) of the collective duration histogram. Fixed, so that
# histogram_quantile() can aggregate across hosts: 10 us (a loopback barrier) up to a
# minute (a multi-GB all-reduce on a loaded 10 GbE link).
DURATION_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Message-size classes (label, inclusive upper bound in bytes). Latency and bandwidth
# differ by orders of magnitude between them, so one histogram per class.
SIZE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("le_4KiB", 4 << 10),
    ("le_64KiB", 64 << 10),
    ("le_1MiB", 1 << 20),
    ("le_16MiB", 16 << 20),
    ("le_256MiB", 256 << 20),
    ("gt_256MiB", float("inf")),
)
_SIZE_BOUNDS = [b for _, b in SIZE_BUCKETS]

STATES = ("idle", "training")

# Upper bounds (seconds) of the reclaim-latency histogram: the user's return to the host free of
# job processes. A step-boundary leave takes seconds; a removal MCCL_RECLAIM_GRACE (60 s) plus
# up to 10 s; the top bounds catch a grace set longer.
RECLAIM_BUCKETS_S: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 70.0, 90.0, 120.0,
                                        300.0, 600.0)
RECLAIM_HOW = ("left", "removed")

# Seconds of recent activity that the bus-bandwidth gauge and per-peer rates average over.
BUSBW_WINDOW_S = 10.0
# A job (or a rank of it) that reported nothing for this long is dropped from the
# per-job series, so finished jobs do not linger as label sets forever.
JOB_STALE_AFTER_S = 300.0


def mccl_version() -> str:
    """The MCCL release this code belongs to: what mcclctl compares with each daemon's,
    the same string mDNS advertises."""
    return __version__


def bus_factor(op: str, world: int) -> float:
    """Bytes each link carries per byte of the collective's buffer (nccl-tests' busbw).

    ``nbytes`` passed to ``record_collective`` is the per-rank buffer size, following
    nccl-tests: all-reduce/broadcast/reduce: the tensor; all-gather: the gathered output;
    reduce-scatter: the input; all-to-all: the whole send buffer. Multiplying the
    algorithm bandwidth by this factor gives a figure comparable with link speed.
    """
    n = max(int(world), 1)
    if n == 1:
        return 0.0
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall", "alltoallv", "gather", "scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv"):
        return 1.0
    return 0.0  # barrier and unknown ops move no payload worth a bandwidth figure


def size_bucket(nbytes: int) -> str:
    return SIZE_BUCKETS[bisect.bisect_left(_SIZE_BOUNDS, nbytes)][0]


class _OpStats:
    __slots__ = ("count", "bytes", "bus_bytes", "seconds", "window")

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.bus_bytes = 0.0
        self.seconds = 0.0
        # [whole second, bus bytes, busy seconds] per second with activity: bounded by
        # the window length however many collectives complete per second.
        self.window: deque[list[float]] = deque()


class _Histogram:
    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS_S) + 1)  # last slot: above the top bound
        self.sum_s = 0.0


class _Peer:
    __slots__ = ("sent", "received", "up", "changed_at", "ceiling_bps", "ceiling_at", "window")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.window: deque[list[float]] = deque()  # [whole second, sent, received]
        self.up: bool | None = None
        self.changed_at = 0.0
        self.ceiling_bps: float | None = None
        self.ceiling_at = 0.0


class _Balance:
    __slots__ = ("speed", "share", "seen")

    def __init__(self, speed: float, share: int, seen: float) -> None:
        self.speed, self.share, self.seen = speed, share, seen


class _Overlap:
    __slots__ = ("latest", "total", "samples", "seen")

    def __init__(self) -> None:
        self.latest = 0.0
        self.total = 0.0
        self.samples = 0
        self.seen = 0.0


class _Job:
    __slots__ = ("world", "ops", "bytes", "seen", "first", "ended", "failed", "compression", "reduced_bytes",
                 "encoded_bytes", "wire_bytes")

    def __init__(self, now: float) -> None:
        self.world = 0
        self.ops = 0
        self.bytes = 0
        self.compression = "off"   # the job's MCCL_COMPRESSION
        self.reduced_bytes = 0     # all-reduce input this host contributed across hosts
        self.encoded_bytes = 0     # the same, as encoded for the wire (= reduced_bytes where exact)
        self.wire_bytes = 0        # what the job's engine sent to other hosts (every op, framing included)
        self.seen = now
        self.first = now                 # its first collective (or its end, if it ran none)
        self.ended: float | None = None  # when the daemon closed it
        self.failed = False


class DaemonStats:
    """Thread-safe counters and gauges of one daemon (see docs/dev/interfaces.md §2)."""

    def __init__(self, clock=time.monotonic, wall_clock=time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall_clock
        self._start_mono = clock()
        self._start_wall = wall_clock()
        self._hist: dict[tuple[str, str], _Histogram] = {}
        self._ops: dict[str, _OpStats] = {}
        self._peers: dict[str, _Peer] = {}
        self._errors: dict[str, int] = {}
        self._overlap: dict[tuple[str, int], _Overlap] = {}
        self._balance: dict[tuple[str, int], _Balance] = {}
        self._jobs: dict[str, _Job] = {}
        self._attached = 0
        self._state = "idle"
        self._harvest: dict[str, Any] | None = None   # None: no harvest monitor feeds these stats
        # how -> [counts per bucket (+ overflow), sum s]; every outcome from the start, so a host that
        # never handed back exports zeros (a dashboard's "no hand-backs"), not nothing
        self._reclaims: dict[str, list] = {how: [[0] * (len(RECLAIM_BUCKETS_S) + 1), 0.0] for how in RECLAIM_HOW}
        self._version = mccl_version()

    # ---- writers (hot path) -------------------------------------------------------

    def record_collective(self, job: str, op: str, nbytes: int, seconds: float, world: int,
                          bus_world: int | None = None) -> None:
        """One completed collective of ``nbytes`` (per-rank buffer) that took ``seconds``.

        ``world`` is the job's rank count. ``bus_world`` is how many parties exchange the
        data over the network, when that differs: a daemon reduces its local ranks in
        shared memory and only its host-level collective crosses the links, so it passes
        the job's host count, and bus bandwidth stays comparable with the link ceiling.
        """
        if nbytes < 0 or seconds < 0:
            raise ValueError(f"[stats] record_collective({op!r}): negative size or duration "
                             f"(nbytes={nbytes}, seconds={seconds}); the caller's timing is wrong")
        now = self._clock()
        bus = nbytes * bus_factor(op, world if bus_world is None else bus_world)
        slot = bisect.bisect_left(DURATION_BUCKETS_S, seconds)
        key = (op, size_bucket(nbytes))
        with self._lock:
            h = self._hist.get(key)
            if h is None:
                h = self._hist[key] = _Histogram()
            h.counts[slot] += 1
            h.sum_s += seconds
            o = self._ops.get(op)
            if o is None:
                o = self._ops[op] = _OpStats()
            o.count += 1
            o.bytes += nbytes
            o.bus_bytes += bus
            o.seconds += seconds
            sec = float(int(now))
            if o.window and o.window[-1][0] == sec:
                o.window[-1][1] += bus
                o.window[-1][2] += seconds
            else:
                o.window.append([sec, bus, seconds])
                self._trim(o.window, now)
            j = self._jobs.get(job)
            if j is None:
                # Pruned here too, not only when read: with nobody scraping, one entry per job
                # would pile up for as long as the daemon runs.
                self._prune(self._jobs, now)
                j = self._jobs[job] = _Job(now)
            j.world = world
            j.ops += 1
            j.bytes += nbytes
            j.seen = now

    def _job(self, job: str, now: float) -> _Job:
        """The job's entry (the caller holds the lock)."""
        j = self._jobs.get(job)
        if j is None:
            self._prune(self._jobs, now)
            j = self._jobs[job] = _Job(now)
        return j

    def record_reduced(self, job: str, compression: str, nbytes: int, encoded: int) -> None:
        """An all-reduce (or reduce-scatter) whose ``nbytes`` of input from this host crossed
        hosts as ``encoded`` bytes (the job's ``compression``; equal where it ran exact)."""
        if nbytes < 0 or encoded < 0:
            raise ValueError(f"[stats] record_reduced: negative size (nbytes={nbytes}, encoded={encoded})")
        now = self._clock()
        with self._lock:
            j = self._job(job, now)
            j.compression = compression
            j.reduced_bytes += nbytes
            j.encoded_bytes += encoded
            j.seen = now

    def record_job_wire(self, job: str, sent: int) -> None:
        """Bytes the job's engine sent to other hosts since the previous call."""
        if sent < 0:
            raise ValueError(f"[stats] record_job_wire: negative byte count {sent}")
        now = self._clock()
        with self._lock:
            j = self._job(job, now)
            j.wire_bytes += sent

    def end_job(self, job: str, world: int, failed: bool, age_s: float = 0.0) -> None:
        """The daemon closed ``job`` (``failed``: with an error) after ``age_s`` seconds; it
        stays listed as ended for JOB_STALE_AFTER_S, so ``mcclctl jobs`` says how it ended."""
        now = self._clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                self._prune(self._jobs, now)
                j = self._jobs[job] = _Job(now)
                j.world = world
            j.first = min(j.first, now - max(0.0, age_s))
            j.ended, j.failed, j.seen = now, bool(failed), now

    def record_peer_traffic(self, peer: str, sent: int, received: int) -> None:
        """Byte deltas on the link to ``peer`` (host:port) since the previous call."""
        if sent < 0 or received < 0:
            raise ValueError(f"[stats] record_peer_traffic: negative delta, peer={peer} "
                             f"(sent={sent}, received={received}); pass deltas, not totals")
        now = self._clock()
        sec = float(int(now))
        with self._lock:
            p = self._peer(peer)
            p.sent += sent
            p.received += received
            if p.window and p.window[-1][0] == sec:
                p.window[-1][1] += sent
                p.window[-1][2] += received
            else:
                p.window.append([sec, sent, received])
                self._trim(p.window, now)

    def set_peer_up(self, peer: str, up: bool) -> None:
        now = self._wall()
        with self._lock:
            p = self._peer(peer)
            if p.up is not bool(up):
                p.up = bool(up)
                p.changed_at = now

    def record_error(self, kind: str) -> None:
        """``kind`` is the exception class name, e.g. ``PeerLostError``."""
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + 1

    def record_balance(self, job: str, rank: int, speed: float, share: int) -> None:
        """A rank's measured speed (samples/s, 0 before its first measurement) and batch share."""
        if not speed >= 0.0 or share < 0:
            raise ValueError(f"[stats] balance report speed={speed} share={share} from job={job} rank={rank}: "
                             "both must be >= 0")
        now = self._clock()
        with self._lock:
            key = (job, int(rank))
            if key not in self._balance:
                self._prune(self._balance, now)
            self._balance[key] = _Balance(float(speed), int(share), now)

    def record_overlap(self, job: str, rank: int, ratio: float) -> None:
        """Overlap a training process measured: 1 - exposed comm time / total comm time."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"[stats] overlap ratio {ratio} from job={job} rank={rank} is outside "
                             f"[0, 1]; the process measured exposed > total communication time")
        now = self._clock()
        with self._lock:
            key = (job, int(rank))
            ov = self._overlap.get(key)
            if ov is None:
                self._prune(self._overlap, now)
                ov = self._overlap[key] = _Overlap()
            ov.latest = ratio
            ov.total += ratio
            ov.samples += 1
            ov.seen = now

    def set_link_ceiling(self, peer: str, bits_per_s: float) -> None:
        """TCP goodput to ``peer`` measured by the last link test."""
        if bits_per_s <= 0:
            raise ValueError(f"[stats] link ceiling {bits_per_s} bit/s for peer={peer} is not "
                             f"positive; the link test measured nothing")
        now = self._wall()
        with self._lock:
            p = self._peer(peer)
            p.ceiling_bps = float(bits_per_s)
            p.ceiling_at = now

    def set_attached(self, n: int) -> None:
        with self._lock:
            self._attached = int(n)

    def set_state(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"[stats] unknown daemon state {state!r}; expected one of {STATES}")
        with self._lock:
            self._state = state

    def set_harvest(self, harvest: dict[str, Any]) -> None:
        """The harvest monitor's latest snapshot (harvest.py): its state must be a known one."""
        if harvest.get("state") not in HARVEST_STATES:
            raise ValueError(f"[stats] unknown harvest state {harvest.get('state')!r}; "
                             f"expected one of {HARVEST_STATES}")
        with self._lock:
            self._harvest = dict(harvest)

    def record_reclaim(self, seconds: float, how: str) -> None:
        """One hand-back of the host to its user that took ``seconds``; ``how`` in RECLAIM_HOW."""
        if how not in RECLAIM_HOW:
            raise ValueError(f"[stats] unknown reclaim outcome {how!r}; expected one of {RECLAIM_HOW}")
        with self._lock:
            h = self._reclaims.setdefault(how, [[0] * (len(RECLAIM_BUCKETS_S) + 1), 0.0])
            h[0][bisect.bisect_left(RECLAIM_BUCKETS_S, seconds)] += 1
            h[1] += seconds

    def forget_peer(self, peer: str) -> None:
        """Drop a peer that left the fleet for good (its series disappear)."""
        with self._lock:
            self._peers.pop(peer, None)

    # ---- reader -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of everything, as plain JSON-serialisable data."""
        with self._lock:
            now = self._clock()
            ops = {}
            for op, o in self._ops.items():
                self._trim(o.window, now)
                busy = sum(w[2] for w in o.window)
                busbw = (sum(w[1] for w in o.window) / busy) if busy > 0 else None
                ops[op] = {"count": o.count, "bytes": o.bytes, "bus_bytes": o.bus_bytes,
                           "seconds": o.seconds, "busbw_bytes_per_s": busbw}
            collectives = []
            for (op, sb), h in self._hist.items():
                cumulative, acc = [], 0
                for c in h.counts:
                    acc += c
                    cumulative.append(acc)
                collectives.append({"op": op, "size_bucket": sb, "count": acc, "sum_s": h.sum_s,
                                    "cumulative": cumulative[:-1]})
            peers = {}
            for name, p in self._peers.items():
                self._trim(p.window, now)
                span = self._window_span(now)
                peers[name] = {"up": p.up, "changed_at": p.changed_at, "sent_bytes": p.sent,
                               "received_bytes": p.received,
                               "tx_bytes_per_s": sum(w[1] for w in p.window) / span,
                               "rx_bytes_per_s": sum(w[2] for w in p.window) / span,
                               "ceiling_bits_per_s": p.ceiling_bps, "ceiling_at": p.ceiling_at}
            self._prune(self._overlap, now)
            overlap = [{"job": job, "rank": rank, "latest": v.latest,
                        "mean": v.total / v.samples, "samples": v.samples}
                       for (job, rank), v in self._overlap.items()]
            self._prune(self._balance, now)
            balance = [{"job": job, "rank": rank, "speed": v.speed, "share": v.share}
                       for (job, rank), v in self._balance.items()]
            self._prune(self._jobs, now)
            jobs = {job: {"world": j.world, "ops": j.ops, "bytes": j.bytes, "idle_s": now - j.seen,
                          "compression": j.compression, "allreduce_input_bytes": j.reduced_bytes,
                          "allreduce_encoded_bytes": j.encoded_bytes, "wire_bytes": j.wire_bytes,
                          "age_s": now - j.first,
                          "ended_s_ago": None if j.ended is None else now - j.ended,
                          "outcome": None if j.ended is None else ("failed" if j.failed else "ok")}
                    for job, j in self._jobs.items()}
            return {
                "version": self._version,
                "start_time": self._start_wall,
                "uptime_s": now - self._start_mono,
                "state": self._state,
                "harvest": dict(self._harvest) if self._harvest is not None else None,
                "attached": self._attached,
                "duration_buckets_s": list(DURATION_BUCKETS_S),
                "reclaim_buckets_s": list(RECLAIM_BUCKETS_S),
                "reclaims": {how: {"cumulative": _cumulative(h[0])[:-1], "count": sum(h[0]), "sum_s": h[1]}
                             for how, h in self._reclaims.items()},
                "collectives": collectives,
                "ops": ops,
                "peers": peers,
                "errors": dict(self._errors),
                "overlap": overlap,
                "balance": balance,
                "jobs": jobs,
            }

    # ---- internals ----------------------------------------------------------------

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer()
        return p

    def _window_span(self, now: float) -> float:
        # Rates average over the whole window, or over the daemon's life while it is
        # younger than the window; never less than one second (the slot granularity).
        return max(1.0, min(BUSBW_WINDOW_S, now - self._start_mono))

    @staticmethod
    def _prune(table: dict, now: float) -> None:
        """Drop the entries of jobs not seen for JOB_STALE_AFTER_S (the caller holds the lock)."""
        for key in [k for k, v in table.items() if now - v.seen > JOB_STALE_AFTER_S]:
            del table[key]

    @staticmethod
    def _trim(window: deque, now: float) -> None:
        while window and window[0][0] < now - BUSBW_WINDOW_S:
            window.popleft()


def _cumulative(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        acc += c
        out.append(acc)
    return out
