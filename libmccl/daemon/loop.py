"""The daemon client's I/O thread: it owns the ZeroMQ socket to mccld, sends queued reports,
dispatches replies, watches deadlines and gates, and tears the communicator down when anything
fails. A part of ``client.DaemonCommunicator`` (its state is set up there)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from mccl_common import attach_protocol as protocol
from mccl_common.errors import CollectiveTimeout, DaemonUnavailableError, MCCLError, ProtocolError

from .gates import Gate, gate_timeout
from .p2p import PostedRecv
from .submit import _Op

log = logging.getLogger(__name__)

_IO_JOIN_S = 5.0                                 # bound on the I/O thread's stop
_LEAVE_WAIT_S = 1.0                              # for the daemon's answer to our leave


class IOLoop:
    """The I/O thread and the teardown; mixed into ``DaemonCommunicator``."""

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

