"""One job (communicator) as the daemon sees it: its local ranks, their segments, and
the ordered stream of collectives they submit.

Lifecycle: created by the first ``join`` -> *joining* until every local rank joined
and (multi-host) the engine communicator among the job's daemons is built -> *ready*
-> *failed* (any error: every pending and later op gets it) or *closed* (every local
rank left). Collectives run in the job's sequence order (``fastpath.FastPath.turn``): small
all-reduces and barriers on a native thread fed by the clients' shared-memory queues, the
rest on the job's own thread; the attach thread only files requests.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from libmccl import _core
from mccl_common import attach_protocol as protocol
from mccl_common import shm
from mccl_common.errors import (AbortedError, CollectiveMismatch, CollectiveTimeout, ConfigError, MCCLError,
                                PeerLostError, ProtocolError)
from mccl_common.settings import EngineConfig
from mccl_common.wire import DTYPE_SIZE

from .collectives import Hierarchy, Topology, per_rank_args
from .fastpath import FastPath, announced_queue
from .p2p import P2P_OPS, PointToPoint
from .reduce import ReducePool

log = logging.getLogger(__name__)

_CLOSE_BARRIER_S = 30.0
_ENGINE_POLL_S = 1.0       # how often a deadline-free engine op looks whether the engine closed
_ENGINE_CLOSE_S = 10.0     # bound on an op's end once its engine is shutting down
_STOP_JOIN_S = 10.0        # mccld stopping: for a failed job's thread to finish closing it
_MAILBOX_CLOSE_S = 2.0     # for the peers' closing headers after the closing barrier
# A peer daemon that fails a job tells us over its link and aborts the engine; the abort
# (or our own engine timeout) races the link message, which carries the real cause.
_PEER_VERDICT_GRACE_S = 2.0
# A peer host's verdict cuts the work running here only this long after it arrived: by then
# the peer's own engine abort has ended it (see fail()).
_PEER_VERDICT_CUT_S = 2.0


class JobHost(Protocol):
    """What a job needs from its daemon (service.JobService serves it)."""
    host_id: str
    pool: ReducePool
    engine_cfg: EngineConfig                  # the engine's settings (pipeline_bytes, ...)

    def reply(self, ident: bytes, req: int, payload: dict[str, Any]) -> None: ...
    def reply_error(self, ident: bytes, req: int, exc: BaseException) -> None: ...
    def take_segment(self, ident: bytes, name: str) -> int: ...   # the fd its client handed over (fd_inbox.py)
    def build_engine(self, job: "Job") -> Any: ...          # engine communicator among hosts
    def release_data_sockets(self, job: "Job", clean: bool) -> None: ...  # reuse them if clean
    def notify_peers_failed(self, job: "Job", exc: MCCLError) -> None: ...
    def record_collective(self, job: "Job", op: str, nbytes: int, seconds: float) -> None: ...
    def record_reduced(self, job: "Job", nbytes: int, encoded: int) -> None: ...  # across hosts
    def poll_traffic(self, job: "Job") -> None: ...           # the engine's byte counters -> exporter
    def job_closed(self, job: "Job") -> None: ...


@dataclass
class Member:
    rank: int
    ident: bytes
    pid: int
    join_req: int
    queue: tuple[str, int, int] | None = None  # its small-op queue: (segment, slot bytes, handed-over fd)
    segments: dict[str, shm.Segment] = field(default_factory=dict)   # its data segment (the latest)
    buffers: dict[str, shm.Segment] = field(default_factory=dict)    # where its tensors live (no copies)

    def segment(self, name: str) -> shm.Segment | None:
        return self.segments.get(name) or self.buffers.get(name)

    def names(self) -> list[str]:
        return [*self.segments, *self.buffers]

    def release(self) -> list[shm.Segment]:
        """Unlink the rank's segments now; the caller unmaps them once no op can touch them."""
        segs = [*self.segments.values(), *self.buffers.values()]
        for seg in segs:
            seg.unlink()
        if self.queue is not None and self.queue[2] >= 0:
            os.close(self.queue[2])    # the dispatcher, if any, mapped its own duplicate
            self.queue = (*self.queue[:2], -1)
        self.segments.clear()
        self.buffers.clear()
        return segs


