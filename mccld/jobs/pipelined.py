"""The pipelined all-reduce of one host's ranks, piece by piece through segment tickets.

Each local rank's client copies its tensor into its segment and raises the segment's
``ready`` ticket as pieces land (mccl_common/shm.py: the layout); this module overlaps everything
after that by piece:

    reduce  (ReducePool-sized set of threads): once every rank's ``ready`` covers piece k,
            fold the other regions into the leader's (the first local rank's) and raise a
            daemon-private ``reduced`` ticket over the finished prefix;
    engine  (the job thread, multi-host): the inter-host all-reduce runs in place on the
            leader's region, gated by ``reduced`` and raising a private ``final``;
    finish  (one thread): as ``final`` (``reduced`` on a single host) covers piece k,
            divide it for AVG, copy it to the other ranks' regions and raise every rank's
            ``done``, which the clients copy out behind.

With one rank on this host and nothing to divide, the engine runs on the client's region
with the client's own tickets: the daemon copies nothing. Any failure poisons every
ticket of the op, so no client and no stage waits past the error.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from libmccl import _core
from mccl_common.wire import AVG, DTYPE_SIZE, SUM

from .reduce import ReducePool

# (method, *args, **tickets) -> None once the engine op finished; raises its typed error.
EngineRun = Callable[..., None]


@dataclass
class Region:
    """A local rank's part of one op: its data and its segment's tickets."""
    addr: int
    ready: Any  # _core.Ticket views of the segment's words
    done: Any
    base: int   # the op's start in the segment's ticket counts


class _Prefix:
    """Raises ``ticket`` to ``base + end`` of the longest finished prefix of pieces."""

    def __init__(self, ticket: Any, base: int, ends: list[int]):
        self._ticket, self._base, self._ends = ticket, base, ends
        self._finished = [False] * len(ends)
        self._next = 0
        self._lock = threading.Lock()

    def finished(self, k: int) -> None:
        with self._lock:
            self._finished[k] = True
            start = self._next
            while self._next < len(self._ends) and self._finished[self._next]:
                self._next += 1
            if self._next > start:
                self._ticket.signal(self._base + self._ends[self._next - 1])


class Pipeline:
    """One job's stages of pipelined all-reduces; ops run one at a time (the job thread)."""

    def __init__(self, pool: ReducePool, piece_bytes: int, timeout_s: float):
        self._reducers = pool.threads
        self._piece_bytes = piece_bytes
        self._timeout_s = timeout_s
        self._exec = ThreadPoolExecutor(self._reducers + 1, thread_name_prefix="mccld-pipe")
        self._lock = threading.Lock()
        self._tickets: list[Any] = []  # of the op in flight, poisoned by abort()

    def close(self) -> None:
        self.abort()
        self._exec.shutdown(wait=True)

    def abort(self) -> None:
        """Fail the op in flight (its client died, the job failed): every wait on it ends."""
        with self._lock:
            tickets, self._tickets = self._tickets, []
        for t in tickets:
            t.poison()

    def allreduce(self, regions: list[Region], count: int, dtype: int, op: int, world: int,
                  engine: EngineRun | None, engine_divides: bool, key: int = 0) -> None:
        """``regions``: the leader first. ``engine_divides``: the engine's AVG gives the job's
        average (one rank on every host), so AVG goes to it as is. ``key``: what keys a compressed
        op's error feedback (collectives.py). A compressed op's engine starts each group of chunks
        once ``reduced`` covers its input range and raises ``final`` group by group
        (algorithms/compressed.cc); the stages here are the same."""
        leader, es = regions[0], DTYPE_SIZE[dtype]
        nbytes = count * es
        piece = max(self._piece_bytes // es, 1) * es
        ends = [min(b + piece, nbytes) for b in range(0, nbytes, piece)]
        engine_op = op if op != AVG or (engine is not None and engine_divides) else SUM
        reduce_here = len(regions) > 1
        finish_here = reduce_here or engine is None or engine_op != op
        reduced = _core.Ticket() if reduce_here else leader.ready
        final = (_core.Ticket() if engine is not None else reduced) if finish_here else leader.done
        ours = [t for t in (reduced, final) if t is not leader.ready and t is not leader.done]
        with self._lock:
            self._tickets = [*ours, *(r.ready for r in regions), *(r.done for r in regions)]
        futures: list[Future] = []
        try:
            if reduce_here:
                prefix = _Prefix(reduced, leader.base, ends)
                red_op = SUM if op == AVG else op
                futures += [self._exec.submit(self._reduce, regions, ends, i, dtype, red_op, prefix)
                            for i in range(min(self._reducers, len(ends)))]
            if finish_here:
                futures.append(self._exec.submit(self._finish, regions, ends, final, dtype,
                                                 op == AVG and engine_op != op, world))
            if engine is not None:
                engine("allreduce", leader.addr, count, dtype, engine_op, ready=reduced, done=final,
                       base=leader.base, feedback_key=key)
            for f in futures:
                f.result()
        except BaseException:
            self.abort()
            for f in futures:  # they touch the segments: never return while one runs
                f.exception()
            raise
        finally:
            with self._lock:
                self._tickets = []

    def _wait(self, ticket: Any, value: int, what: str) -> None:
        ticket.wait(value, self._timeout_s, f"[daemon] pipelined all-reduce: {what}")

    def _reduce(self, regions: list[Region], ends: list[int], first: int, dtype: int, op: int,
                prefix: _Prefix) -> None:
        leader, es = regions[0], DTYPE_SIZE[dtype]
        for k in range(first, len(ends), self._reducers):
            begin = ends[k - 1] if k else 0
            for j, r in enumerate(regions):
                self._wait(r.ready, r.base + ends[k], f"local rank #{j}'s input")
            for r in regions[1:]:
                _core.reduce_inplace(r.addr + begin, leader.addr + begin, (ends[k] - begin) // es, dtype, op)
            prefix.finished(k)

    def _finish(self, regions: list[Region], ends: list[int], final: Any, dtype: int, divide: bool,
                world: int) -> None:
        leader, es = regions[0], DTYPE_SIZE[dtype]
        begin = 0
        for end in ends:
            self._wait(final, leader.base + end, "the host's result")
            if divide:
                _core.finalize_avg(leader.addr + begin, (end - begin) // es, dtype, world)
            for r in regions[1:]:
                ctypes.memmove(r.addr + begin, leader.addr + begin, end - begin)
                r.done.signal(r.base + end)
            leader.done.signal(leader.base + end)
            begin = end
