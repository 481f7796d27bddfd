"""A fake accelerator for CI: proves the ordering protocol (device_order) without a GPU.

Its "device memory" is host memory (so the engine reduces in place, like Apple unified
memory) or, with ``unified=False``, is staged through host buffers by copy commands (like
CUDA). Its stream is a worker thread that runs committed command buffers in order, each
command after a seeded random pause, so the device runs late by a different amount every
time. What a real device would do silently wrong, it raises as a named error:

- ``DeviceRace``: a command touches bytes the engine may be working on (its op's ``ready``
  was reached and the stream has not yet passed its wait for ``done``), or the CPU reads
  bytes that queued device work still writes;
- ``ForeignThreadCommit``: a thread other than the one that created the device (or was
  allowed with ``allow_thread``) encodes or commits;
- ``UncommittedCommands``: ``synchronize`` or ``close`` finds encoded commands that were
  never committed, which a real device would wait for forever.

Errors are sticky: the first one is raised where it happened (on the worker it poisons
every live op's tickets, so no engine or CPU wait stays pending) and again by every later
``check``/``synchronize``/``close``.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mccl_common.errors import AbortedError, CollectiveTimeout

from .. import _core
from .device_order import (TICKET_BASE, DeviceOps, DeviceOrderError, DeviceRace, ForeignThreadCommit,
                           TicketedOp, UncommittedCommands)

_log = logging.getLogger(__name__)

Range = tuple[int, int]  # (address, bytes)


@dataclass
class _Command:
    label: str
    run: Callable[[], None]
    touches: list[Range] = field(default_factory=list)
    gate: Callable[[], bool] | None = None  # a wait: may the stream pass it now?


def _overlap(a: Range, b: Range) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


class FakeDevice(DeviceOps):
    name = "fake"

    def __init__(self, seed: int = 0, max_jitter_s: float = 0.002, unified: bool = True,
                 wait_timeout_s: float = 60.0, manual: bool = False) -> None:
        """``manual``: no worker thread; the caller runs the stream one command at a time
        with ``run_next`` (to enumerate interleavings)."""
        self.unified = unified
        self._rnd = random.Random(seed)
        self._max_jitter_s = max_jitter_s
        self._wait_timeout_s = wait_timeout_s
        self._threads = {threading.get_ident()}
        self._lock = threading.Lock()
        self._open: list[_Command] = []
        self._queued: list[_Command] = []  # committed, not yet finished
        self._live: list[TicketedOp] = []   # ops whose engine buffer the device must not touch
        self._memory: list[Any] = []       # keeps alloc()'s buffers alive
        self._adopted: list[Range] = []
        self._error: DeviceOrderError | None = None
        self._idle = threading.Condition(self._lock)
        self._stream: queue.Queue[list[_Command] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        if not manual:
            self._worker = threading.Thread(target=self._run, name="mccl-fake-stream", daemon=True)
            self._worker.start()

    # -- memory -----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Device memory (host memory the device and the engine both reach)."""
        buf = (ctypes.c_char * max(nbytes, 1))()
        self._memory.append(buf)
        addr = ctypes.addressof(buf)
        self._adopted.append((addr, nbytes))
        return addr

    def adopt(self, addr: int, nbytes: int) -> None:
        """Treat existing host memory (a torch CPU tensor's) as this device's memory."""
        if not self.owns(addr, nbytes):
            self._adopted.append((addr, nbytes))

    def owns(self, addr: int, nbytes: int) -> bool:
        return any(a <= addr and addr + nbytes <= a + n for a, n in self._adopted)

    def staging_buffer(self, nbytes: int) -> tuple[int, Any]:
        buf = (ctypes.c_char * max(nbytes, 1))()
        return ctypes.addressof(buf), buf

    # -- threads (O3) ---------------------------------------------------------------------
    def allow_thread(self, ident: int | None = None) -> None:
        """Another thread torch calls us on (a second caller thread of a test)."""
        self._threads.add(threading.get_ident() if ident is None else ident)

    def _guard(self, what: str) -> None:
        self.check()
        if threading.get_ident() not in self._threads:
            self._fail(ForeignThreadCommit(
                f"[fake-device] {what} on thread {threading.current_thread().name!r}, which torch did not call "
                "us on; likely cause: device work encoded from the engine's or the completion thread (O3); "
                "encode and commit only inside the collective call or Work.wait()"))

    # -- DeviceOps ----------------------------------------------------------------------------
    def new_ticket(self) -> Any:
        t = _core.Ticket()
        t.signal(TICKET_BASE)
        return t

    def on_op(self, op: TicketedOp) -> None:
        with self._lock:
            self._live.append(op)

    def launch(self, stream: Any, fn: Callable[[], None], touches: list[Range], label: str) -> None:
        """Queue a kernel: ``fn`` runs on the stream; ``touches`` are the bytes it reads or writes."""
        self._encode(_Command(label, fn, list(touches)))

    def signal(self, stream: Any, ticket: Any, value: int) -> None:
        self._encode(_Command(f"signal {value - TICKET_BASE}", lambda: ticket.signal(value)))

    def wait(self, stream: Any, ticket: Any, value: int) -> None:
        # Poison (2^64-1) passes every target, as on a real device (device_order.TICKET_BASE).
        self._encode(_Command(f"wait {value - TICKET_BASE}", lambda: self._stream_wait(ticket, value),
                              gate=lambda: ticket.value >= value))

    def copy_to_host(self, stream: Any, host: int, dev: int, nbytes: int) -> None:
        self._copy("to host", host, dev, nbytes)

    def copy_to_device(self, stream: Any, dev: int, host: int, nbytes: int) -> None:
        self._copy("to device", dev, host, nbytes)

    def _copy(self, label: str, dst: int, src: int, nbytes: int) -> None:
        self._encode(_Command(f"copy {nbytes} B {label}", lambda: ctypes.memmove(dst, src, nbytes),
                              [(dst, nbytes), (src, nbytes)]))

    def commit(self, stream: Any) -> None:
        self._guard("commit")
        with self._lock:
            batch, self._open = self._open, []
            self._queued.extend(batch)
        if batch and self._worker is not None:
            self._stream.put(batch)

    def _encode(self, cmd: _Command) -> None:
        self._guard(f"encoding {cmd.label!r}")
        with self._lock:
            self._open.append(cmd)

    # -- the stream ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._stream.get()
            if batch is None:
                return
            for cmd in batch:
                time.sleep(self._rnd.random() * self._max_jitter_s)
                self._execute(cmd)

    def run_next(self) -> bool:
        """Manual mode: runs the next committed command unless it is a wait that cannot pass
        yet; False if nothing ran. The first error is raised here."""
        with self._lock:
            cmd = self._queued[0] if self._queued else None
        if cmd is None or (cmd.gate is not None and not cmd.gate()):
            return False
        self._execute(cmd)
        self.check()
        return True

    def _execute(self, cmd: _Command) -> None:
        try:
            if self._error is None:
                self._check_race(cmd, "starts")
                cmd.run()
                self._check_race(cmd, "ends")
        except DeviceOrderError as exc:
            self._fail(exc, raise_here=False)
        except Exception as exc:  # noqa: BLE001 - a broken kernel fails the device, not the worker
            self._fail(DeviceOrderError(f"[fake-device] command {cmd.label!r} failed: {exc}"), raise_here=False)
        with self._idle:
            self._queued.remove(cmd)
            self._idle.notify_all()

    def _stream_wait(self, ticket: Any, value: int) -> None:
        try:
            ticket.wait(value, self._wait_timeout_s, "[fake-device] stream wait")
        except (CollectiveTimeout, AbortedError):
            pass  # poisoned or timed out: the device moves on; the CPU side reports the op's error
        with self._lock:
            self._live = [op for op in self._live if op.done is not ticket]

    def _check_race(self, cmd: _Command, when: str) -> None:
        with self._lock:
            live = list(self._live)
        for op in live:
            if op.ready.value < op.target or op.ready.poisoned:
                continue
            for r, engine in ((r, e) for r in cmd.touches for e in op.engine_ranges()):
                if _overlap(r, engine):
                    raise DeviceRace(
                        f"[fake-device] {cmd.label!r} {when} on bytes {r[0] - engine[0]}..{r[0] - engine[0] + r[1]} "
                        f"of {op.what}'s buffer while the engine owns it (ready reached, the stream has not "
                        "waited for done); likely cause: ready signalled before the kernels that write the "
                        "bucket (O1 missing), a consumer not ordered after done (O2 missing), or a ticket "
                        "shared between ops")

    # -- the CPU side ---------------------------------------------------------------------------
    def cpu_access(self, addr: int, nbytes: int, what: str = "the CPU") -> None:
        """Raises DeviceRace if committed device work that may run now touches these bytes.

        Work behind a wait that cannot pass yet is left out: if it runs while the bytes are
        the engine's, the stream's own check names it then."""
        self.check()
        busy = []
        with self._lock:
            for c in self._queued:
                if c.gate is not None and not c.gate():
                    break
                if any(_overlap(r, (addr, nbytes)) for r in c.touches):
                    busy.append(c.label)
        if busy:
            raise DeviceRace(f"[fake-device] {what} touches {nbytes} B at {addr:#x} while queued device work "
                             f"{busy[0]!r} still does; likely cause: no synchronize (or O2 wait) before the "
                             "CPU reads device memory")

    def synchronize(self, timeout_s: float = 60.0) -> None:
        """Waits until every committed command ran; like a real device, never runs uncommitted ones."""
        self._guard("synchronize")
        with self._idle:
            if self._open:
                raise UncommittedCommands(
                    f"[fake-device] {len(self._open)} encoded command(s), first {self._open[0].label!r}, were "
                    "never committed, so the device would wait for them forever; likely cause: a path that "
                    "encodes without commit(); commit after encoding, on the caller's thread")
            if not self._idle.wait_for(lambda: not self._queued, timeout_s):
                raise DeviceOrderError(f"Timed out after {timeout_s} s: [fake-device] synchronize, "
                                       f"{len(self._queued)} command(s) still queued")
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: DeviceOrderError, raise_here: bool = True) -> None:
        with self._lock:
            first = self._error is None
            if first:
                self._error = exc
            live = list(self._live)
        if first:
            _log.warning("%s", exc)
            for op in live:  # whoever waits on these ops learns of the failure instead of hanging
                op.done.poison()
                op.ready.poison()
        if raise_here:
            raise exc

    def close(self) -> None:
        """Stops the stream; raises the first error, or UncommittedCommands."""
        try:
            if self._worker is not None and threading.get_ident() in self._threads and self._error is None:
                self.synchronize()
        finally:
            if self._worker is not None:
                self._stream.put(None)
                self._worker.join(10.0)
        self.check()