@dataclass
class _Pending:
    ident: bytes
    req: int
    msg: protocol.Op
    since: float


class Job:
    def __init__(self, host: JobHost, job_id: str, size: int, hosts: tuple[protocol.Host, ...],
                 timeout_s: float, opts: dict[str, Any], compression: protocol.Compression = protocol.NO_COMPRESSION):
        self.host = host
        self.id = job_id
        self.size = size
        self.hosts = hosts
        self.compression = compression   # the first join's; every later one must say the same
        self.timeout_s = float(timeout_s)
        self.setup_timeout_s = protocol.setup_timeout(self.timeout_s)
        self.opts = opts
        ranks = sorted(r for h in hosts for r in h.ranks)
        if ranks != list(range(size)):
            raise ProtocolError(f"[daemon] job {job_id}: host list covers ranks {ranks}, expected 0..{size - 1}")
        mine = [i for i, h in enumerate(hosts) if h.host_id == host.host_id]
        if len(mine) != 1:
            raise ProtocolError(f"[daemon] job {job_id}: this host ({host.host_id}) appears {len(mine)} "
                                "times in the job's host list; are two daemons sharing a host id?")
        self.topo = Topology(size=size, hosts=[sorted(h.ranks) for h in hosts], host_rank=mine[0])
        self.members: dict[int, Member] = {}
        self.pending: dict[int, dict[int, _Pending]] = {}   # seq -> rank -> request
        self.failed: MCCLError | None = None
        self.state = "joining"
        self.created = time.monotonic()   # `mcclctl jobs` shows its AGE
        self.engine = None
        self.hierarchy: Hierarchy | None = None
        self.aborting = False        # we aborted the engine ourselves (vs. a peer aborting it)
        self._cut_at: float | None = None  # a peer's verdict: when to cut the work still running here
        self._freed = False                # mccld stopping: the segments are unmapped, no new ones
        self._ended = False                # the job's thread is gone: unmap where the request is
        self._lock = threading.RLock()
        # Held while p2p copies touch a segment, and while unmapping one (reentrant: the
        # attach thread takes it before running a small copy that takes it again).
        self.segment_lock = threading.RLock()
        self.p2p = PointToPoint(self)
        self.fast = FastPath(job_id, self.timeout_s)
        self._tasks: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._worker, name=f"mccld-job-{job_id}", daemon=True)
        self._thread.start()

    @property
    def local_ranks(self) -> list[int]:
        return self.topo.local

    @property
    def comm_id(self) -> int:
        return int(self.id, 16)

    # -- requests from the attach thread ---------------------------------------------------
    def join(self, ident: bytes, req: int, rank: int, pid: int, size: int, hosts: tuple,
             opts: dict[str, Any] | None = None,
             compression: protocol.Compression = protocol.NO_COMPRESSION) -> None:
        if compression != self.compression:
            # Ranks of one host that disagree (those of different hosts are caught by the clients,
            # which compare every rank's setting in the store before they join).
            with self._lock:
                first = min(self.members, default=None)
            err = ConfigError(f"[daemon] job {self.id}: rank {rank} joined with {compression}, "
                              f"{'rank ' + str(first) if first is not None else 'the job'} with {self.compression}; "
                              "every rank of a job must use the same compression settings: set them alike "
                              "in every training process's environment (or Options)", peer_rank=rank)
            self.fail(err, local=True)   # the ranks already waiting on their join get it too
            raise err
        fast_queue = announced_queue(self.id, rank, pid, opts)
        if fast_queue is not None:
            fast_queue = (*fast_queue, self.host.take_segment(ident, fast_queue[0]))
        try:
            self._join(ident, req, rank, pid, size, hosts, fast_queue)
        except BaseException:
            if fast_queue is not None:
                os.close(fast_queue[2])
            raise

    def _join(self, ident: bytes, req: int, rank: int, pid: int, size: int, hosts: tuple,
              fast_queue: tuple[str, int, int] | None) -> None:
        with self._lock:
            if size != self.size or hosts != self.hosts:
                raise CollectiveMismatch(f"[daemon] job {self.id}: rank {rank} joined with size {size} and "
                                         f"hosts {hosts}, others with size {self.size} and {self.hosts}")
            if rank not in self.local_ranks:
                raise ProtocolError(f"[daemon] job {self.id}: rank {rank} is not placed on this host "
                                    f"({self.host.host_id}); local ranks are {self.local_ranks}")
            if rank in self.members:
                raise ProtocolError(f"[daemon] job {self.id}: rank {rank} joined twice")
            if self.failed is not None:
                raise self.failed
            self.members[rank] = Member(rank, ident, pid, req, fast_queue)
            if len(self.members) == len(self.local_ranks):
                self._tasks.put(("setup", None))

    def register(self, rank: int, ident: bytes, name: str, nbytes: int, buffer: bool = False) -> None:
        member = self._member(rank, ident)
        if shm.owner_pid(name) != member.pid:
            raise ProtocolError(f"[daemon] job {self.id} rank {rank}: segment {name} is not named after the "
                                f"client's pid {member.pid}")
        if member.segment(name) is not None:
            # An op may be running on (or was checked against) that mapping: segments are immutable.
            raise ProtocolError(f"[daemon] job {self.id} rank {rank}: field 'segment'={name} is already "
                                "registered; a client registers each new segment under a new name")
        if buffer and len(member.buffers) >= protocol.MAX_BUFFERS_PER_RANK:
            raise ConfigError(f"[daemon] job {self.id} rank {rank}: already {len(member.buffers)} shared "
                              f"buffers registered (at most {protocol.MAX_BUFFERS_PER_RANK} per rank); the "
                              "client leaks them: allocate fewer, larger ones")
        seg = shm.Segment.adopt(name, nbytes, self.host.take_segment(ident, name), ticket_at=_core.Ticket.at)
        with self._lock:
            if self._freed:
                # mccld is stopping and has unmapped this job's segments: the attach thread can
                # still be working through a client's backlog, and nothing would unmap this one
                # (a CI run's leak check found its two fds on a stopped in-process mccld).
                seg.close()
                raise AbortedError(f"[daemon] job {self.id}: mccld is stopping; segment {name} not mapped")
            if buffer:
                member.buffers[name] = seg
                return
            # A client registers a new (larger) segment only between ops: the old one is
            # unused, and unmapping it is what returns its memory (the client unlinked it).
            old = list(member.segments.values())
            member.segments = {name: seg}
        self._unmap(old)

    def release_buffer(self, rank: int, ident: bytes, name: str) -> None:
        """The rank's tensors on buffer ``name`` are gone. Unmapped by the job's thread, after
        any op already queued there (the client releases a buffer only once its ops completed)."""
        member = self._member(rank, ident)
        with self._lock:
            seg = member.buffers.pop(name, None)
        if seg is None:
            raise ProtocolError(f"[daemon] job {self.id} rank {rank}: release of {name}, which is not one of "
                                "its registered buffers")
        seg.unlink()  # the client unlinked it too; whichever comes first frees the name
        self._unmap([seg])

    def submit(self, ident: bytes, req: int, msg: protocol.Op) -> None:
        rank = msg.rank
        member = self._member(rank, ident)
        if msg.op in P2P_OPS:
            # Point-to-point is not part of the collective order (``seq`` is ignored).
            with self._lock:
                if self.failed is not None:
                    raise self.failed
                if self.state != "ready":
                    raise ProtocolError(f"[daemon] job {self.id}: {msg.op} before the job is ready")
            self.p2p.submit(ident, req, rank, msg.op, msg.args)
            return
        seg = member.segment(msg.args.get("segment", ""))
        need = msg.span(self.size)
        if need and (seg is None or seg.nbytes < need):
            raise ProtocolError(f"[daemon] job {self.id} rank {rank}: {msg.op} needs {need} bytes of a "
                                "registered segment; register it first")
        with self._lock:
            if self.failed is not None:
                raise self.failed
            if self.state != "ready":
                raise ProtocolError(f"[daemon] job {self.id}: collective before the job is ready")
            waiting = self.pending.setdefault(msg.seq, {})
            if rank in waiting:
                raise ProtocolError(f"[daemon] job {self.id} rank {rank}: sequence number {msg.seq} reused")
            waiting[rank] = _Pending(ident, req, msg, time.monotonic())
            if len(waiting) == len(self.local_ranks):
                del self.pending[msg.seq]
                self._tasks.put(("op", waiting))

    def leave(self, rank: int, ident: bytes, abort_reason: str | None) -> None:
        with self._lock:
            member = self.members.get(rank)
            if member is None or member.ident != ident:
                return
            if abort_reason is not None:
                self.fail(AbortedError(f"[daemon] job {self.id}: rank {rank} aborted the communicator: "
                                       f"{abort_reason or 'no reason given'}", peer_rank=rank), local=True)
            del self.members[rank]
            self.p2p.forget(rank)
            segs, last = member.release(), not self.members
        self._unmap(segs)   # not under the job's lock: the unmap may take segment_lock (see _unmap)
        if last:
            self._tasks.put(("close", None))

    def client_died(self, rank: int) -> None:
        with self._lock:
            member = self.members.pop(rank, None)
            if member is None:
                return
            self.p2p.forget(rank)
            segs, last = member.release(), not self.members
            self.fail(PeerLostError(f"[daemon] job {self.id}: rank {rank} (pid {member.pid}) on host "
                                    f"{self.host.host_id} died; its process crashed or was killed; "
                                    "restart the job", peer_rank=rank), local=True)
        # Unmapped by the job thread: an op in flight may still be reading or writing it.
        self._unmap(segs)
        if last:
            self._tasks.put(("close", None))

    def check_timeouts(self, now: float) -> None:
        with self._lock:
            for seq, waiting in self.pending.items():
                oldest = min(p.since for p in waiting.values())
                if now - oldest > self.timeout_s:
                    missing = sorted(set(self.local_ranks) - set(waiting))
                    self.fail(CollectiveTimeout(
                        f"[daemon] Timed out after {self.timeout_s:.0f}s in job {self.id}: local rank(s) {missing} "
                        f"did not submit collective #{seq} while {sorted(waiting)} waited; a rank is stuck or "
                        "took another code path", peer_rank=missing[0]), local=True)
                    return
        self._cut_if_due(now)
        self._record_fast()
        late = self.p2p.overdue(now)
        if late is not None:
            self.fail(late, local=True)

    def fail(self, exc: MCCLError, local: bool) -> None:
        """Fail every pending and later op with ``exc``; ``local``: tell the peer daemons too."""
        with self._lock:
            verdict = self.failed
            if verdict is None:
                self.failed = exc
                self.state = "failed"
                pending = [p for waiting in self.pending.values() for p in waiting.values()]
                self.pending.clear()
                joining = [(m.ident, m.join_req) for m in self.members.values()] if self.hierarchy is None else []
        if verdict is not None:
            # Another thread set the verdict and may not have failed the dispatcher yet; a
            # dispatcher whose own error brought us here fails its clients with that raw error
            # once we return, unless it holds the verdict first (idempotent: the first wins).
            self.fast.fail(verdict)
            return
        log.warning("%s", exc)
        # A peer host's verdict with the engine up: the op running here may have all its data
        # already. The peer finished its part before its rank died, and the ABORT frames its
        # engine sends come behind that data, so they end the op here either way. Cutting it
        # now reported a finished op failed (a CI run: a 2-host job whose rank died right
        # after an all-reduce failed that all-reduce on the other host). Ops not started fail
        # now; check_timeouts cuts what still runs _PEER_VERDICT_CUT_S later.
        let_finish = not local and self.engine is not None
        if let_finish:
            with self._lock:
                self._cut_at = time.monotonic() + _PEER_VERDICT_CUT_S
        else:
            self._stop_local_work(exc)
        self.p2p.fail(exc)
        for p in pending:
            self.host.reply_error(p.ident, p.req, exc)
        for ident, req in joining:
            self.host.reply_error(ident, req, exc)
        if local and len(self.topo.hosts) > 1:
            self.host.notify_peers_failed(self, exc)  # before the ABORT frames, which echo it
        if not let_finish and not self._abort_engine(exc) and len(self.topo.hosts) > 1:
            # Still setting up: dropping its data sockets ends a handshake waiting on them now
            # rather than at the connect timeout.
            self.host.release_data_sockets(self, False)

    def _cut_if_due(self, now: float | None) -> None:
        """Cuts what a peer's verdict left running here, once due (``now`` None: at once)."""
        with self._lock:
            due = self._cut_at is not None and (now is None or now >= self._cut_at)
            if due:
                self._cut_at = None
        if due and self.failed is not None:
            self._stop_local_work(self.failed)
            self._abort_engine(self.failed)

    def _stop_local_work(self, exc: MCCLError) -> None:
        """Ends the small ops' dispatcher and the pipeline, which may wait on a rank that is gone."""
        self.fast.fail(exc)  # before the engine's abort: its verdict must not be the one clients see
        if self.hierarchy is not None:
            self.hierarchy.pipeline.abort()

    def _abort_engine(self, exc: MCCLError) -> bool:
        """Aborts the job's engine, if it has one yet (or still)."""
        engine = self.engine
        if engine is None:
            return False
        self.aborting = True
        try:
            engine.abort(str(exc))
        except Exception:  # noqa: BLE001 - aborting is best effort, the job is failed anyway
            log.debug("engine abort of job %s raised", self.id, exc_info=True)
        return True

    def close(self, *, stopping: bool = False) -> None:
        """Close once the last rank left; ``stopping`` (mccld is going away): close now, with
        ranks still joined, and wait for the job's thread to end."""
        self._tasks.put(("stop" if stopping else "close", None))
        if stopping and self._thread is not threading.current_thread():
            self._thread.join(_STOP_JOIN_S)

    def free_segments(self) -> None:
        """Unmap and unlink every local rank's segments (the daemon is going away)."""
        with self._lock:
            self._freed = True
            # Released under the lock: a member's queue descriptor closes only where the job's
            # thread, duplicating them for the dispatcher under the same lock, cannot be at it.
            released = [m.release() for m in self.members.values()]
        for segs in released:
            self._unmap(segs)

    def _unmap(self, segs: list[shm.Segment]) -> None:
        """Unmaps ``segs`` on the job's thread, after the ops queued there before; once that thread
        has ended, here and now. A request can still be on its way while mccld stops: a CI run's
        leak check found a buffer whose release the attach thread took just before the job's
        thread ended at ``stop``, queued behind it, and so mapped for good. The caller must not
        hold the job's lock: ``segment_of`` takes it under ``segment_lock``."""
        with self._lock:
            if not self._ended:
                self._tasks.put(("unmap", segs))
                return
        self._close_segments(segs)

    def _close_segments(self, segs: list[shm.Segment]) -> None:
        with self.segment_lock:
            for seg in segs:
                seg.close()

    # -- the job's thread ------------------------------------------------------------------
    def segment_of(self, rank: int, name: str, nbytes: int) -> shm.Segment:
        """A rank's mapped segment of at least ``nbytes``; the caller holds ``segment_lock``."""
        with self._lock:
            member = self.members.get(rank)
            seg = member.segment(name) if member is not None else None
        if seg is None or seg.closed or seg.nbytes < nbytes:
            raise ProtocolError(f"[daemon] job {self.id} rank {rank}: no registered segment {name!r} of "
                                f"{nbytes} bytes; the rank left, or its client skipped register")
        seg.check_size()
        return seg

    def _segment_for(self, rank: int, name: str) -> shm.Segment:
        seg = self.members[rank].segment(name)
        if seg is None:
            raise KeyError(name)   # the rank released or re-registered it after submitting: see _run
        return seg

    def _member(self, rank: int, ident: bytes) -> Member:
        member = self.members.get(rank)
        if member is None or member.ident != ident:
            raise ProtocolError(f"[daemon] job {self.id}: rank {rank} is not joined from this connection")
        return member

    def _worker(self) -> None:
        while True:
            try:
                kind, item = self._tasks.get(timeout=self.setup_timeout_s)
            except queue.Empty:
                if self.state == "joining" and self.failed is None:
                    with self._lock:
                        missing = sorted(set(self.local_ranks) - set(self.members))
                    self.fail(CollectiveTimeout(
                        f"[daemon] Timed out after {self.timeout_s:.0f}s in job {self.id}: local rank(s) "
                        f"{missing} never joined; they did not start or use another daemon",
                        peer_rank=missing[0] if missing else -1), local=True)
                continue
            if kind == "setup":
                self._setup()
            elif kind == "op":
                self._run(item)
            elif kind == "unmap":
                self._close_segments(item)
            elif kind in ("close", "stop"):
                with self._lock:
                    if self.members and kind == "close":
                        continue
                try:
                    self._shutdown()
                finally:
                    self._end()
                return

    def _end(self) -> None:
        """The thread's last act: the unmaps queued behind its stop are done now, later ones by
        ``_unmap`` itself (nothing else is queued once the job closed or mccld stopped)."""
        with self._lock:
            self._ended = True
        while True:
            try:
                kind, item = self._tasks.get_nowait()
            except queue.Empty:
                return
            if kind == "unmap":
                self._close_segments(item)

    def _setup(self) -> None:
        try:
            engine = self.host.build_engine(self) if len(self.topo.hosts) > 1 else None
        except MCCLError as e:
            self.fail(e, local=True)
            return
        except Exception as e:  # noqa: BLE001 - surfaced to the clients, not swallowed
            self.fail(ProtocolError(f"[daemon] job {self.id}: building the host communicator failed: {e}"),
                      local=True)
            return
        try:
            with self._lock:
                # Duplicates, taken under the lock that members release theirs under: a rank leaving
                # now cannot close the number (and another file take it) before the dispatcher maps it.
                queues = {r: None if m.queue is None or m.queue[2] < 0 else (*m.queue[:2], os.dup(m.queue[2]))
                          for r, m in self.members.items()} if self.failed is None else {}
            try:
                self.fast.start(self.local_ranks, queues, self.size, len(self.topo.hosts), engine,
                                self._fast_failed)
            finally:
                for q in queues.values():
                    if q is not None:
                        os.close(q[2])
        except MCCLError as e:
            if engine is not None:
                engine.abort(str(e))
            self.fail(e, local=True)
            return
        with self._lock:
            if self.failed is not None:
                if engine is not None:
                    engine.abort(str(self.failed))
                    self.host.release_data_sockets(self, False)
                return
            self.engine = engine
            self.hierarchy = Hierarchy(self.topo, self.host.pool, self._engine_run if engine else None,
                                       self.host.engine_cfg.pipeline_bytes, self.timeout_s)
            if engine is not None:
                self.p2p.start_network(self._engine_run)
            self.state = "ready"
            joined = [(m.ident, m.join_req) for m in self.members.values()]
        log.info("job %s ready: %d rank(s), %d here, %d host(s)", self.id, self.size,
                 len(self.local_ranks), len(self.topo.hosts))
        for ident, req in joined:
            self.host.reply(ident, req, {"ok": True, "local_ranks": self.local_ranks,
                                         "hosts": len(self.topo.hosts), "compression": self.compression.codec})

    def _engine_run(self, method: str, *args, deadline: bool = True, **tickets) -> None:
        """Runs one engine op to its end. ``deadline=False`` (p2p only): the op may wait
        as long as the engine lives (the mailbox receive); a peer's failure, the job's
        abort or the engine's shutdown end it."""
        engine = self.engine
        if engine is None:
            raise self.failed or AbortedError(f"[daemon] job {self.id} is closed; no engine op can start")
        try:
            if deadline:
                engine.wait(getattr(engine, method)(*args, **tickets), engine.own_error_bound_s(self.timeout_s))
            else:
                op_id = getattr(engine, method)(*args, timeout_s=0)
                while not engine.wait_for(op_id, _ENGINE_POLL_S):
                    if self.engine is not engine:
                        # Shut down while this op was pending: shutdown fails it (at its own timeout).
                        engine.wait(op_id, _ENGINE_CLOSE_S)
        except (AbortedError, CollectiveTimeout) as e:
            raise self._engine_verdict(e) from None
        except MCCLError as e:
            raise self._in_host_terms(e) from None
        finally:
            # The verdict raised here is often the job's own (``self.failed``), and the p2p
            # mailbox receive raises it after a failed job closed (past _drop_frames): its
            # traceback, and the engine error it was raised over, hold this frame. Without
            # the engine in it, a shut-down engine (its threads' pipes) goes with its last
            # owner, not at a cyclic GC (the fuzz run's no-GC check, 2 in 17 under load).
            engine = None  # noqa: F841

    def _engine_verdict(self, e: AbortedError | CollectiveTimeout) -> MCCLError:
        """What an engine op that was aborted or timed out tells the ranks."""
        if self.failed is None and not self.aborting:
            # Every local rank is here, so the culprit is on another host; its
            # daemon's verdict names the rank (a stuck one, a dead one).
            until = time.monotonic() + _PEER_VERDICT_GRACE_S
            while self.failed is None and time.monotonic() < until:
                time.sleep(0.05)
        if self.failed is not None:
            return self.failed
        if isinstance(e, AbortedError) and not self.aborting:
            # A peer daemon aborted the engine: that only happens when it lost a rank.
            return PeerLostError(f"[daemon] job {self.id}: a peer host aborted the job ({self._engine_peer(e)}); "
                                 "a rank on another host died or left", peer_rank=self._peer_rank(e),
                                 peer_addr=e.peer_addr)
        return self._in_host_terms(e)

    def _in_host_terms(self, e: MCCLError) -> MCCLError:
        """An engine error naming a peer, with that peer said as the job's host and its ranks."""
        if e.peer_rank is None:
            return e
        return type(e)(self._engine_peer(e), peer_rank=self._peer_rank(e), peer_addr=e.peer_addr)

    # The engine among the daemons has one rank per host: its "rank N" is host N of the job,
    # which a user would read as a torch rank. These put the host and its ranks beside it.
    def _peer_rank(self, e: MCCLError) -> int | None:
        h = e.peer_rank
        return self.topo.hosts[h][0] if h is not None and 0 <= h < len(self.topo.hosts) else None

    def _engine_peer(self, e: MCCLError) -> str:
        h = e.peer_rank
        if h is None or not 0 <= h < len(self.hosts):
            return str(e)
        return (f"{e} [in job {self.id} the engine's rank {h} is host {self.hosts[h].host_id}, "
                f"ranks {self.topo.hosts[h]}]")

    def _fast_failed(self, exc: MCCLError, from_engine: bool) -> None:
        """The native dispatcher's verdict (its own thread): fail the job with it."""
        if from_engine:
            exc = (self._engine_verdict(exc) if isinstance(exc, (AbortedError, CollectiveTimeout))
                   else self._in_host_terms(exc))
        self.fail(exc, local=True)

    def _run(self, waiting: dict[int, _Pending]) -> None:
        seq = waiting[self.local_ranks[0]].msg.seq
        try:
            self._run_op(waiting)
        finally:
            if self.failed is None:
                self.fast.finished(seq)

    def _run_op(self, waiting: dict[int, _Pending]) -> None:
        first = waiting[self.local_ranks[0]].msg
        started = time.monotonic()
        try:
            if self.failed is not None:
                raise self.failed
            self.fast.wait_turn(first.seq)
            started = time.monotonic()  # the op's own time, not its wait for the ones before it
            own = per_rank_args(first.op)
            b = {k: v for k, v in first.args.items() if k not in own}
            for p in waiting.values():
                if p.msg is first:
                    continue
                a = {k: v for k, v in p.msg.args.items() if k not in own}
                if p.msg.op != first.op or a != b:
                    raise CollectiveMismatch(
                        f"[daemon] job {self.id} collective #{first.seq}: rank {p.msg.rank} called "
                        f"{p.msg.op}{a}, rank {first.rank} called {first.op}{b}; every rank must "
                        "issue the same collectives in the same order", peer_rank=p.msg.rank)
            segs = {r: self._segment_for(r, p.msg.args["segment"])
                    for r, p in waiting.items() if p.msg.args.get("segment")}
            for seg in segs.values():
                seg.check_size()   # a client may have truncated it since register (mccl_common/shm.py)
            bases = {r: segs[r].addr if r in segs else 0 for r in waiting}
            self.hierarchy.run(first.op, bases, {r: p.msg.args for r, p in waiting.items()},
                               {r: (s.ready, s.done) for r, s in segs.items()})
        except MCCLError as e:
            if not isinstance(e, ConfigError):
                self.fail(e, local=True)
                e = self.failed or e  # a pipelined op's poisoned tickets only echo the cause
            for p in waiting.values():
                self.host.reply_error(p.ident, p.req, e)
            return
        except KeyError as e:
            err = ProtocolError(f"[daemon] job {self.id}: a rank left or its segment vanished mid-op ({e})")
            self.fail(err, local=True)
            for p in waiting.values():
                self.host.reply_error(p.ident, p.req, err)
            return
        seconds = time.monotonic() - started
        # Reply first: the exporter's bookkeeping (histograms, the engine's traffic
        # counters) cost ~15-20 us of Python that the ranks need not wait for.
        for p in waiting.values():
            self.host.reply(p.ident, p.req, {"ok": True})
        nbytes = _nbytes_for_stats(first.op, first.args, self.size)
        if first.op in ("allreduce", "reduce_scatter") and len(self.topo.hosts) > 1:
            self.host.record_reduced(self, nbytes, self._encoded_bytes(first.op, first.args, nbytes))
        self.host.record_collective(self, first.op, nbytes, seconds)

    def _record_fast(self) -> None:
        for op, nbytes, seconds in self.fast.records():
            if op == "allreduce" and len(self.topo.hosts) > 1:
                # Exact: a client sends the all-reduces its job compresses to the job's thread.
                self.host.record_reduced(self, nbytes, nbytes)
            self.host.record_collective(self, op, nbytes, seconds)

    def _encoded_bytes(self, op: str, args: Any, nbytes: int) -> int:
        """Bytes the host's contribution of ``nbytes`` (an all-reduce's input across hosts)
        takes on the wire: encoded where the engine compresses it, else as is."""
        dtype, redop = args["dtype"], args["op"]
        if len(self.topo.hosts) < 2 or not self.compression.applies(dtype, redop, nbytes, _core.compress_applies):
            return nbytes
        return _core.compress_encoded_bytes(self.compression.codec, nbytes // DTYPE_SIZE[dtype])

    def _shutdown(self) -> None:
        self._cut_if_due(None)  # every rank left: no one waits for the op still running
        self.fast.close()   # every rank left: no small op is in flight
        self._record_fast()
        self.p2p.stop()     # our ranks' last sends are written
        engine = self.engine
        if engine is not None:
            if self.failed is None:
                # Every daemon of the job closes it once its ranks left; a last barrier keeps
                # us from closing links a peer is still draining its final collective from.
                try:
                    engine.wait(engine.barrier(), min(self.timeout_s, _CLOSE_BARRIER_S))
                except Exception as e:  # noqa: BLE001 - a peer already gone: nothing left to protect
                    log.debug("closing barrier of job %s: %s", self.id, e)
            # Only now, with every host's ranks gone, may the mailboxes end (p2p.py).
            self.p2p.close_network()
            # Every set-up host sends its closing header past the barrier too, so the mailbox
            # receive ends at once; one still pending means a peer is gone: do not wait on it.
            settled = self.p2p.network_done(_MAILBOX_CLOSE_S if self.failed is None else 0.0)
            # The closing headers are the job's last bytes: count them while the engine exists,
            # or one host's sent and the other's received counters differ by them.
            self.host.poll_traffic(self)
            self.engine = None
            clean = False
            try:
                # True only if every data socket ended at the peer's BYE: then they serve the next job.
                clean = engine.shutdown(5.0 if settled else 0.0) is True
            except Exception:  # noqa: BLE001 - the job is over either way
                log.debug("engine shutdown of job %s raised", self.id, exc_info=True)
            self.host.release_data_sockets(self, clean and self.failed is None)
        if self.hierarchy is not None:
            self.hierarchy.close()
        self.state = "closed" if self.failed is None else self.state
        _drop_frames(self.failed)
        log.info("job %s closed", self.id)
        self.host.job_closed(self)


def _nbytes_for_stats(op: str, args: dict[str, Any], size: int) -> int:
    es = DTYPE_SIZE[args["dtype"]] if "dtype" in args else 1
    if op in ("allreduce", "reduce"):
        return args["count"] * es
    if op == "reduce_scatter":
        return args["count"] * es * size
    if op in ("allgather", "gather", "scatter"):
        return args["nbytes"] * size
    if op == "alltoallv":
        return sum(args["send_sizes"])
    return args.get("nbytes", 0)


def _drop_frames(exc: BaseException | None) -> None:
    """Each raise of a failed job's error (and the engine error it was raised over) kept the
    frames of ``_engine_run``, whose locals hold the engine: a cycle through the job that
    kept the engine's threads and pipes until a full GC (found by scripts/faults/campaign.py)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        nxt = exc.__cause__ or exc.__context__
        exc.__cause__ = exc.__context__ = None
        exc = nxt
