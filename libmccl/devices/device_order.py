"""Ordering a collective against an accelerator's stream with tickets (issue 10).

A device tensor's bucket is written by kernels queued on a stream; the engine must not
read it before they ran, and nothing queued later on the device may read the result
before the engine wrote it. Three orderings do that without ever draining the stream:

O1  On the caller's thread, inside the collective call, the stream is told to raise the
    op's ``ready`` ticket after the work queued so far (the kernels that wrote the
    bucket; with staging, after an asynchronous device-to-host copy). The engine's
    all-reduce waits for ``ready`` before it touches a piece (libmccl/csrc/core/ticket.h).
O2  The engine raises ``done`` when the ring has finished. On the waiter's thread
    (``Work.wait()``, or ``get_future()``, before anything can chain on the result) the
    stream is told to wait for ``done`` before the work queued after it (with staging,
    the host-to-device copy of the result comes first).
O3  Only the threads torch calls us on encode or commit device work. The engine's
    threads and the completion thread only touch tickets and host memory.

Every op gets its own words, never shared with another op, so a stale value of an earlier
op can never satisfy a later one. A word starts at ``TICKET_BASE`` (2^63) rather than 0:
CUDA's stream wait compares cyclically (``(int64_t)(*addr - v) >= 0``), and only with the
targets in the upper half does the engine's poison value (2^64-1, set on abort or error)
also release a device wait, so no GPU wait stays pending after a failure. A poisoned op's
device tensor holds garbage; the error surfaces on the CPU in ``Work.wait()``.

This module is torch-free: implementations see stream handles, addresses and byte counts.
``libmccl.devices.device_tensors`` is the torch glue; ``fake_device`` (CI) and ``cuda_ops``
implement ``DeviceOps``; the Metal bridge described in metal/README.md is the third.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable

from mccl_common.errors import MCCLError

from .copy_stats import CopyStats

TICKET_BASE = 1 << 63


class DeviceOrderError(MCCLError):
    """The device-ordering protocol was broken; the subclass names how."""


class DeviceRace(DeviceOrderError):
    """The device and the engine (or the CPU) touched the same bytes without an ordering."""


class ForeignThreadCommit(DeviceOrderError):
    """Device work was encoded or committed on a thread torch did not call us on (O3)."""


class UncommittedCommands(DeviceOrderError):
    """Commands were encoded but never committed, so the device never ran them."""


class DeviceOps(abc.ABC):
    """One accelerator's stream operations, at the level of addresses and byte counts.

    Every method that takes a ``stream`` queues work on it and returns at once; only
    ``commit`` hands what was queued to the device (Metal's command buffers; a no-op where
    the driver submits as it goes, as CUDA does). All of them are called on the caller's
    thread only (O3).
    """

    name: str = "device"
    # True where the engine may reduce in the device buffer itself (Apple unified memory,
    # the fake device); False where buckets are staged through host memory.
    unified: bool = False
    # Whether ``register_host`` can work here at all (segment_staging asks before allocating).
    registers_host: bool = False

    @abc.abstractmethod
    def new_ticket(self) -> Any:
        """A fresh ``_core.Ticket`` at ``TICKET_BASE`` on a word the device can write and wait on."""

    def retire_ticket(self, ticket: Any) -> None:
        """``ticket``'s op is over: nothing on the device or the CPU still refers to it."""

    @abc.abstractmethod
    def signal(self, stream: Any, ticket: Any, value: int) -> None:
        """Queue: raise ``ticket`` to ``value`` once the work queued before it has run."""

    @abc.abstractmethod
    def wait(self, stream: Any, ticket: Any, value: int) -> None:
        """Queue: work queued after this runs once ``ticket`` holds ``value`` or is poisoned."""

    @abc.abstractmethod
    def copy_to_host(self, stream: Any, host: int, dev: int, nbytes: int) -> None:
        """Queue an asynchronous copy of device memory into a staging buffer."""

    @abc.abstractmethod
    def copy_to_device(self, stream: Any, dev: int, host: int, nbytes: int) -> None:
        """Queue an asynchronous copy of a staging buffer into device memory."""

    @abc.abstractmethod
    def commit(self, stream: Any) -> None:
        """Hand the queued work to the device."""

    def staging_buffer(self, nbytes: int) -> tuple[int, Any]:
        """(address, owner) of host memory the device copies into; for ``unified = False``."""
        raise NotImplementedError(f"{self.name} reduces in place and stages nothing")

    def release_staging(self, owner: Any) -> None:
        """A staging buffer's op retired; the buffer may serve another."""

    def on_op(self, op: "TicketedOp") -> None:
        """A new op's tickets and range are known (the fake device tracks them)."""

    def on_retire(self, op: "TicketedOp") -> None:
        """``op`` retired: neither the device nor the engine refers to its memory any more."""

    def register_host(self, addr: int, nbytes: int) -> None:
        """Make host memory allocated by someone else (a shared buffer mccld maps) a target of
        this device's copies; raises MCCLError where the device cannot (segment_staging.py)."""
        raise NotImplementedError(f"{self.name} cannot stage into memory it did not allocate")

    def unregister_host(self, addr: int) -> None:
        """Undo ``register_host``; before the memory is unmapped."""

    def owns(self, addr: int, nbytes: int) -> bool:
        """Whether these host bytes are this device's memory: devices whose memory torch sees as
        CPU memory (the fake device, the CUDA emulator), installed with device_tensors.install."""
        return False

    def mark(self, stream: Any) -> Any:
        """Queue a time stamp; None where the device cannot time its work."""
        return None

    def elapsed_s(self, start: Any, end: Any) -> float | None:
        """Seconds between two marks the device has passed (None if it cannot tell)."""
        return None

    @property
    def copies(self) -> CopyStats:
        """This device's staging copies, for every communicator of the process (copy_stats.py)."""
        found = self.__dict__.get("_copy_stats")
        return found if found is not None else self.__dict__.setdefault("_copy_stats", CopyStats())


