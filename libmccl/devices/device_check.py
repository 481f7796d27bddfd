"""Every collective with device tensors, against a reference run on CPU tensors: the cases
of scripts/cuda_check.py (a GPU, or ``--emulated``) and tests/torch/test_device_collectives.py.

A ``Device`` makes the tensors of a case. Before each case it holds its stream back
(``begin``: a GPU sleep, or an emulated stream that waits for ``release``), so every input
is written by a kernel the device has not run yet when the collective is called: the
engine must wait for O1, and the call must return at once (``pending`` is still true
right after it, or the call waited for the device). Results are read by a kernel queued
after ``Work.wait()``, which only O2 orders. Inputs are integer-valued, so every
reduction is exact whatever the order and the results must equal the reference bit for
bit. Ranks run in processes with torch.distributed initialised (the group under test and
a reference group of CPU tensors, Gloo where Gloo has the op).
"""

from __future__ import annotations

import abc
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .device_order import TicketedOp

SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: ~25 ms at H200 clocks


def pattern(n: int, dtype: torch.dtype, seed: int, device: Any = "cpu") -> torch.Tensor:
    """Deterministic small integers (exact in every dtype used), made on ``device``."""
    i = torch.arange(n, device=device, dtype=torch.int64)
    return ((i * 7 + seed * 13) % 61 - 30).to(dtype)


