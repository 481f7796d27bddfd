"""torch glue of the device-ordering protocol (device_order): which ``DeviceOps`` serve a
tensor, its address and torch's current stream, one op's device side (``DeviceSide``: its
staging copies, O1 at launch, O2 for the waiter), and the per-device list of ops whose staging
buffers and tickets are still in use.

The device layer's entry (plan.py) reaches device_order only through here; ``DeviceOps``
implementations see addresses and stream handles. Everything here runs on a thread torch
called us on, except the failure callbacks (``DeviceSide.settle``, the one ``future`` leaves on
the op), which touch no device.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

import torch

from mccl_common.errors import ConfigError, MCCLError

from ..torch.compat import ResultFuture
from .device_order import TICKET_BASE, DeviceOps, OrderedOp, StagedOp, TicketedOp, owner_of

# Fake devices (CI) whose memory is host memory: a CPU tensor in their memory is theirs.
_installed: list[Any] = []
_cuda: dict[int, DeviceOps] = {}
_cuda_lock = threading.Lock()


def install(dev: Any) -> None:
    """Route CPU tensors in ``dev``'s memory (``dev.owns``) through ``dev``'s stream."""
    _installed.append(dev)


def uninstall(dev: Any) -> None:
    _installed.remove(dev)


def _cuda_ops(index: int) -> DeviceOps:
    with _cuda_lock:
        ops = _cuda.get(index)
        if ops is None:
            from .cuda_ops import CudaOps  # ctypes over libcuda; ConfigError names what is missing

            ops = _cuda[index] = CudaOps(index)
        return ops


class _Ledger:
    """Ops of one device still holding staging memory or tickets: reclaimed once the
    device has run their ``finish`` work, checked whenever a new op starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: list[TicketedOp] = []

    def add(self, op: TicketedOp) -> None:
        with self._lock:
            self._ops.append(op)
            self._reclaim_locked()

    def _reclaim_locked(self) -> None:
        keep = []
        for o in self._ops:
            if o.reusable():
                o.retire()
            else:
                keep.append(o)
        self._ops = keep


    def settle(self, timeout_s: float) -> None:
        """Retire every op the stream has passed, waiting up to ``timeout_s`` for those whose
        copy back is queued (a group closing: its staging blocks go back). An op nobody
        waited for has nothing queued after ``ready`` and stays until a later op reclaims it."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            pending = [o for o in self._ops if o.finishing() and not o.reusable()]
        for o in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                o.released.wait_for(TICKET_BASE + 1, left)
            except MCCLError:
                pass  # poisoned: the op was abandoned, nothing of it is queued
        with self._lock:
            self._reclaim_locked()


_ledgers: "weakref.WeakKeyDictionary[DeviceOps, _Ledger]" = weakref.WeakKeyDictionary()


def settle(timeout_s: float = 5.0) -> None:
    """``_Ledger.settle`` on every device of this process."""
    with _cuda_lock:
        ledgers = list(_ledgers.values())
    for ledger in ledgers:
        ledger.settle(timeout_s)


def copy_stats() -> dict[str, float]:
    """The staging copies of every device of this process (copy_stats.py)."""
    from .copy_stats import merged

    with _cuda_lock:
        devices = list(_ledgers.keys())
    return merged(*(d.copies.snapshot() for d in devices))


def _ledger(ops: DeviceOps) -> _Ledger:
    with _cuda_lock:
        return _ledgers.setdefault(ops, _Ledger())


def ops_for(t: torch.Tensor) -> tuple[DeviceOps, Any] | None:
    """(ops, stream) for a tensor whose collective is ordered on a device stream, else None
    (CPU tensors, and mps tensors, which stage through blocking copies in plan.py)."""
    # Cheapest tests first: this runs in every CPU all-reduce.
    if t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _cuda_ops(index), torch.cuda.current_stream(index).cuda_stream
    fake = _fake_owner(t)
    return None if fake is None else (fake, getattr(fake, "stream", None))


def on_a_stream(t: torch.Tensor) -> bool:
    """Whether ``ordered`` may order ``t``, without loading a device's driver."""
    return t.is_cuda or t.device.type == "mps" or _fake_owner(t) is not None


def stages(t: torch.Tensor) -> bool:
    """Whether the plan (plan.py) stages ``t`` through a ``StagedOp`` (host blocks, tickets):
    CUDA tensors and those of a fake device; mps tensors are the Metal bridge's or copied."""
    return t.is_cuda or _fake_owner(t) is not None


def _fake_owner(t: torch.Tensor) -> Any:
    if _installed and t.device.type == "cpu":
        return owner_of(_installed, t.data_ptr(), t.numel() * t.element_size())
    return None


