"""A job's one collective order, and its small-op path served by a native thread.

Every collective of a job carries the client's sequence number (1, 2, ...). ``turn`` is a
ticket holding the number of the last one finished on this host; whoever runs op s, the
native dispatcher (``_core.FastDispatcher``: small all-reduces and barriers, from the
clients' shared-memory queues) or the job's Python worker (everything else, from
ZeroMQ), starts it only once turn >= s - 1 and raises turn to s after it. So the engine
communicator sees one op sequence on every host, never two collectives of a job at once,
whichever path each op took. docs/daemon-fastpath.md has the whole design.

This module is the Python side of that: it checks what the clients announced at join
(their queue segment and slot size), starts the dispatcher once the job is ready, hands
its verdicts to the job, and drains its op records into the exporter.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from libmccl import _core
from mccl_common import errors, shm
from mccl_common.errors import ConfigError, MCCLError, ProtocolError, from_kind

log = logging.getLogger(__name__)

_MAX_SLOT_BYTES = 16 << 20
_OP_NAME = {_core.FAST_ALLREDUCE: "allreduce", _core.FAST_BARRIER: "barrier"}


def announced_queue(job: str, rank: int, pid: int, opts: Any) -> tuple[str, int] | None:
    """(segment name, slot bytes) of the small-op queue a joining rank announced, checked; None if none."""
    if not isinstance(opts, dict) or "fast_queue" not in opts:
        return None
    name, slot = opts.get("fast_queue"), opts.get("fast_bytes")
    if not isinstance(name, str) or shm.owner_pid(name) != pid:
        raise ProtocolError(f"[daemon] job {job} rank {rank}: small-op queue {name!r} is not a segment named "
                            f"after the client's pid {pid}; client and daemon releases differ?")
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 < slot <= _MAX_SLOT_BYTES:
        raise ProtocolError(f"[daemon] job {job} rank {rank}: small-op slot of {slot!r} bytes; expected "
                            f"1..{_MAX_SLOT_BYTES} (MCCL_DAEMON_FAST_BYTES)")
    return name, slot


class FastPath:
    """``turn`` orders the job's collectives; ``start`` adds the native dispatcher."""

    def __init__(self, job_id: str, timeout_s: float):
        self.job_id = job_id
        self.timeout_s = timeout_s
        self._dispatcher: Any = None
        self._final: list[tuple[int, int, float]] = []  # the closed dispatcher's last records
        self.turn = _core.Ticket()  # replaced by the dispatcher's own once it starts

    def start(self, local_ranks: list[int], queues: dict[int, tuple[str, int, int] | None], world: int, hosts: int,
              engine: Any, on_fail: Callable[[MCCLError, bool], None]) -> None:
        """Serve the local ranks' queues; nothing to do if no rank announced one. Raises
        ConfigError if only some did, or with different slot sizes (different settings)."""
        have = {r: q for r, q in queues.items() if q is not None}
        if not have:
            return
        slots = {q[1] for q in have.values()}
        if len(have) != len(local_ranks) or len(slots) > 1:
            without = sorted(set(local_ranks) - set(have))
            shown = {r: q[:2] for r, q in have.items()}
            raise ConfigError(f"[daemon] job {self.job_id}: local ranks disagree on MCCL_DAEMON_FAST_BYTES "
                              f"(queues: {{rank: (segment, bytes)}} = {shown}, without one: {without}); "
                              "give every rank of the job the same setting")

        # Weakly: the dispatcher is a C++ object the cyclic GC cannot see through, so a strong
        # reference back to the job would keep the job, and the engine the dispatcher holds
        # (its threads and pipes), alive forever.
        target = weakref.WeakMethod(on_fail) if hasattr(on_fail, "__self__") else (lambda: on_fail)

        def failed(kind: int, message: str, peer_rank: int, peer_addr: str, from_engine: bool) -> None:
            fn = target()
            if fn is not None:
                fn(from_kind(kind, message, peer_rank, peer_addr), from_engine)

        # The queues' descriptors, as their clients handed them over (sealed: mccl_common/shm.py);
        # the dispatcher maps duplicates, the members keep and close theirs.
        self._dispatcher = _core.FastDispatcher(self.job_id, local_ranks, [have[r][0] for r in local_ranks],
                                                [have[r][2] for r in local_ranks], slots.pop(), world, hosts,
                                                self.timeout_s, engine, failed)
        self.turn = self._dispatcher.turn
        log.info("job %s: small ops served natively for local ranks %s", self.job_id, local_ranks)

    def wait_turn(self, seq: int) -> None:
        """Blocks the job's worker until every collective before ``seq`` finished here. With
        no dispatcher the worker is the only path and runs the ops in arrival order already
        (a raw client whose refused requests left gaps in its numbers runs on)."""
        if self._dispatcher is None:
            return
        self.turn.wait(seq - 1, self.timeout_s * 3,
                       f"[daemon] job {self.job_id}: collective #{seq} waiting for the small ones before it")

    def finished(self, seq: int) -> None:
        self.turn.signal(seq)

    def fail(self, exc: MCCLError) -> None:
        """Every waiter wakes: the clients (with ``exc``), the dispatcher and the worker."""
        if self._dispatcher is not None:
            self._dispatcher.fail(_kind_of(exc), str(exc), exc.peer_rank if exc.peer_rank is not None else -1,
                                  exc.peer_addr or "")
        else:
            self.turn.poison()

    def close(self) -> None:
        """Stops the dispatcher and lets go of it (and of the engine it holds)."""
        d, self._dispatcher = self._dispatcher, None
        if d is not None:
            d.close()
            self._final = d.take_records()
            self.turn = _core.Ticket()  # the dispatcher's own word goes with it

    def records(self) -> list[tuple[str, int, float]]:
        """(op, bytes, seconds) of the small ops served since the last call."""
        if self._dispatcher is None:
            taken, self._final = self._final, []
        else:
            taken = self._dispatcher.take_records()
        return [(_OP_NAME.get(k, "?"), n, s) for k, n, s in taken]


def _kind_of(exc: MCCLError) -> int:
    """The error kind the clients rebuild ``exc`` from (its class, or the nearest typed base)."""
    kinds = {cls: kind for kind, cls in errors._KINDS.items()}
    return next((kinds[cls] for cls in type(exc).__mro__ if cls in kinds), 0)
