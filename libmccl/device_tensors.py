"""torch glue of the device-ordering protocol (device_order): which ``DeviceOps`` serve a
tensor, its address and torch's current stream, and the per-device list of ops whose
staging buffers and tickets are still in use.

Only this module and the backend look at torch types; ``DeviceOps`` implementations see
addresses and stream handles. Every function here runs on a thread torch called us on.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .device_order import DeviceOps, OrderedOp
from .errors import ConfigError

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
        self._ops: list[OrderedOp] = []

    def add(self, op: OrderedOp) -> None:
        with self._lock:
            self._ops.append(op)
            keep = []
            for o in self._ops:
                if o.reusable():
                    o.retire()
                else:
                    keep.append(o)
            self._ops = keep


_ledgers: dict[int, _Ledger] = {}


def _ledger(ops: DeviceOps) -> _Ledger:
    return _ledgers.setdefault(id(ops), _Ledger())


def ops_for(t: torch.Tensor) -> tuple[DeviceOps, Any] | None:
    """(ops, stream) for a tensor whose collective is ordered on a device stream, else None
    (CPU tensors, and mps tensors, which stage through blocking copies in _buffers)."""
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _cuda_ops(index), torch.cuda.current_stream(index).cuda_stream
    if t.device.type == "cpu" and _installed:
        nbytes = t.numel() * t.element_size()
        for dev in _installed:
            if dev.owns(t.data_ptr(), nbytes):
                return dev, None
    return None


def current_stream(ops: DeviceOps, t: torch.Tensor) -> Any:
    """The waiter's current stream for ``t``'s device (O2 runs on the waiter's thread)."""
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return None


def ordered(t: torch.Tensor, name: str) -> tuple[OrderedOp, Any] | None:
    """The device side of a collective on ``t``, its tickets fresh, not yet launched."""
    found = ops_for(t)
    if found is None:
        return None
    ops, stream = found
    if not t.is_contiguous():
        raise ConfigError(f"[mccl] {name}: the {t.device} tensor is not contiguous; device tensors are "
                          "reduced in place, pass tensor.contiguous() and copy the result back")
    op = OrderedOp(ops, t.data_ptr(), t.numel() * t.element_size(), f"{name} on {t.device}")
    _ledger(ops).add(op)
    return op, stream