class Device(abc.ABC):
    name = "device"
    produced = 0  # tensors made by produce() since begin()
    # Added to every seed: a pass with other data than the one before it, so a staging block
    # still holding the previous pass's inputs cannot pass for this one's.
    seed_offset = 0

    def begin(self) -> None:
        """Hold the stream back: what is queued next runs only after ``release`` (or a delay)."""
        self.produced = 0

    def release(self) -> None:
        """Let the stream run."""

    def pending(self) -> bool:
        """The kernels queued since ``begin`` have not all run."""
        return False

    @abc.abstractmethod
    def produce(self, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        """A tensor that holds ``pattern(n, dtype, seed)`` once a kernel queued now ran."""

    @abc.abstractmethod
    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of garbage (the op writes it)."""

    @abc.abstractmethod
    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``t``, read by a kernel queued now (after Work.wait())."""

    def close(self) -> None:
        pass


class CpuDevice(Device):
    name = "cpu"

    def produce(self, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        return pattern(n, dtype, seed + self.seed_offset)

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((n,), -99, dtype=dtype)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()


class CudaDevice(Device):
    """Tensors on torch's current CUDA device; ``begin`` queues a ~25 ms sleep kernel."""

    name = "cuda"

    def __init__(self) -> None:
        self._last: Any = None

    def begin(self) -> None:
        super().begin()
        torch.cuda._sleep(SLEEP_CYCLES)

    def produce(self, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        self.produced += 1
        t = pattern(n, dtype, seed + self.seed_offset, device="cuda")  # kernels only: no copy from pageable memory
        self._last = torch.cuda.Event()
        self._last.record()
        return t

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((n,), -99, dtype=dtype, device="cuda")

    def pending(self) -> bool:
        return self._last is not None and not self._last.query()

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone().cpu()  # the clone runs on the current stream, ordered by O2 only


class HostMemoryDevice(Device):
    """A device whose memory is host memory (the emulated CUDA driver, the fake device):
    tensors are CPU tensors over its ``alloc``-ed memory, installed in device_tensors so
    the backend routes them to its stream; kernels are functions run by the stream."""

    def __init__(self, ops: Any, launch: Callable[[Callable[[], None], list[tuple[int, int]]], None],
                 sync: Callable[[], None]) -> None:
        """``launch(fn, touches)`` queues a kernel reading or writing the (address, bytes) ranges."""
        from . import device_tensors

        self.ops = ops
        self._launch, self._sync = launch, sync
        self._gate = threading.Event()
        self._gate.set()
        self._ran = 0
        self._queued = 0
        device_tensors.install(ops)

    def begin(self) -> None:
        super().begin()
        self._gate.clear()
        self._launch(lambda: self._gate.wait(30.0), [])  # bounded: a broken test does not hang the stream

    def release(self) -> None:
        self._gate.set()

    def pending(self) -> bool:
        return self._ran < self._queued

    def _tensor(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        import ctypes

        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        addr = self.ops.alloc(nbytes)
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8).view(dtype)

    def produce(self, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        t = self._tensor(n, dtype)
        values = pattern(n, dtype, seed + self.seed_offset)
        self._queued += 1
        self.produced += 1

        def kernel() -> None:
            t.copy_(values)
            self._ran += 1
        self._launch(kernel, [_span(t)])
        return t

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self._tensor(n, dtype)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        self._launch(lambda: out.copy_(t), [_span(t)])
        self._sync()
        return out

    def close(self) -> None:
        from . import device_tensors

        self.release()
        device_tensors.uninstall(self.ops)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def emulated_cuda(emu: Any = None, stream: Any = 1) -> HostMemoryDevice:
    """A HostMemoryDevice on libmccl.devices.cuda_emulator (CudaOps with a driver of host memory)."""
    from .cuda_emulator import EmulatedCuda, Emulator

    emu = emu or Emulator(kernel_delay_s=0.001)
    ops = EmulatedCuda(emu, stream)
    dev = HostMemoryDevice(ops, lambda fn, touches: emu.launch(stream, fn), emu.idle)
    dev.emulator = emu
    dev.name = "emulated-cuda"
    return dev


def fake_device(seed: int, unified: bool) -> HostMemoryDevice:
    """A HostMemoryDevice on libmccl.devices.fake_device (jittered stream, race detection)."""
    from .fake_device import FakeDevice

    fake = FakeDevice(seed=seed, max_jitter_s=0.001, unified=unified)

    def launch(fn: Callable[[], None], touches: list[tuple[int, int]]) -> None:
        fake.launch(None, fn, touches, "test kernel")
        fake.commit(None)
    dev = HostMemoryDevice(fake, launch, fake.synchronize)
    dev.name = f"fake-{'unified' if unified else 'staged'}"
    return dev


# -- the cases -------------------------------------------------------------------------------
# Each issues one collective (async where torch allows) on tensors from ``dev`` and returns
# (works, outputs to compare). ``g`` is the group; ``r``/``w`` this rank and the world size.
N = 5003  # not a multiple of anything, so pieces and chunks are uneven


def _all_reduce(dev, g, r, w, op=dist.ReduceOp.SUM, dtype=torch.float32, n=N):
    t = dev.produce(n, dtype, r)
    return [dist.all_reduce(t, op=op, group=g, async_op=True)], [t]


def _broadcast(dev, g, r, w):
    t = dev.produce(N, torch.float32, r)
    return [dist.broadcast(t, src=w - 1, group=g, async_op=True)], [t]


def _reduce(dev, g, r, w):
    t = dev.produce(N, torch.int32, r)
    return [dist.reduce(t, dst=0, group=g, async_op=True)], [t] if r == 0 else []


def _all_gather(dev, g, r, w):
    outs = [dev.empty(N, torch.float32) for _ in range(w)]
    return [dist.all_gather(outs, dev.produce(N, torch.float32, r), group=g, async_op=True)], outs


def _all_gather_into_tensor(dev, g, r, w):
    out = dev.empty(N * w, torch.bfloat16)
    return [dist.all_gather_into_tensor(out, dev.produce(N, torch.bfloat16, r), group=g, async_op=True)], [out]


def _reduce_scatter(dev, g, r, w):
    out = dev.empty(N, torch.float32)
    ins = [dev.produce(N, torch.float32, r * w + k) for k in range(w)]
    return [dist.reduce_scatter(out, ins, group=g, async_op=True)], [out]


def _reduce_scatter_tensor(dev, g, r, w):
    out = dev.empty(N, torch.float64)
    inp = dev.produce(N * w, torch.float64, r)
    return [dist.reduce_scatter_tensor(out, inp, group=g, async_op=True)], [out]


def _gather(dev, g, r, w):
    outs = [dev.empty(N, torch.int64) for _ in range(w)] if r == 0 else None
    return [dist.gather(dev.produce(N, torch.int64, r), outs, dst=0, group=g, async_op=True)], outs or []


def _scatter(dev, g, r, w):
    out = dev.empty(N, torch.float32)
    ins = [dev.produce(N, torch.float32, 100 + k) for k in range(w)] if r == 0 else None
    return [dist.scatter(out, ins, src=0, group=g, async_op=True)], [out]


def _all_to_all(dev, g, r, w):
    outs = [dev.empty(N + k, torch.float32) for k in range(w)]
    ins = [dev.produce(N + r, torch.float32, r * w + k) for k in range(w)]
    return [dist.all_to_all(outs, ins, group=g, async_op=True)], outs


def _all_to_all_single(dev, g, r, w):
    out = dev.empty(N * w, torch.float32)
    return [dist.all_to_all_single(out, dev.produce(N * w, torch.float32, r), group=g, async_op=True)], [out]


def _send_recv(dev, g, r, w):
    if w == 1:
        return [], []
    out = dev.empty(N, torch.float32)
    send = dev.produce(N, torch.float32, r)
    peers = dist.get_process_group_ranks(g) if g is not None else list(range(w))
    works = [dist.isend(send, peers[(r + 1) % w], group=g), dist.irecv(out, peers[(r - 1) % w], group=g)]
    return works, [out]


CASES: dict[str, Callable[..., tuple[list, list]]] = {
    "all_reduce": _all_reduce,
    "all_reduce AVG": lambda d, g, r, w: _all_reduce(d, g, r, w, op=dist.ReduceOp.AVG, n=N * 64),
    "all_reduce MAX int32, 1 MiB": lambda d, g, r, w: _all_reduce(d, g, r, w, dist.ReduceOp.MAX, torch.int32,
                                                                  1 << 18),
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "gather": _gather,
    "scatter": _scatter,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "send/recv": _send_recv,
}


@dataclass
class Row:
    case: str
    equal: bool
    returned_early: bool  # the call returned before the device ran the inputs' kernels
    reference: str        # the group that computed the reference
    detail: str = ""
    issue_s: float = 0.0  # how long the collective call took


def run_case(name: str, dev: Device, group: Any, refs: list[tuple[str, Any]], rank: int, world: int,
             hold: bool = True, seed_offset: int = 0) -> Row:
    """``name`` on ``dev`` in ``group`` against CPU tensors in the first of ``refs``
    ((label, group)) that has the op (Gloo lacks AVG, for one). ``hold=False`` for a
    warm-up: the first call of a size allocates pinned memory, which waits for the device."""
    case = CASES[name]
    dev.seed_offset = seed_offset
    if hold:
        dev.begin()
    try:
        t0 = time.perf_counter()
        works, outs = case(dev, group, rank, world)
        issue_s = time.perf_counter() - t0
        early = dev.pending() if dev.produced else True  # nothing produced: nothing to be early for
    finally:
        dev.release()
    for wk in works:
        wk.wait()
    got = [dev.read(o) for o in outs]
    for label, ref_group in refs:
        try:
            cpu = CpuDevice()
            cpu.seed_offset = seed_offset
            works, ref = case(cpu, ref_group, rank, world)
            for wk in works:
                wk.wait()
            break
        except Exception as exc:  # noqa: BLE001 - the reference backend lacks the op (Gloo: AVG, ...)
            label, ref = f"none ({label}: {str(exc).splitlines()[0][:80]})", None
    if ref is None:
        return Row(name, False, early, label, "no reference group has this op", issue_s)
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)]
    detail = ""
    if bad:
        a, b = got[bad[0]], ref[bad[0]]
        detail = f"output {bad[0]}: max |diff| {float((a.double() - b.double()).abs().max()):.3g}"
    elif len(got) != len(ref):
        detail = f"{len(got)} outputs, the reference has {len(ref)}"
    return Row(name, not detail, early, label, detail, issue_s)


def without_o1() -> Callable[[], None]:
    """The negative control: the CPU raises ``ready`` at once, while the copies of the inputs
    are still queued. Returns the undo."""
    original = TicketedOp.launch

    def launch(self: TicketedOp, stream: Any) -> None:
        self._before_ready(stream)
        self.ready.signal(self.target)
        self.ops.commit(stream)
    TicketedOp.launch = launch  # type: ignore[method-assign]
    return lambda: setattr(TicketedOp, "launch", original)