class DeviceSide:
    """One op's device tensors as torch sees them: the op's tickets (device_order), the stream
    its copies and orderings go on, and both halves of the protocol around it. The device layer
    (plan.py) stages through it and launches it (O1, on torch's thread); the Work runs O2
    (``wait``, ``future``) on the waiter's thread.

    On a device with one queue (the fake device, Metal) the waiter's stream itself waits
    for ``done``. On CUDA the wait and the copies back go on a side stream, and consumers
    are ordered after an event recorded behind them: the waiter's current stream in
    wait(), and whatever chains on the CUDA-aware future from get_future() (torch runs
    its callbacks on streams synchronised with that event). So a DDP comm hook taking the
    future right after the all-reduce does not hold up the rest of backward behind it.
    ``tensors`` are the op's device tensors; the first names the device. On devices whose
    memory torch sees as CPU memory (the fake device, an emulated driver in the tests)
    ``stream`` is the device's own stream handle.
    """

    def __init__(self, order: TicketedOp, stream: Any, tensors: list[torch.Tensor],
                 on_lost: Callable[[BaseException], None]) -> None:
        self._order, self._stream, self._tensors, self._on_lost = order, stream, tensors, on_lost
        self.what = order.what
        self.ready, self.done = order.ready, order.done
        self.buffer: int = getattr(order, "buffer", 0)  # where an ordered op's engine works
        self.device = tensors[0].device
        self._event: Any = None
        self._future: Any = None
        self._lock = threading.RLock()

    # -- the caller's thread: staging and O1 ---------------------------------------------------
    def add(self, t: torch.Tensor) -> bool:
        """Take ``t`` into the op (once); False if another device serves it."""
        if any(t is d for d in self._tensors):
            return True
        found = ops_for(t)
        if found is None or found[0] is not self._order.ops:
            return False
        self._tensors.append(t)
        return True

    def block(self, nbytes: int) -> int:
        return self._order.block(nbytes)

    def copy_in(self, host: int, dev: int, nbytes: int) -> None:
        self._order.copy_in(host, dev, nbytes)

    def copy_out(self, dev: int, host: int, nbytes: int) -> None:
        self._order.copy_out(dev, host, nbytes)

    def launch(self, engine_finished: Callable[[], bool]) -> None:
        """O1, on this (torch's) thread; ``engine_finished`` tells the ledger when the engine
        let go of the op's words and buffers."""
        self._order.engine_finished = engine_finished
        self._order.launch(self._stream)

    def cancel(self) -> None:
        """Launched, but the engine never took the op."""
        self._order.cancel(self._stream)

    def abandon(self) -> None:
        """Never launched: its blocks and words go back at once."""
        self._order.abandon()

    def settle(self, error: BaseException | None) -> None:
        """The engine's op and its host-side steps ended (completion thread; StagedOp.settle)."""
        self._order.settle(error)

    # -- the waiter's thread: O2 -------------------------------------------------------------------
    def wait(self) -> None:
        if self.device.type != "cuda":
            self._order.finish(self._stream)
            return
        torch.cuda.current_stream(self.device).wait_event(self._on_side())

    def future(self, result: ResultFuture, value: Any) -> Any:
        """The future to hand out for the op whose outcome ``result`` will hold; it completes
        with ``value`` (the op's outputs)."""
        if self.device.type != "cuda":
            self._order.finish(self._stream)
            return result.future
        with self._lock:
            if self._future is None:
                self._on_side()
                with torch.cuda.stream(_side_stream(self.device)):
                    fut = torch.futures.Future(devices=[self.device])
                    fut.set_result(value)  # records its event on the side stream
                # Complete before the engine is done, as NCCL's: a failure found later cannot
                # fail it, so the process group learns of it instead (no silent garbage).
                result.on_failure(self._on_lost)  # on the completion thread: touches no device
                self._future = fut
            return self._future

    def _on_side(self) -> Any:
        with self._lock:
            if self._event is None:
                side = _side_stream(self.device)
                for t in self._tensors:
                    t.record_stream(side)  # the allocator keeps the memory until the copy back ran
                self._order.finish(side.cuda_stream)
                self._event = torch.cuda.Event()
                self._event.record(side)
            return self._event


_side: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _cuda_lock:
        if index not in _side:
            _side[index] = torch.cuda.Stream(index)
        return _side[index]


def ordered(t: torch.Tensor, name: str, blocks: Any, on_lost: Callable[[BaseException], None]) -> DeviceSide | None:
    """The device side of an all-reduce on ``t`` reduced in place (unified memory: the fake
    device, Metal) or staged by the Metal bridge, its tickets fresh, not yet launched; None
    where the plan stages it (CUDA, ``staged``) or it goes through blocking copies. ``blocks``:
    where a staged op's buffer comes from first (segment_staging.SegmentStaging); ``on_lost``:
    told of a failure found after the op's future was handed out."""
    if t.device.type == "mps":
        from . import metal_tensors  # loads the Metal bridge on first use

        placed = metal_tensors.ops_for(t, name)
        if placed is None:
            return None  # staged through blocking copies (MCCL_UNIFIED_COLLECTIVE)
        ops, addr = placed
        stream: Any = None  # torch's one MPS stream, which the bridge finds itself
    else:
        found = ops_for(t)
        if found is None:
            return None
        ops, stream = found
        if not ops.unified:
            return None  # staged like any collective: the engine's plain algorithm behind a gate
        addr = t.data_ptr()
    if not t.is_contiguous():
        raise ConfigError(f"[mccl] {name}: the {t.device} tensor is not contiguous; device tensors are "
                          "reduced in place, pass tensor.contiguous() and copy the result back")
    op = OrderedOp(ops, addr, t.numel() * t.element_size(), f"{name} on {t.device}", blocks)
    _ledger(ops).add(op)
    return DeviceSide(op, stream, [t], on_lost)


def staged(t: torch.Tensor, name: str, blocks: Any, on_lost: Callable[[BaseException], None]) -> DeviceSide | None:
    """A fresh staged op for a collective with device tensor ``t`` in it (not launched); None
    for a tensor no device stream serves. ``blocks``: where its staging blocks come from first
    (segment_staging.SegmentStaging)."""
    found = ops_for(t)
    if found is None:
        return None
    ops, stream = found
    op = StagedOp(ops, f"{name} on {t.device}", blocks)
    _ledger(ops).add(op)
    return DeviceSide(op, stream, [t], on_lost)
