"""The device layer's entry: one collective's tensors -> what the engine works on, and how
the op finishes. The backend (libmccl.torch.backend) calls it twice per collective:

    plan = prepare(name, tensors, blocks, on_lost, in_place=t, solo=...)   # staging, tickets, placement
    plan.launch(work, track, gate, engine_call, *engine_args)             # O1, the gate, the engine op

and hands the Work what it needs to finish: ``plan.keep`` (every buffer whose address the engine
holds), ``plan.finish`` (the copy-backs, run on completion; None where there are none) and
``plan.waiter`` (the device's side of O2, or None). ``prepare`` decides the path: solo (a group of one: nothing staged),
ordered (an all-reduce reduced in place on a device's memory or the Metal bridge's buffer,
device_tensors.ordered), staged (device tensors through host blocks behind a gate on ``ready``)
or plain host buffers (CPU tensors, non-contiguous ones and mps tensors through blocking copies,
``unified``). Collectives with several buffers build them on the plan (``input``, ``output``,
``scratch``, ...) between the two calls.

The engine sees only (pointer, bytes, dtype code); arguments were checked by the torch glue
(libmccl/torch/args.py). Below this module: device_tensors (the torch glue of the ordering
protocol), which alone reaches device_order and through it the device kinds.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import torch

from mccl_common.errors import ConfigError

from . import device_tensors
from .device_order import TICKET_BASE


def _unified() -> Any:
    # The staging helpers for mps tensors, imported only when one shows up: collectives other
    # than all_reduce, and all_reduce where the Metal bridge is off (metal_tensors).
    from . import unified

    return unified


def _ignore(error: BaseException) -> None:
    pass


def prepare(name: str, tensors: Sequence[Any] = (), blocks: Any = None,
            on_lost: Callable[[BaseException], None] = _ignore, *, in_place: torch.Tensor | None = None,
            solo: bool = False) -> "Plan":
    """The plan of one collective over ``tensors`` (nested lists allowed; pass every tensor of
    the op, so that scratch buffers are staging blocks too when a device is involved).

    ``in_place``: the tensor an all-reduce reduces in place; its buffer's address is ``buffer``.
    ``solo``: a group of one, where the collective (all-reduce, broadcast, reduce) is the identity:
    whatever the tensor's device, no staging buffer, gate or helper thread, and ``buffer`` is 0
    (the solo communicator ignores it). Out-of-place ones in a group of one are planned as
    usual: a copy on the device would have to be ordered on its stream, which the tickets do. ``blocks``: where device staging blocks
    come from first (segment_staging.SegmentStaging). ``on_lost``: told of a device op's failure
    found after its future was handed out."""
    if solo:
        return Plan(name, (), blocks, on_lost)
    if in_place is None:
        return Plan(name, tensors, blocks, on_lost)
    side = device_tensors.ordered(in_place, name, blocks, on_lost)
    if side is not None:
        plan = Plan(name, (), blocks, on_lost)
        plan.device, plan.ordered, plan.buffer = side, True, side.buffer
        plan.waiter = side
        plan.keep.append(side)
        return plan
    plan = Plan(name, [in_place], blocks, on_lost)
    plan.buffer = plan.inout(in_place).data_ptr()
    return plan


class Plan:
    """Contiguous host buffers for one operation, what to do when it completes, and how to
    launch it.

    ``keep`` holds every buffer whose address was handed to the engine. On completion
    (``finish``), ``unpack`` steps (slices of a flat receive buffer into per-tensor buffers) run
    first, then the copy-backs into the caller's tensors (non-contiguous, MPS), which may read
    what the unpacking wrote.

    Tensors on a device stream (CUDA, a fake device) are staged through host blocks of one
    device op instead (``device``, a device_tensors.DeviceSide): their copies in and out are
    queued on the stream by the op's tickets, never run here. An ordered all-reduce
    (``ordered``) has no host buffer of its own: the engine works on ``buffer`` between the
    op's tickets.
    """

    def __init__(self, name: str, tensors: Sequence[Any], blocks: Any,
                 on_lost: Callable[[BaseException], None]) -> None:
        self.keep: list[Any] = []
        self.buffer = 0
        self.device: Any = None   # the DeviceSide, if a tensor is on a device stream
        self.waiter: Any = None   # what Work.wait()/get_future() order the waiter after (O2)
        self.ordered = False
        # The Work's step on completion, once there is one (none for an in-place CPU buffer).
        self.finish: Callable[[], None] | None = None
        self._unpack: list[Callable[[], None]] = []
        self._copy_back: list[Callable[[], None]] = []
        self._name = name
        self._blocks = blocks
        self._on_lost = on_lost
        for t in _flat(tensors):
            if device_tensors.stages(t):
                self._stage(t)

    # -- launch ------------------------------------------------------------------------------
    def launch(self, work: Any, track: Callable[[int, Any], Any], gate: Callable[[Any, int, int], None],
               call: Callable[..., int], *args: Any) -> None:
        """Enqueue the engine op ``call(*args)`` and ``track(op_id, work)``. A device op is ordered
        by its tickets: an ordered all-reduce's engine op waits for ``ready`` itself, then O1 is
        queued on this (torch's) thread; a staged one queues O1 first and enqueues the engine op
        behind a gate on ``ready``. Either way the call returns once the copies are queued,
        whatever the device still has to run. ``work`` (torch/work.py MCCLWork) is asked only
        ``is_completed`` (when the engine let go of a device op's words) and ``on_failure``;
        ``gate`` is the communicator's (``Communicator.gate``)."""
        side = self.device
        if side is None:
            track(call(*args), work)
        elif self.ordered:
            try:
                track(call(*args, ready=side.ready, done=side.done, base=TICKET_BASE), work)
                side.launch(work.is_completed)  # O1; the engine waits for it
            except BaseException:
                side.abandon()  # the engine's wait for ready, if enqueued, fails instead of timing out
                raise
        else:
            work.on_failure(side.settle)  # on the completion thread: a ticket store, no device call
            try:
                side.launch(work.is_completed)
            except BaseException:
                side.abandon()  # nothing reached the engine
                raise
            try:
                gate(side.ready, TICKET_BASE, 1)
                op_id = call(*args)
            except BaseException:
                side.cancel()  # the queued gate passes once the stream raises ready
                raise
            track(op_id, work)

    def abandon(self) -> None:
        """The op will not be launched: a device op's blocks and words go back at once."""
        if self.device is not None:
            self.device.abandon()

    def _finish(self) -> None:
        """The op completed (completion thread): unpack, copy back, and let a staged device op's
        result go to the device."""
        steps = self._unpack + self._copy_back
        if steps:
            # Like c10d, write parameters as plain memory: a copy into a leaf that
            # requires grad must not be recorded (or refused) by autograd.
            with torch.no_grad():
                for step in steps:
                    step()
        if self.device is not None and not self.ordered:
            self.device.settle(None)  # last: the device copies the result

    # -- staging -----------------------------------------------------------------------------
    def _stage(self, t: torch.Tensor) -> None:
        if self.device is None:
            self.device = self.waiter = device_tensors.staged(t, self._name, self._blocks, self._on_lost)
            self.keep.append(self.device)
            self.finish = self._finish
        elif not self.device.add(t):
            self._refuse(f"[mccl] {self._name}: tensors on {self.device.device} and {t.device} in one "
                         "call; mccl runs one device per process, move them to one device")

    def _refuse(self, message: str) -> None:
        self.abandon()  # never launched: its blocks and words go back at once
        raise ConfigError(message)

    def _hold(self, buf: Any) -> Any:
        self.keep.append(buf)
        return buf

    def _on_device(self, t: torch.Tensor) -> bool:
        if not device_tensors.stages(t):
            return False
        self._stage(t)  # a tensor the constructor was not shown is taken now (its scratch may be pageable: slower)
        return True

    def _host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer: a staging block when a device is involved (copies into pageable
        memory would be synchronous), else ordinary memory."""
        if self.device is None:
            return torch.empty(numel, dtype=dtype)
        n = numel * torch.empty(0, dtype=dtype).element_size()
        if n == 0:
            return torch.empty(numel, dtype=dtype)
        addr = self.device.block(n)
        return torch.frombuffer((ctypes.c_char * n).from_address(addr), dtype=torch.uint8).view(dtype)

    def _device_contiguous(self, t: torch.Tensor, what: str) -> None:
        if not t.is_contiguous():
            self._refuse(f"[mccl] {self.device.what}: the {t.device} {what} is not contiguous; device "
                         "tensors are written in place, pass tensor.contiguous() and copy the result back")

    def input(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer the engine only reads."""
        if self._on_device(t):
            src = self._hold(t if t.is_contiguous() else t.contiguous())  # queued on t's stream, before O1
            buf = self._host(t.numel(), t.dtype).view(t.shape)
            self.device.copy_in(buf.data_ptr(), src.data_ptr(), _nbytes(t))
            return self._hold(buf)
        if t.device.type == "mps":
            return self._hold(_unified().staging_copy_to_cpu(t).contiguous())
        return self._hold(t if t.is_contiguous() else t.contiguous())

    def input_into(self, t: torch.Tensor, dst: torch.Tensor) -> None:
        """``t``'s elements into ``dst``, a host buffer of this op whose rows are contiguous
        (packing several inputs into one send buffer): of ``t``'s dtype, or flat bytes."""
        if not self._on_device(t):
            src = self.input(t)
            if dst.dtype == t.dtype:
                dst.copy_(src.reshape(dst.shape))
            else:  # a flat byte slice of a packed buffer
                dst.copy_(as_bytes(src))
            return
        src = self._hold(t if t.is_contiguous() else t.contiguous())
        rows = dst if dst.dim() == 2 else dst.reshape(1, -1)
        row_bytes = rows.shape[1] * rows.element_size()
        for i in range(rows.shape[0]):
            self.device.copy_in(rows[i].data_ptr(), src.data_ptr() + i * row_bytes, row_bytes)

    def inout(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer the engine reads and overwrites in place."""
        if self._on_device(t):
            self._device_contiguous(t, "tensor")
        buf = self.input(t)
        if buf is not t:
            self.copy_back(t, buf)
        return buf

    def output(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer the engine only writes."""
        if t.device.type == "cpu" and t.is_contiguous() and not self._on_device(t):
            return self._hold(t)
        buf = self._hold(self._host(t.numel(), t.dtype).view(t.shape))
        self.copy_back(t, buf)
        return buf

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._hold(self._host(numel, dtype))

    def packed(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inputs concatenated into one flat byte buffer (dtypes may differ)."""
        if self.device is None:
            flat = [as_bytes(self.input(p)) for p in parts]
            return self._hold(torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8))
        buf = self.scratch(sum(_nbytes(p) for p in parts), torch.uint8)
        offset = 0
        for p in parts:
            self.input_into(p, buf[offset:offset + _nbytes(p)])
            offset += _nbytes(p)
        return buf

    def copy_back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._on_device(dst):
            # After the engine and the unpacking: queued behind the wait for done (O2).
            self._device_contiguous(dst, "output")
            self.device.copy_out(dst.data_ptr(), src.data_ptr(), _nbytes(dst))
        elif dst.device.type == "mps":
            self._copy_back.append(lambda: _unified().copy_back(dst, src.view(dst.shape)))
            self.finish = self._finish
        else:
            self._copy_back.append(lambda: dst.copy_(src.view(dst.shape)))
            self.finish = self._finish

    def unpack(self, dst: torch.Tensor, src_bytes: torch.Tensor) -> None:
        """On completion, copy a slice of a flat byte buffer into contiguous ``dst``."""
        self._unpack.append(lambda: as_bytes(dst).copy_(src_bytes))
        self.finish = self._finish


def _flat(xs: Any) -> list[Any]:
    if isinstance(xs, torch.Tensor):
        return [xs]
    if isinstance(xs, (list, tuple)):
        return [t for x in xs for t in _flat(x)]
    return []


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