def owner_of(devices: list[DeviceOps], addr: int, nbytes: int) -> DeviceOps | None:
    """The one of ``devices`` whose memory holds these bytes, if any."""
    for dev in devices:
        if dev.owns(addr, nbytes):
            return dev
    return None


class TicketedOp:
    """The tickets of one op on a device and the two halves of the protocol around them.

    ``launch`` (caller's thread, O1) and ``finish`` (waiter's thread, O2) encode and
    commit; subclasses say what goes before ``ready`` and after the wait for ``done``.
    """

    def __init__(self, ops: DeviceOps, what: str) -> None:
        self.ops = ops
        self.what = what
        self.ready = ops.new_ticket()
        self.done = ops.new_ticket()
        # Raised by the stream after the result's copy back: the staging buffers and the
        # words may be reused once it is reached.
        self.released = ops.new_ticket()
        self._finish_lock = threading.Lock()
        self._finished = False
        self._copy_runs: list[tuple[str, int, Any, Any]] = []  # (direction, copies, marks) not yet read
        # Set by the backend once the op is enqueued: the engine holds views of the words
        # until the op has completed, which may come after ``released``.
        self.engine_finished: Callable[[], bool] = lambda: True

    @property
    def target(self) -> int:
        raise NotImplementedError

    def engine_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) the engine works on between ``ready`` and ``done``."""
        raise NotImplementedError

    def _before_ready(self, stream: Any) -> None:
        """Queued in front of the ``ready`` signal."""

    def _after_done(self, stream: Any) -> None:
        """Queued behind the stream's wait for ``done``."""

    def launch(self, stream: Any) -> None:
        """O1: after the kernels that wrote the inputs, make them the engine's."""
        self._before_ready(stream)
        self.ops.signal(stream, self.ready, self.target)
        self.ops.commit(stream)

    def finish(self, stream: Any) -> None:
        """O2: order the stream's later work after the engine's result; once per op."""
        with self._finish_lock:
            if self._finished:
                return
            self._finished = True
        self.ops.wait(stream, self.done, self.target)
        self._after_done(stream)
        self.ops.signal(stream, self.released, TICKET_BASE + 1)
        self.ops.commit(stream)

    def _queue_copies(self, stream: Any, direction: str, copies: list[tuple[int, int, int]],
                      copy: Callable[[Any, int, int, int], None]) -> None:
        """Queue ``copies`` between two marks: counted now, their seconds added once the op retires."""
        if not copies:
            return
        start = self.ops.mark(stream)
        for a, b, n in copies:
            copy(stream, a, b, n)
        end = self.ops.mark(stream) if start is not None else None
        timed = start is not None and end is not None
        self.ops.copies.record(direction, sum(c[2] for c in copies), len(copies), 0.0 if timed else None)
        if timed:
            self._copy_runs.append((direction, len(copies), start, end))

    def _count_copies(self) -> None:
        runs, self._copy_runs = self._copy_runs, []
        for direction, n, start, end in runs:
            self.ops.copies.add_seconds(direction, self.ops.elapsed_s(start, end), n)

    def finishing(self) -> bool:
        """``finish`` queued the stream's side of O2 (or the op was abandoned)."""
        return self._finished or self.ready.poisoned

    def abandon(self) -> None:
        """The op never reached the engine: release every wait on its tickets."""
        for t in (self.ready, self.done, self.released):
            t.poison()

    def reusable(self) -> bool:
        """Neither the device nor the engine refers to the words or the staging buffers any
        more (or the op was abandoned)."""
        return self.released.value >= TICKET_BASE + 1 and self.engine_finished()

    def retire(self) -> None:
        for t in (self.ready, self.done, self.released):
            self.ops.retire_ticket(t)
        self._count_copies()  # the stream is past every copy of the op: their marks are final
        self.ops.on_retire(self)  # before its buffer can serve another op
        self._release_staging()

    def _release_staging(self) -> None:
        pass


