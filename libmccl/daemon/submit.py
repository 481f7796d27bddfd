"""How the daemon client starts an op and moves its data: the per-rank segment, copies in and
out of it (the pipelined all-reduce piece by piece against the segment's tickets), an all-reduce
in place in a shared buffer, the small-op queue, and the op's completion. A part of
``client.DaemonCommunicator`` (its state is set up there); it runs on the I/O thread, except
``_start_fast``, which any thread may call, and ``_on_fast_done``, the queue's completer."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from mccl_common import attach_protocol as protocol
from mccl_common import errors, shm
from mccl_common.errors import AbortedError, ConfigError, MCCLError

from .buffers import SharedBuffer
from .ops import OpSpec

log = logging.getLogger(__name__)

_P2P_OPS = ("send", "take")                      # outside the job's collective order
_KIND_OF = {cls: kind for kind, cls in errors._KINDS.items()}
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


def _err_tuple(exc: MCCLError) -> tuple[int, str, int, str]:
    kind = _KIND_OF.get(type(exc), 0)
    return (kind, str(exc), exc.peer_rank if exc.peer_rank is not None else -1, exc.peer_addr or "")


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


class Submitter:
    """Starting ops and their copies; mixed into ``DaemonCommunicator``."""

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
        from .. import _core  # the engine's ticket views over the segment's header
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
                # A compressed op starts each group of chunks once `ready` covers it and keeps
                # three groups in flight (algorithms/compressed.cc; up to 4 MB per host each),
                # more than the ring's pieces: its input is copied in without waiting for
                # results, still piece by piece, so the first group is on the wire while the
                # rest is copied.
                lead = n if spec.compressed else self._copy_lead(spec.args, n)
                op.pipe = _Pipe(ptr, n, self._ticket_base, seg=self._segment, lead=lead,
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
        from .. import _core
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

