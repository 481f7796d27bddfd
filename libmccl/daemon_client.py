"""``MCCL_DAEMON=1``: hand this process's collectives to the local mccld.

``DaemonCommunicator`` has the engine communicator's API (docs/dev/interfaces.md §1),
so the torch glue drives either one the same way. Tensor data moves through one
shared-memory segment per rank (``mccl-<job>-<rank>-<pid>-<gen>``, a sealed memfd on Linux
handed to mccld by descriptor, mccl_common/fd_handover.py; regrown on demand); control
messages go over ZeroMQ to the daemon's ``ipc://`` socket, once the client checked that
mccld's user listens there (mccl_common/localtrust.py).

Ops run one at a time in call order, like the engine's own thread: the next op's
input is copied into the segment only when the previous op completed, so the segment
is never overwritten under the daemon. A large all-reduce is pipelined: its request goes
first, then the tensor is copied in piece by piece, raising the segment's ``ready``
ticket, and results are copied out as the daemon's ``done`` ticket covers them
(mccl_common/shm.py: the layout; mccld/jobs/pipelined.py: the daemon's side); the reply still
carries success or the typed error. A recv is the exception: it is posted at once
and only its data's way in (``take``) is queued, once a send matched
(``daemon_p2p.py``). Each call's segment layout is in ``daemon_ops.py``, the start of
the connection (hello, rendezvous, join) in ``daemon_attach.py``. Small all-reduces and barriers
skip ZeroMQ: they go through the rank's small-op queue in shared memory, which a native
thread of mccld serves (``_core.FastQueue``; docs/daemon-fastpath.md), in the same one-at-a-time
order and under the same job sequence numbers. A single I/O thread owns the ZeroMQ socket;
callers hand it ops through an inproc pipe, and completions (ZeroMQ push from the
daemon) run ``on_complete`` on that thread. If the daemon goes away, every pending and
later op fails with DaemonUnavailableError; nothing waits longer than ``timeout_s``.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from mccl_common import attach_protocol as protocol
from mccl_common import fd_handover
from mccl_common import errors, shm
from mccl_common.daemon_settings import DaemonConfig, runtime_dir
from mccl_common.errors import (AbortedError, CollectiveTimeout, ConfigError, DaemonUnavailableError, MCCLError,
                                ProtocolError)
from mccl_common.settings import EngineConfig, load
from mccl_common.wire import DTYPE_SIZE

from .copy_stats import CopyStats
from .daemon_attach import Attachment
from .daemon_buffers import BufferTable, SharedBuffer
from .daemon_gates import Gate, GateWatcher, gate_timeout
from .daemon_ops import OpBuilder, OpSpec
from .daemon_p2p import PostedRecv, PostedRecvs

log = logging.getLogger(__name__)

_RESULTS_KEPT = 4096                             # completions remembered for wait()
# Our own deadlines run this much past the longest mccld's engine may take to end an op with
# its own error (_set_verdict_bound): mccld may wait 2 s more for a peer's verdict, which names
# the stuck rank; ours can only say that nothing came.
_VERDICT_MARGIN_S = 4.0
_P2P_OPS = ("send", "take")                      # outside the job's collective order
_KIND_OF = {cls: kind for kind, cls in errors._KINDS.items()}
_IO_JOIN_S = 5.0                                 # bound on the I/O thread's stop
_LEAVE_WAIT_S = 1.0                              # for the daemon's answer to our leave
_EXIT_DRAIN_S = 2.0                              # pending ops' last chance at interpreter exit
# A pipelined op's results are awaited in slices this long, looking at the daemon's
# socket between them (an error reply, a lost daemon).
_PUMP_SLICE_S = 0.05
# The copy-in runs at most this many of the engine's pieces (or MCCL_DAEMON_COPY_AHEAD_BYTES)
# ahead of the results: the ring keeps four pieces in flight (algorithms/ring.cc) and needs
# the next one ready as the first of them finishes.
_LEAD_PIECES = 5
# If `done` has not moved for this long while input is held back, the rest is copied in at
# once: the lead follows how mccld said its engine cuts (hello), and should that ever be
# wrong the daemon would wait for input that never comes, until the op's timeout.
_LEAD_VALVE_S = 5.0
# Pipelined all-reduces, summed over the ops in stats(): seconds from sending the op until
# its input was all copied in, its first and its last result announced, and it finished here.
_PHASES = ("pipelined_input_in_s", "pipelined_first_result_s", "pipelined_all_results_s", "pipelined_op_s")

_live: "weakref.WeakSet[DaemonCommunicator]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """Finish every communicator's teardown before the interpreter finalizes. An I/O thread
    still failing ops then (it runs torch future callbacks) is frozen inside torch's C++ when
    it next takes the GIL, and a thread frozen there aborts the process (pthread_exit unwinds
    a noexcept frame: SIGABRT, seen when mccld was killed); its segment would stay behind too."""
    for comm in list(_live):
        try:
            comm.shutdown(_EXIT_DRAIN_S)
        except Exception:  # noqa: BLE001 - interpreter exit: nothing left to report to
            log.debug("[daemon-client] shutdown at exit failed", exc_info=True)


def _err_tuple(exc: MCCLError) -> tuple[int, str, int, str]:
    kind = _KIND_OF.get(type(exc), 0)
    return (kind, str(exc), exc.peer_rank if exc.peer_rank is not None else -1, exc.peer_addr or "")


def _daemon_cut(cfg: Any, told: dict[str, int]) -> Any:
    """The engine Options that say how mccld cuts an all-reduce into pieces: what its hello
    reply said (checked by daemon_attach), else (an older mccld) our own settings."""
    from . import _core
    o = _core.Options()
    o.pipeline_bytes = told.get("pipeline_bytes", cfg.pipeline_bytes)
    o.small_allreduce_bytes = told.get("small_allreduce_bytes", cfg.small_allreduce_bytes)
    return o


@dataclass
class _Pipe:
    """How far a pipelined op's copies got (bytes of its one range, from the segment's start)."""
    ptr: int
    nbytes: int
    base: int                                  # the op's start in the segment's ticket counts
    seg: Any = None                            # the segment whose tickets order it
    in_place: bool = False                     # in a shared buffer: nothing to copy, only to wait
    lead: int = 0                              # copy in at most this far ahead of copied_out
    copied_in: int = 0
    copied_out: int = 0
    progress_at: float = 0.0                   # when `done` last moved (or the op started)
    broken: bool = False                       # done was poisoned: the daemon's reply says why
    # Seconds from sending the op: input all copied in; first and all results announced.
    started: float = 0.0
    t_in: float | None = None
    t_first: float | None = None
    t_all: float | None = None

    @property
    def pumping(self) -> bool:
        return self.copied_out < self.nbytes and not self.broken


@dataclass
class _Op:
    op_id: int
    spec: OpSpec
    info: int = -1                             # a recv's source rank, reported on completion
    deadline: float = 0.0
    req: int = 0
    pipe: _Pipe | None = None
    done: Any = None                           # a device op's done ticket (unified all-reduce), and
    done_target: int = 0                       # the value it gets once the result is in place
    buffer: SharedBuffer | None = None         # the shared buffer its data already is in (no copies)


class DaemonCommunicator:
    """A ``communicator.Communicator``, as ``_core.Communicator`` is; see docs/dev/interfaces.md §1."""

    def __init__(self, rank: int, size: int, comm_id: int, store: Any, opts: Any = None,
                 on_complete: Callable[[list], None] | None = None, timeout_s: float = 1800.0):
        if not (0 <= rank < size):
            raise ConfigError(f"[daemon-client] rank {rank} outside world size {size}")
        self._pid = os.getpid()  # a forked child (DataLoader worker) must not touch our sockets
        self.rank, self.size, self.comm_id = rank, size, int(comm_id)
        self.timeout_s = float(getattr(opts, "timeout_s", 0) or timeout_s)
        self._on_complete = on_complete or (lambda batch: None)
        self._job = f"{self.comm_id & 0xFFFFFFFF:08x}"
        self._rdir = runtime_dir(load(DaemonConfig), create=False)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._req = 0
        self._next_op = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._queue: collections.deque[_Op | Gate] = collections.deque()
        self._gates = GateWatcher(f"mccl-daemon-gate-{rank}", self._wake)
        self._recvs = PostedRecvs()
        self._piece = int(getattr(opts, "pipeline_bytes", 0) or load(EngineConfig).pipeline_bytes)
        cfg = load(EngineConfig)
        fast_bytes = cfg.daemon_fast_bytes
        self._copy_ahead = cfg.daemon_copy_ahead_bytes
        self._daemon_cut: Any = None           # _core.Options: how mccld's engine cuts ops (_copy_lead)
        self._verdict_s = 0.0                  # see _set_verdict_bound
        self._lead_warned = False
        self._ops = OpBuilder(rank, size, self._piece, fast_bytes)
        self._fastq: Any = None                # _core.FastQueue, the small-op queue to mccld
        self._outbox: collections.deque[dict[str, Any]] = collections.deque()  # reports, no reply awaited
        self._register_reqs: set[int] = set()   # of data segments: refused, nothing further can run
        self._buffer_reqs: dict[int, str] = {}  # req -> the shared buffer it registers
        self._release_reqs: set[int] = set()
        self._replies_owed: set[int] = set()   # reqs of pipelined ops that completed before mccld's reply
        self._inflight: _Op | None = None
        self._failed: MCCLError | None = None
        self._results: collections.OrderedDict[int, MCCLError | None] = collections.OrderedDict()
        self._done_cv = threading.Condition(self._lock)
        self._segment = None
        self._ticket_base = 0                  # bytes the segment's tickets count so far
        self._gen = 0
        self._buffers = BufferTable(rank)
        self._stats = {"ops_completed": 0, "bytes_sent": 0, "bytes_received": 0, "pipelined_ops": 0,
                       "zero_copy_ops": 0, **dict.fromkeys(_PHASES, 0.0)}
        self.copies = CopyStats()                # host <-> segment copies (copy_stats.py), in stats()
        self._closed = False
        self._closer: int | None = None            # the thread that tears the communicator down
        self._torn_down = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_push: zmq.Socket | None = None
        self._wake_addr = f"inproc://mccl-client-{id(self)}"
        att = Attachment(self._rdir, rank, size, self.timeout_s)
        self.endpoint = att.endpoint
        try:
            att.connect()
            self._daemon_uid = att.daemon_uid
            if fast_bytes:
                self._fastq = self._open_fast_queue(fast_bytes)
            att.join(store, self._job, {"fast_queue": self._fastq.name, "fast_bytes": fast_bytes}
                     if self._fastq is not None else {})
        except BaseException:
            att.close()
            self._close_fast_queue()
            raise
        self._sock, self._monitor, self._req = att.sock, att.monitor, att.req
        self.host_id, self.daemon_addr, self._link_addrs = att.host_id, att.daemon_addr, att.link_addrs
        self._daemon_cut = _daemon_cut(cfg, att.engine_cut)
        self._set_verdict_bound()
        try:
            self._start_io()
        except BaseException:
            self._close_sockets()
            raise
        _live.add(self)

    # -- set-up --------------------------------------------------------------------------
    def _open_fast_queue(self, slot_bytes: int) -> Any:
        from libmccl import _core
        # Generation 0 is the queue's; the data segments count from 1.
        name = shm.segment_name(self._job, self.rank, os.getpid(), 0)
        self._fast_kind = {"allreduce": _core.FAST_ALLREDUCE, "barrier": _core.FAST_BARRIER}
        q = _core.FastQueue(name, slot_bytes, self.rank, self._on_fast_done)
        try:
            fd_handover.hand_over(self._rdir, name, q.fd, self._daemon_uid)
        except BaseException:
            q.close()
            raise
        q.unlink()   # mccld holds its own descriptor now: ours, and any name, go
        return q

    def _hand_over(self, seg: shm.Segment) -> None:
        """mccld gets the segment's descriptor before its register (mccl_common/fd_handover.py)."""
        # On the I/O thread, a stopped mccld must not hold it past the group's timeout (the
        # heartbeat that would tell it mccld is gone is read by the same thread).
        fd_handover.hand_over(self._rdir, seg.name, seg.handover_fd, self._daemon_uid,
                              min(fd_handover.TIMEOUT_S, max(self.timeout_s, 0.5)))
        seg.handed_over()

    def _close_fast_queue(self) -> None:
        # Let go of the queue too: it is a C++ object holding our callback, a cycle the GC cannot
        # see through, so keeping it would keep its mapping (and this client) for the process's life.
        with self._lock:
            q, self._fastq = self._fastq, None
        if q is not None:
            q.unlink()
            q.close()   # joins its completer, unless this is that thread

    def _start_io(self) -> None:
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(self._wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._io_loop, args=(pull,), name=f"mccl-daemon-client-{self.rank}",
                                        daemon=True)
        self._thread.start()

    # -- the engine API -------------------------------------------------------------------------
    def allreduce(self, ptr: int, count: int, dtype: int, op: int, *, ready: Any = None, done: Any = None,
                  base: int = 0) -> int:
        """With tickets (a device buffer in host-visible memory, device_order.OrderedOp), as the
        engine takes them: nothing of the op starts before ``ready`` >= base + its bytes, and
        ``done`` gets that value once the result is in the buffer (poisoned if the op fails)."""
        spec = self._ops.allreduce(ptr, count, dtype, op)   # validates dtype and count
        nbytes = count * DTYPE_SIZE[dtype]
        if ready is not None and nbytes:
            self.gate(ready, base, nbytes)
        # What the small-op queue serves is copied into its slot whatever the tensor's memory.
        buffer = self._buffers.find(ptr, nbytes) if nbytes and not spec.fast else None
        return self._enqueue(spec, done, base + nbytes, buffer)

    def alloc_buffer(self, nbytes: int) -> SharedBuffer:
        """``nbytes`` of memory that mccld maps too: an all-reduce of a range inside it is
        neither copied in nor out (daemon_buffers.py). Registered before any later op."""
        from . import _core
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self._gen += 1
            name = shm.segment_name(self._job, self.rank, os.getpid(), self._gen)
        buf = self._buffers.create(name, int(nbytes), _core.Ticket.at, self._hand_over)
        with self._lock:
            self._outbox.append({"type": "register", "job": self._job, "rank": self.rank, "segment": name,
                                 "nbytes": buf.nbytes, "buffer": True})
        self._wake()
        return buf

    def broadcast(self, ptr: int, nbytes: int, root: int) -> int:
        return self._enqueue(self._ops.broadcast(ptr, nbytes, root))

    def allgather(self, send_ptr: int, recv_ptr: int, nbytes: int) -> int:
        return self._enqueue(self._ops.allgather(send_ptr, recv_ptr, nbytes))

    def reduce_scatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: int, op: int) -> int:
        return self._enqueue(self._ops.reduce_scatter(send_ptr, recv_ptr, count, dtype, op))

    def reduce(self, ptr: int, count: int, dtype: int, op: int, root: int) -> int:
        return self._enqueue(self._ops.reduce(ptr, count, dtype, op, root))

    def gather(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int) -> int:
        return self._enqueue(self._ops.gather(send_ptr, recv_ptr, nbytes, root))

    def scatter(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int) -> int:
        return self._enqueue(self._ops.scatter(send_ptr, recv_ptr, nbytes, root))

    def barrier(self) -> int:
        return self._enqueue(self._ops.barrier())

    def gate(self, ready: Any, base: int, nbytes: int) -> None:
        """Ops issued after this start once ``ready`` >= base + nbytes (daemon_gates.py)."""
        if nbytes <= 0:
            raise ConfigError(f"[daemon-client] gate needs nbytes > 0, got {nbytes}")
        gate = Gate(ready, base + nbytes)
        with self._lock:
            if self._failed is not None:
                return  # every later op fails with that error anyway
            self._queue.append(gate)
        self._wake()

    def alltoall(self, send_ptr: int, recv_ptr: int, nbytes: int) -> int:
        return self._enqueue(self._ops.alltoall(send_ptr, recv_ptr, nbytes))

    def alltoallv(self, send_ptr: int, send_sizes: list[int], send_offsets: list[int], recv_ptr: int,
                  recv_sizes: list[int], recv_offsets: list[int]) -> int:
        return self._enqueue(self._ops.alltoallv(send_ptr, send_sizes, send_offsets, recv_ptr, recv_sizes,
                                                 recv_offsets))

    def send(self, ptr: int, nbytes: int, dst: int, tag: int = 0) -> int:
        return self._enqueue(self._ops.send(ptr, nbytes, dst, tag))

    def recv(self, ptr: int, nbytes: int, src: int, tag: int = 0) -> int:
        """Posted at once (it does not wait behind this rank's queued ops); its data is
        taken into the segment as the next op once the daemon matched a send."""
        with self._lock:
            op_id = self._next_op
            self._next_op += 1
            recv = PostedRecv(op_id, ptr, nbytes, self._ops.recv_post(nbytes, src, int(tag), op_id))
            if self._failed is None:
                self._recvs.add(recv)
        if self._failed is not None:
            self._fail_ops([recv], self._failed)
        else:
            self._wake()
        return op_id

    def wait(self, op_id: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._done_cv:
            while op_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"[daemon-client] Timed out after {timeout_s:.1f}s waiting for "
                                            f"op {op_id} on rank {self.rank}; a peer rank may be slow or not have "
                                            "issued it yet, wait longer or check every rank runs the same ops")
                self._done_cv.wait(left)
            err = self._results.pop(op_id)
        if err is not None:
            raise err

    def abort(self, reason: str = "") -> None:
        self._fail(AbortedError(f"[daemon-client] communicator aborted on rank {self.rank}: "
                                f"{reason or 'no reason given'}"), leave_abort=reason or "aborted")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if os.getpid() != self._pid:
            return  # a forked child: no I/O thread here would ever finish the ops it waits for
        deadline = time.monotonic() + timeout_s
        with self._done_cv:
            while self._busy_locked() and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._done_cv.wait(left)
        self._fail(AbortedError(f"[daemon-client] communicator shut down on rank {self.rank}"), leave_abort=None)

    def set_timeout(self, timeout_s: float) -> None:
        """The client's own deadline for ops started from now on; the daemon keeps the
        timeout the job joined with (its verdict still comes first when that one is shorter)."""
        if not timeout_s > 0:
            raise ConfigError(f"[daemon-client] set_timeout({timeout_s} s): the timeout must be positive")
        self.timeout_s = float(timeout_s)
        self._set_verdict_bound()

    def report_overlap(self, ratio: float) -> None:
        """Share of communication hidden behind compute (0..1) for the daemon's exporter; never blocks."""
        if not 0.0 <= float(ratio) <= 1.0:
            raise ConfigError(f"[daemon-client] overlap ratio {ratio} outside [0, 1]")
        with self._lock:
            if self._closed:
                return
            self._outbox.append({"type": "overlap", "job": self._job, "rank": self.rank, "ratio": float(ratio)})
        self._wake()

    def peer_address(self, r: int) -> str:
        return self._link_addrs[r]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._stats, **self.copies.snapshot(), "per_peer": {}}

    # -- internals -----------------------------------------------------------------------------
    def _set_verdict_bound(self) -> None:
        """Seconds from an op's start until we stop waiting for mccld's verdict on it (per timeout,
        not per op: the engine's bound is a native call)."""
        from . import _core
        self._verdict_s = _core.Communicator.own_error_bound_s(self.timeout_s) + _VERDICT_MARGIN_S

    def _enqueue(self, spec: OpSpec, done: Any = None, done_target: int = 0,
                 buffer: SharedBuffer | None = None) -> int:
        with self._lock:
            op = _Op(self._next_op, spec, done=done, done_target=done_target, buffer=buffer)
            self._next_op += 1
            failed = self._failed
            if failed is None:
                self._queue.append(op)
        if failed is not None:
            self._fail_ops([op], failed)
        elif not self._start_fast():
            self._wake()
        return op.op_id

    def _wake(self) -> None:
        with self._lock:
            if self._wake_push is not None:
                try:
                    self._wake_push.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    # Full: wakes are pending already. No peer: the I/O thread has ended (a
                    # teardown racing its exit). Either way nothing is lost, and the I/O
                    # thread polls at least once a second; raising here failed a shutdown
                    # that had finished every op (seen in a DDP run through mccld).
                    pass

    def _finish_locked(self, op: _Op | PostedRecv, err: MCCLError | None) -> None:
        done = getattr(op, "done", None)
        if done is not None:
            # Before anyone hears of the completion, as the engine does: a device waiting on
            # done must not pass before the result is in place, nor stay blocked on a failure.
            if err is None:
                done.signal(op.done_target)
            else:
                done.poison()
        self._results[op.op_id] = err
        while len(self._results) > _RESULTS_KEPT:
            self._results.popitem(last=False)
        self._done_cv.notify_all()

    def _fail_ops(self, ops: list[_Op | PostedRecv], exc: MCCLError) -> None:
        with self._lock:
            for op in ops:
                self._finish_locked(op, exc)
        if ops:
            self._on_complete([(op.op_id, _err_tuple(exc), -1) for op in ops])

    def _busy_locked(self) -> bool:
        return bool(self._inflight is not None or self._queue or self._recvs or self._replies_owed)

    def _head_locked(self) -> _Op | None:
        """The next op to start, past the gates that opened; None if there is none or a
        closed gate holds it back (then the watcher waits on that gate)."""
        while self._queue and isinstance(self._queue[0], Gate):
            gate = self._queue[0]
            if not gate.open() and gate.error is None:
                if not gate.deadline:
                    gate.deadline = time.monotonic() + self.timeout_s
                    self._gates.watch(gate)
                return None
            if gate.error is not None:
                return None  # the I/O thread fails the communicator with it (_expired)
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    def _ensure_segment(self, span: int) -> None:
        seg = self._segment
        # A poisoned segment (a pipelined op failed) cannot order another op: replace it.
        if seg is not None and seg.nbytes >= span and not seg.done.poisoned:
            return
        size = max(span, 1 << 20, 2 * seg.nbytes if seg else 0)
        with self._lock:
            self._gen += 1
            gen = self._gen
        name = shm.segment_name(self._job, self.rank, os.getpid(), gen)
        from . import _core  # the engine's ticket views over the segment's header
        new = shm.Segment(name, size, create=True, ticket_at=_core.Ticket.at)
        try:
            self._hand_over(new)
        except BaseException:
            new.close()
            raise
        self._req += 1
        self._register_reqs.add(self._req)
        self._sock.send(protocol.encode({"type": "register", "req": self._req, "job": self._job,
                                         "rank": self.rank, "segment": name, "nbytes": size}))
        self._segment = new
        self._ticket_base = 0
        if seg is not None:
            seg.close()
            seg.unlink()

    def _send_op(self, req: int, name: str, args: dict[str, Any]) -> None:
        self._flush_outbox()  # a buffer's register goes before the ops issued after it
        # Only collectives take a place in the job's order; p2p carries seq 0.
        if name in _P2P_OPS or name == "recv":
            seq = 0
        else:
            with self._lock:
                self._seq += 1
                seq = self._seq
        self._sock.send(protocol.encode({"type": "op", "req": req, "job": self._job, "rank": self.rank,
                                         "seq": seq, "op": name, "args": args}))

    def _start_fast(self) -> bool:
        """Publishes the next op if it is a small one and nothing is in flight; any thread
        may call it (no ZeroMQ). True if it did."""
        with self._lock:
            if self._inflight is not None or self._failed is not None or self._fastq is None:
                return False
            head = self._head_locked()
            if head is None or not head.spec.fast:
                return False
            op = self._queue.popleft()
            self._inflight = op
            self._seq += 1
            op.deadline = time.monotonic() + self._verdict_s  # watched by the I/O thread
            spec, args = op.spec, op.spec.args
            try:
                if spec.name == "barrier":
                    self._fastq.submit(op.op_id, self._seq, self._fast_kind["barrier"], 0, 0, 0, 0)
                else:
                    (_, ptr, _), = spec.copy_in
                    self._fastq.submit(op.op_id, self._seq, self._fast_kind["allreduce"], args["dtype"],
                                       args["op"], args["count"], ptr)
                return True
            except MCCLError as e:
                failed = e
        self._fail(failed, leave_abort=None)
        return True

    def _on_fast_done(self, op_id: int, err_tuple: tuple | None) -> None:
        """The small-op queue's completer thread: the op in flight finished (its result is
        in place) or the daemon failed the job."""
        err = None if err_tuple is None else errors.from_kind(*err_tuple)
        with self._lock:
            op = self._inflight
            if op is None or op.op_id != op_id:
                return  # failed meanwhile: already reported
            self._inflight = None
            self._stats["ops_completed"] += 1
            self._stats["bytes_sent"] += sum(c[2] for c in op.spec.copy_in)
            self._stats["bytes_received"] += sum(c[2] for c in op.spec.copy_out)
            self._count_fast_copies(op.spec)
            self._finish_locked(op, err)
            if err is not None and self._failed is None:
                self._failed = err
        self._on_complete([(op_id, None if err is None else _err_tuple(err), -1)])
        if err is not None:
            self._fail(err, leave_abort=None)
        elif not self._start_fast():
            with self._lock:
                more = bool(self._queue)
            if more:
                self._wake()

    def _start_next(self) -> None:
        if self._start_fast():
            return
        with self._lock:
            if self._inflight is not None or self._failed is not None:
                return
            head = self._head_locked()
            if head is None or head.spec.fast:
                return
            op = self._queue.popleft()
            self._inflight = op
        spec, buf = op.spec, op.buffer
        args = dict(spec.args)
        if buf is not None:
            self._start_in_place(op, buf, args)
        else:
            if spec.span:
                self._ensure_segment(spec.span)
            if spec.pipelined:
                (_, ptr, n), = spec.copy_in
                now = time.monotonic()
                op.pipe = _Pipe(ptr, n, self._ticket_base, seg=self._segment, lead=self._copy_lead(spec.args, n),
                                started=now, progress_at=now)
                args["base"] = self._ticket_base
                self._ticket_base += n
            else:
                base = self._segment.addr if spec.span else 0
                t0 = time.perf_counter()
                for off, ptr, n in spec.copy_in:
                    ctypes.memmove(base + off, ptr, n)
                self._count_copies("host_to_segment", spec.copy_in, t0)
            if spec.span:
                args["segment"] = self._segment.name
        self._req += 1
        op.req = self._req
        op.deadline = time.monotonic() + self._verdict_s
        self._send_op(op.req, spec.name, args)

    def _start_in_place(self, op: _Op, buf: SharedBuffer, args: dict[str, Any]) -> None:
        """An all-reduce of a range in a shared buffer: mccld works on it where it is."""
        (_, ptr, n), = op.spec.copy_in
        args["segment"], args["offset"] = buf.name, ptr - buf.addr
        if op.spec.pipelined:
            # All of the input is in place already; the op only waits for `done` to cover it.
            now = time.monotonic()
            op.pipe = _Pipe(ptr, n, buf.ticket_base, seg=buf.segment, in_place=True, lead=n, copied_in=n,
                            started=now, progress_at=now, t_in=0.0)
            args["base"] = buf.ticket_base
            buf.ticket_base += n
            buf.segment.ready.signal(op.pipe.base + n)

    def _count_copies(self, direction: str, copies: list, t0: float) -> None:
        n = sum(c[2] for c in copies)
        if n:
            self.copies.record(direction, n, sum(1 for c in copies if c[2]), time.perf_counter() - t0)

    def _count_fast_copies(self, spec: OpSpec) -> None:
        """The small-op queue copies in C++: counted, not timed."""
        for direction, copies in (("host_to_segment", spec.copy_in), ("segment_to_host", spec.copy_out)):
            n = sum(c[2] for c in copies)
            if n:
                self.copies.record(direction, n, sum(1 for c in copies if c[2]))

    def _copy_lead(self, args: dict[str, Any], nbytes: int) -> int:
        """How far ahead of the results a pipelined all-reduce's input is copied in."""
        if not self._copy_ahead:
            return nbytes
        from . import _core
        # With mccld's settings: the world size bounds its engine's ranks (one per host), and
        # pieces grow with the ranks, so this is the largest piece it can cut. Its local
        # reduction (several ranks on this host) goes in pieces of pipeline_bytes.
        o = self._daemon_cut
        piece = _core.Communicator.allreduce_piece_bytes(o, self.size, args["count"], args["dtype"])
        return max(self._copy_ahead, _LEAD_PIECES * max(piece, o.pipeline_bytes, self._piece))

    def _pump(self, op: _Op) -> bool:
        """Copies a pipelined op's input in (raising ``ready``) and its results out as far as
        ``done`` covers them; returns early, to be called again, once the daemon's socket or
        its monitor has something to say or the op is overdue. True once the op completed."""
        p, seg = op.pipe, op.pipe.seg
        while True:
            # Input up to `lead` ahead of the results, so the copy spreads over the op.
            while p.copied_in < min(p.nbytes, p.copied_out + p.lead):
                k = min(self._piece, p.nbytes - p.copied_in)
                t0 = time.perf_counter()
                ctypes.memmove(seg.addr + p.copied_in, p.ptr + p.copied_in, k)  # releases the GIL
                self.copies.record("host_to_segment", k, seconds=time.perf_counter() - t0)
                p.copied_in += k
                seg.ready.signal(p.base + p.copied_in)
                if p.copied_in == p.nbytes:
                    p.t_in = time.monotonic() - p.started
            if not p.pumping:
                break
            try:
                reached = seg.done.wait_for(p.base + min(p.nbytes, p.copied_out + self._piece), _PUMP_SLICE_S)
            except AbortedError:
                p.broken = True  # the daemon failed the op; its reply follows
                return False
            if reached:
                covered = min(p.nbytes, seg.done.value - p.base)
                if p.t_first is None:
                    p.t_first = time.monotonic() - p.started
                if covered == p.nbytes:
                    p.t_all = time.monotonic() - p.started
                if not p.in_place and covered > p.copied_out:
                    t0 = time.perf_counter()
                    ctypes.memmove(p.ptr + p.copied_out, seg.addr + p.copied_out, covered - p.copied_out)
                    self.copies.record("segment_to_host", covered - p.copied_out,
                                       seconds=time.perf_counter() - t0)
                p.copied_out = covered
                p.progress_at = time.monotonic()
            elif (self._closed or self._sock.poll(0) or self._monitor.poll(0)
                  or time.monotonic() > op.deadline):
                return False
            elif p.copied_in < p.nbytes and time.monotonic() - p.progress_at > _LEAD_VALVE_S:
                held = p.copied_in
                p.lead = p.nbytes
                if not self._lead_warned:
                    self._lead_warned = True
                    log.warning("[daemon-client] rank %d: mccld announced no result for %.0f s while this rank "
                                "held back input beyond byte %d of %d; copying the rest in at once (a very slow "
                                "link, or mccld cuts larger pieces than it said)", self.rank, _LEAD_VALVE_S,
                                held, p.nbytes)
        if p.broken:
            return False
        # Every result is in place: mccld raises `done` over the last piece only once nothing
        # of the op touches this segment any more, so the op is complete without the reply,
        # which the daemon's job thread sends a little later. The next op starts now; the
        # reply is awaited beside it (_settle_owed_reply).
        with self._lock:
            self._replies_owed.add(op.req)
        self._completed(op, None)
        return True

    def _pump_inflight(self) -> bool:
        """Pumps the pipelined op in flight; True if it completed (the next op may start)."""
        with self._lock:
            op = self._inflight
        if op is not None and op.pipe is not None and op.pipe.pumping and not self._closed:
            return self._pump(op)
        return False

    def _post_recvs(self) -> None:
        while True:
            with self._lock:
                recv = self._recvs.next_unsent(self._req + 1, time.monotonic() + self._verdict_s)
                if recv is not None:
                    self._req += 1
            if recv is None:
                return
            self._send_op(recv.req, "recv", recv.args)

    def _on_reply(self, reply: dict[str, Any]) -> None:
        with self._lock:
            recv = self._recvs.answered(reply["req"])
        if recv is None:
            self._complete_inflight(reply)
        elif reply.get("ok"):
            # Matched: the data comes into the segment as the very next op.
            take = _Op(recv.op_id, self._ops.take(recv.ptr, recv.nbytes, recv.args["post"]), info=int(reply["src"]))
            with self._lock:
                self._queue.appendleft(take)
        else:
            err = protocol.error_from_payload(reply.get("error") or {})
            self._fail_ops([recv], err)
            self._fail(err, leave_abort=None)

    def _complete_inflight(self, reply: dict[str, Any]) -> None:
        if reply["req"] in self._replies_owed:
            self._settle_owed_reply(reply)
            return
        op = self._inflight
        if op is None or reply["req"] != op.req:
            req = reply["req"]
            was_register, buffer = req in self._register_reqs, self._buffer_reqs.pop(req, None)
            was_release = req in self._release_reqs
            self._register_reqs.discard(req)
            self._release_reqs.discard(req)
            if not reply.get("ok"):
                err = protocol.error_from_payload(reply.get("error") or {})
                if was_register or buffer is not None and not self._buffers.dead(buffer):
                    self._fail(err, leave_abort=None)  # the daemon cannot see our data: nothing further can run
                elif buffer is not None or was_release:
                    # A buffer dropped right after it was allocated: its name went before mccld
                    # mapped it, so neither side holds it. Nothing used it.
                    log.debug("[daemon-client] rank %d: a released buffer's register/release refused: %s",
                              self.rank, err)
                else:
                    log.warning("[daemon-client] mccld refused a report from rank %d: %s", self.rank, err)
            return
        spec, err = op.spec, None
        if reply.get("ok") and op.pipe is not None:
            p = op.pipe  # done covers the whole op by now: the rest is final
            if not p.in_place and p.nbytes > p.copied_out:
                t0 = time.perf_counter()
                ctypes.memmove(p.ptr + p.copied_out, p.seg.addr + p.copied_out, p.nbytes - p.copied_out)
                self.copies.record("segment_to_host", p.nbytes - p.copied_out, seconds=time.perf_counter() - t0)
        elif reply.get("ok") and op.buffer is not None:
            pass  # the result is where the tensor is
        elif reply.get("ok"):
            base = self._segment.addr if spec.span else 0
            t0 = time.perf_counter()
            for off, ptr, n in spec.copy_out:
                ctypes.memmove(ptr, base + off, n)
            self._count_copies("segment_to_host", spec.copy_out, t0)
        else:
            err = protocol.error_from_payload(reply.get("error") or {})
        self._completed(op, err)

    def _completed(self, op: _Op, err: MCCLError | None) -> None:
        """The op in flight finished (its results are in place unless ``err``)."""
        spec, phases = op.spec, None
        if err is None and op.pipe is not None:
            p, end = op.pipe, time.monotonic() - op.pipe.started
            phases = (p.t_in if p.t_in is not None else end, p.t_first if p.t_first is not None else end,
                      p.t_all if p.t_all is not None else end, end)
        with self._lock:
            self._inflight = None
            self._stats["ops_completed"] += 1
            self._stats["bytes_sent"] += sum(c[2] for c in spec.copy_in)
            self._stats["bytes_received"] += sum(c[2] for c in spec.copy_out)
            self._stats["zero_copy_ops"] += op.buffer is not None
            if phases is not None:
                self._stats["pipelined_ops"] += 1
                for key, seconds in zip(_PHASES, phases):
                    self._stats[key] += seconds
            self._finish_locked(op, err)
            if err is not None and self._failed is None and not isinstance(err, ConfigError):
                self._failed = err
        self._on_complete([(op.op_id, None if err is None else _err_tuple(err), op.info)])
        if err is not None and not isinstance(err, ConfigError):
            self._fail(err, leave_abort=None)

    def _settle_owed_reply(self, reply: dict[str, Any]) -> None:
        """mccld's reply to a pipelined op that completed when its last result was in place."""
        with self._lock:
            self._replies_owed.discard(reply["req"])
        if not reply.get("ok"):
            # The op's results were final before this (a peer lost as the op ended): the
            # communicator fails from here, as it would have for the next op.
            self._fail(protocol.error_from_payload(reply.get("error") or {}), leave_abort=None)

    def _next_deadline(self) -> float | None:
        with self._lock:
            waits = self._recvs.deadlines()
            if self._inflight is not None:
                waits.append(self._inflight.deadline)
            elif self._queue and isinstance(self._queue[0], Gate) and self._queue[0].deadline:
                waits.append(self._queue[0].deadline)
        return min(waits, default=None)

    def _expired(self, now: float) -> MCCLError | None:
        with self._lock:
            op = self._inflight
            late = self._recvs.expired(now, self.rank, self.timeout_s)
            gate = self._queue[0] if op is None and self._queue and isinstance(self._queue[0], Gate) else None
        if gate is not None:
            opened = gate.open()
            if gate.error is not None:
                return gate.error
            if not opened and gate.deadline and now > gate.deadline:
                return gate_timeout(gate, self.rank, self.timeout_s)
        if op is not None and now > op.deadline:
            return CollectiveTimeout(
                f"[daemon-client] Timed out after {self.timeout_s:.0f}s waiting for {op.spec.name} (op {op.op_id}) "
                f"on rank {self.rank}; a peer rank is stuck, slow or skipped this collective")
        return late

    def _flush_outbox(self) -> None:
        """Sends the reports and buffer registrations queued by other threads (the I/O thread
        owns the socket), and the releases of buffers whose last tensor went."""
        released = self._buffers.released
        while True:
            # Releases first: a buffer released is dead, and its slot under mccld's cap may be
            # the one a registration queued behind it needs.
            with self._lock:
                report = self._next_report_locked(released)
            if report is None:
                return
            self._req += 1
            if report["type"] == "register":
                self._buffer_reqs[self._req] = report["segment"]
            elif report["type"] == "release":
                self._release_reqs.add(self._req)
            self._sock.send(protocol.encode({**report, "req": self._req}))

    def _next_report_locked(self, released: collections.deque) -> dict[str, Any] | None:
        if released:
            name = released.popleft()
            unsent = [r for r in self._outbox if r["type"] == "register" and r["segment"] == name]
            if unsent:
                self._outbox.remove(unsent[0])  # never registered; its release frees the handed-over fd
            return {"type": "release", "job": self._job, "rank": self.rank, "segment": name}
        return self._outbox.popleft() if self._outbox else None

    def _io_loop(self, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closed:
                deadline = self._next_deadline()
                wait_ms = 1000 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
                events = dict(poller.poll(min(wait_ms, 1000)))
                if pull in events:
                    while True:
                        try:
                            pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    self._flush_outbox()
                    self._post_recvs()
                elif self._buffers.released:
                    self._flush_outbox()  # a finalizer cannot wake us: within the poll's second
                if self._monitor in events:
                    ev = parse_monitor_message(self._monitor.recv_multipart())
                    if ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and not self._closed:
                        self._fail(DaemonUnavailableError(
                            f"[daemon-client] the local mccld ({self.endpoint}) went away on rank {self.rank}; "
                            "it crashed, was stopped or stopped answering heartbeats; restart it and the job"),
                            leave_abort=None)
                        return
                if self._sock in events:
                    while True:
                        try:
                            frame = self._sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._on_reply(protocol.decode_reply(frame))
                        except ProtocolError as e:
                            self._fail(e, leave_abort=None)
                            return
                        if self._closed:  # that reply failed the communicator: sockets are gone
                            return
                expired = self._expired(time.monotonic())
                if expired is not None:
                    self._fail(expired, leave_abort=None)
                    return
                while self._failed is None:
                    self._start_next()
                    if not self._pump_inflight():
                        break
        except DaemonUnavailableError as e:   # already says mccld went away (fd_handover, say)
            self._fail(e, leave_abort=None)
        except ConnectionError as e:
            # A socket to mccld (the hand-over socket, say) reset or closed: mccld is gone.
            self._fail(DaemonUnavailableError(
                f"[daemon-client] the local mccld ({self.endpoint}) went away on rank {self.rank} "
                f"({e.strerror or e}); it crashed or was stopped; restart it and the job"), leave_abort=None)
        except Exception as e:  # noqa: BLE001 - surface it to every pending op
            log.exception("[daemon-client] I/O thread failed")
            self._fail(MCCLError(f"[daemon-client] I/O thread failed on rank {self.rank}: {e}"), leave_abort=None)
        finally:
            pull.close(0)

    def _fail(self, exc: MCCLError, leave_abort: str | None) -> None:
        """Fail every pending and later op with ``exc``, tell the daemon we leave, free the segment.

        Returns once that is done, also when another thread is the one doing it (bounded):
        a caller that goes on to exit must not cut the teardown short.
        """
        if os.getpid() != self._pid:
            return  # inherited through fork: the parent still owns the connection and the segment
        me = threading.get_ident()
        with self._lock:
            closer = self._closer
            if closer is None:
                self._closer = me
                self._closed = True
                if self._failed is None:
                    self._failed = exc
                exc = self._failed
                ops = (([self._inflight] if self._inflight is not None else [])
                       + [op for op in self._queue if not isinstance(op, Gate)] + self._recvs.take_all())
                self._inflight = None
                self._queue.clear()
        if closer is not None:
            # Not on the closing thread itself (a failed op's callback calling shutdown), nor on
            # the I/O thread: the closer may be joining it.
            if closer != me and self._thread is not threading.current_thread():
                self._torn_down.wait(_IO_JOIN_S + _LEAVE_WAIT_S + 1.0)
            return
        try:
            self._teardown(ops, exc, leave_abort)
        finally:
            self._torn_down.set()

    def _teardown(self, ops: list[_Op | PostedRecv], exc: MCCLError, leave_abort: str | None) -> None:
        seg = self._segment
        if seg is not None:
            # Unlinked before anyone hears of the failure: a rank that exits on the error leaves
            # nothing behind. Only the name goes; the mapping stays valid for an I/O thread still copying.
            seg.unlink()
        self._buffers.unlink_all()  # their tensors keep the memory
        self._close_fast_queue()
        self._gates.stop()
        self._fail_ops(ops, exc)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._wake()
            self._thread.join(timeout=_IO_JOIN_S)
            if self._thread.is_alive():
                # zmq sockets are not thread-safe: leave them to the stuck I/O thread
                # rather than closing them under it.
                log.warning("[daemon-client] rank %d: I/O thread did not stop within %.0fs; leaving its "
                            "sockets open", self.rank, _IO_JOIN_S)
                return
        if self._sock is not None and not isinstance(exc, DaemonUnavailableError):
            msg = {"type": "leave", "req": self._req + 1, "job": self._job, "rank": self.rank}
            if leave_abort is not None:
                msg["abort"] = leave_abort
            try:
                self._sock.send(protocol.encode(msg), zmq.NOBLOCK)
                self._sock.poll(int(_LEAVE_WAIT_S * 1000))  # the reply: the leave got out before we close
            except zmq.ZMQError:
                pass
        self._close_sockets()

    def _close_sockets(self) -> None:
        seg, self._segment = self._segment, None
        if seg is not None:
            seg.close()
            seg.unlink()
        with self._lock:
            push, self._wake_push = self._wake_push, None
        for s in (push, self._monitor, self._sock):
            if s is not None:
                s.close(0)
        self._monitor = self._sock = None

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._fail(AbortedError("[daemon-client] communicator garbage-collected"), leave_abort=None)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