class OrderedOp(TicketedOp):
    """An all-reduce on ``nbytes`` at device address ``dev_ptr``, pieced by the engine:
    ``buffer`` is what the engine works on, the device buffer when the device memory is
    the host's, else a staging buffer."""

    def __init__(self, ops: DeviceOps, dev_ptr: int, nbytes: int, what: str, blocks: Any = None) -> None:
        """``blocks``: where the staging buffer comes from first, as for ``StagedOp``."""
        super().__init__(ops, what)
        self.dev_ptr = dev_ptr
        self.nbytes = nbytes
        self._staging: Any = None
        self._give: Callable[[Any], None] = ops.release_staging
        if ops.unified:
            self.buffer = dev_ptr
        else:
            got = blocks.take(ops, nbytes) if blocks is not None else None
            if got is not None:
                self._give = blocks.give
            self.buffer, self._staging = got if got is not None else ops.staging_buffer(nbytes)
        ops.on_op(self)

    @property
    def target(self) -> int:
        return TICKET_BASE + self.nbytes

    def engine_ranges(self) -> list[tuple[int, int]]:
        return [(self.buffer, self.nbytes)]

    def _before_ready(self, stream: Any) -> None:
        if not self.ops.unified:
            self._queue_copies(stream, "device_to_host", [(self.buffer, self.dev_ptr, self.nbytes)],
                               self.ops.copy_to_host)

    def _after_done(self, stream: Any) -> None:
        if not self.ops.unified:
            self._queue_copies(stream, "host_to_device", [(self.dev_ptr, self.buffer, self.nbytes)],
                               self.ops.copy_to_device)

    def _release_staging(self) -> None:
        if self._staging is not None:
            self._give(self._staging)
            self._staging = None


class StagedOp(TicketedOp):
    """Any collective, its device tensors staged through host blocks: the engine runs the
    same algorithm as for CPU tensors (so CPU and device ranks can share an op) behind a
    gate on ``ready`` (``Communicator.gate``), and the completion thread raises ``done``
    once the result's host-side steps ran (``settle``): a ticket store, no device call."""

    def __init__(self, ops: DeviceOps, what: str, blocks: Any = None) -> None:
        """``blocks``: where staging blocks come from first (``take(ops, nbytes)`` -> (address,
        owner) or None, ``give(owner)``: segment_staging.SegmentStaging), else the device's pool."""
        super().__init__(ops, what)
        self._source = blocks
        self._blocks: list[tuple[int, int, Any, Callable[[Any], None]]] = []  # (address, bytes, owner, give)
        self._to_host: list[tuple[int, int, int]] = []    # (host, device, bytes)
        self._to_device: list[tuple[int, int, int]] = []  # (device, host, bytes)
        ops.on_op(self)

    @property
    def target(self) -> int:
        return TICKET_BASE + 1

    def block(self, nbytes: int) -> int:
        """A staging block of at least ``nbytes``, the op's until it retires."""
        got = self._source.take(self.ops, nbytes) if self._source is not None else None
        if got is not None:
            addr, owner = got
            self._blocks.append((addr, nbytes, owner, self._source.give))
        else:
            addr, owner = self.ops.staging_buffer(nbytes)
            self._blocks.append((addr, nbytes, owner, self.ops.release_staging))
        return addr

    def copy_in(self, host: int, dev: int, nbytes: int) -> None:
        if nbytes:
            self._to_host.append((host, dev, nbytes))

    def copy_out(self, dev: int, host: int, nbytes: int) -> None:
        if nbytes:
            self._to_device.append((dev, host, nbytes))

    def engine_ranges(self) -> list[tuple[int, int]]:
        return [(addr, n) for addr, n, _, _ in self._blocks]

    def _before_ready(self, stream: Any) -> None:
        self._queue_copies(stream, "device_to_host", self._to_host, self.ops.copy_to_host)

    def _after_done(self, stream: Any) -> None:
        self._queue_copies(stream, "host_to_device", self._to_device, self.ops.copy_to_device)

    def cancel(self, stream: Any) -> None:
        """Launched, but the engine never took the op: the caller's tensors stay as they
        were, and the blocks are released once the stream is past the copies in."""
        self._to_device.clear()
        self.done.poison()
        self.finish(stream)

    def settle(self, error: BaseException | None) -> None:
        """The engine's op and its host-side steps ended (completion thread): the result may
        go to the device, or on failure every device wait passes (the tensors hold garbage;
        Work.wait() raises)."""
        if error is None:
            self.done.signal(self.target)
        else:
            self.done.poison()

    def _release_staging(self) -> None:
        blocks, self._blocks = self._blocks, []
        for _, _, owner, give in blocks:
            give(owner)
