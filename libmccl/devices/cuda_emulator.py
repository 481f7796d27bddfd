"""An emulated CUDA driver: the entry points ``cuda_ops.CudaOps`` calls, over host memory,
so the CUDA path runs without a GPU (tests/torch/test_cuda_ops_emulated.py,
tests/torch/test_device_collectives.py, scripts/cuda_check.py --emulated).

Pinned "host" memory has its host address as device address (UVA), and "device memory"
is host memory too (``EmulatedCuda.alloc``), so torch sees CPU tensors that
``device_tensors`` routes to the emulated device. Each stream is a worker thread that
runs its commands in order. ``cuStreamWaitValue64`` compares cyclically, as CUDA documents
for GEQ ((int64_t)(*addr - value) >= 0).

What would stall a real GPU's caller is made visible: ``cuMemHostAlloc``,
``cuMemFreeHost`` and ``cuMemHostRegister``/``Unregister`` wait until every stream is idle, as the
driver does when it maps or unmaps pinned memory (the hidden synchronisation of issue 10), and each is counted with
the synchronize calls in ``calls``; ``forbid`` makes any of them raise instead.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
import types
from typing import Any, Callable

from . import cuda_ops

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# (cuMemHostUnregister waits too, but only as a group closes, outside any hot path.)
SYNCHRONISING = ("cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister", "cuStreamSynchronize", "cuCtxSynchronize")
# The driver's codes for what the emulator refuses (cuda.h's CUresult).
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
CUDA_ERROR_NOT_READY = 600
_NAMES = {CUDA_ERROR_INVALID_VALUE: b"CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_NOT_SUPPORTED: b"CUDA_ERROR_NOT_SUPPORTED",
          CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: b"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
          CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: b"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
          CUDA_ERROR_NOT_READY: b"CUDA_ERROR_NOT_READY"}
PAGE = 4096


def _val(x: Any) -> Any:
    return getattr(x, "value", x)


class Emulator:
    """The driver; every entry point returns CUDA_SUCCESS (0) unless forbidden."""

    def __init__(self, kernel_delay_s: float = 0.003, alloc_waits: bool = True) -> None:
        """``alloc_waits=False``: pinned allocations do not wait for the streams, for ranks
        that share one emulator (threads): on a GPU each process waits for its own context only."""
        self.kernel_delay_s = kernel_delay_s
        self.alloc_waits = alloc_waits
        self.blocks: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []
        self.host_fns = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self.forbidden: set[str] = set()
        self.registered: dict[int, int] = {}   # cuMemHostRegister'd ranges: address -> bytes
        self.register_error = 0                # what cuMemHostRegister returns instead of success
        self._events: dict[int, float | None] = {}
        self._next_event = 1
        self._streams: dict[Any, collections.deque] = {}
        self._busy = 0  # commands queued or running, all streams
        self._cv = threading.Condition()
        self._stop = False
        self._threads: list[threading.Thread] = []

    def forbid(self, *names: str) -> None:
        """Calling any of ``names`` from now on raises (a test's hot path)."""
        self.forbidden |= set(names)

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.forbidden:
            raise AssertionError(f"[cuda-emulator] {name} called where it is forbidden (it stalls the GPU's caller)")

    # -- context, device ------------------------------------------------------------------
    def cuInit(self, flags): return 0
    def cuGetErrorName(self, rc, out): out._obj.value = _NAMES.get(rc, b"CUDA_ERROR_EMULATED"); return 0
    def cuCtxGetCurrent(self, out): out._obj.value = 1; return 0
    def cuCtxSetCurrent(self, ctx): return 0
    def cuDeviceGet(self, out, index): out._obj.value = index; return 0
    def cuDevicePrimaryCtxRetain(self, out, dev): out._obj.value = 1; return 0

    def cuCtxSynchronize(self):
        self._count("cuCtxSynchronize")
        self.idle()
        return 0

    def cuStreamSynchronize(self, stream):
        self._count("cuStreamSynchronize")
        self.idle()
        return 0

    # -- pinned memory: mapping it waits for the device ----------------------------------------
    def cuMemHostAlloc(self, out, nbytes, flags):
        self._count("cuMemHostAlloc")
        if self.alloc_waits:
            self.idle()
        buf = (ctypes.c_char * nbytes)()
        self.blocks[ctypes.addressof(buf)] = buf
        out._obj.value = ctypes.addressof(buf)
        return 0

    def cuMemHostGetDevicePointer(self, out, host, flags):
        out._obj.value = _val(host)
        return 0

    def cuMemFreeHost(self, host):
        self._count("cuMemFreeHost")
        if self.alloc_waits:
            self.idle()
        self.freed.append(_val(host))
        return 0

    def cuMemHostRegister(self, host, nbytes, flags):
        """As the driver: pins (waiting for the device, like an allocation); refuses a range
        not on page boundaries (this driver's rule: the CUDA 4.0 one, stricter than today's)
        or overlapping one already registered."""
        self._count("cuMemHostRegister")
        addr = _val(host)
        if self.register_error:
            return self.register_error
        if not nbytes or addr % PAGE or nbytes % PAGE:
            return CUDA_ERROR_INVALID_VALUE
        with self._cv:
            if any(a < addr + nbytes and addr < a + n for a, n in self.registered.items()):
                return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        if self.alloc_waits:
            self.idle()
        with self._cv:
            self.registered[addr] = nbytes
        return 0

    def cuMemHostUnregister(self, host):
        self._count("cuMemHostUnregister")
        if self.alloc_waits:
            self.idle()
        with self._cv:
            return 0 if self.registered.pop(_val(host), None) is not None else CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED

    # -- events: the stream's clock when it passes them ---------------------------------------
    def cuEventCreate(self, out, flags):
        with self._cv:
            ev, self._next_event = self._next_event, self._next_event + 1
            self._events[ev] = None
        out._obj.value = ev
        return 0

    def cuEventRecord(self, ev, stream):
        ev = _val(ev)
        with self._cv:
            self._events[ev] = None
        return self.enqueue(stream, lambda: self._events.__setitem__(ev, time.perf_counter()))

    def cuEventElapsedTime(self, out, start, end):
        with self._cv:
            a, b = self._events.get(_val(start)), self._events.get(_val(end))
        if a is None or b is None:
            return CUDA_ERROR_NOT_READY
        out._obj.value = (b - a) * 1e3
        return 0

    # -- streams -----------------------------------------------------------------------------
    def enqueue(self, stream: Any, fn: Callable[[], Any]) -> int:
        with self._cv:
            q = self._streams.get(stream)
            if q is None:
                q = self._streams[stream] = collections.deque()
                t = threading.Thread(target=self._run, args=(q,), name=f"cuda-emu-stream-{stream}", daemon=True)
                self._threads.append(t)
                t.start()
            q.append(fn)
            self._busy += 1
            self._cv.notify_all()
        return 0

    def _run(self, q: collections.deque) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: q or self._stop)
                if self._stop:
                    return
                fn = q[0]
            try:
                fn()
            finally:
                with self._cv:
                    q.popleft()
                    self._busy -= 1
                    self._cv.notify_all()

    def idle(self, timeout_s: float = 60.0) -> None:
        """Waits until every stream ran everything queued (what a synchronize does)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._busy == 0, timeout_s):
                raise TimeoutError(f"Timed out after {timeout_s} s: [cuda-emulator] {self._busy} command(s) "
                                   "still queued")

    def launch(self, stream: Any, fn: Callable[[], Any], delay_s: float | None = None) -> None:
        """A kernel: runs on the stream after a pause, so the CPU is ahead of the GPU."""
        pause = self.kernel_delay_s if delay_s is None else delay_s
        self.enqueue(stream, lambda: (time.sleep(pause), fn()))

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self.enqueue(stream, lambda: ctypes.memmove(_val(dst), _val(src), n))

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self.enqueue(stream, lambda: ctypes.memmove(_val(dst), _val(src), n))

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        return self.enqueue(stream, lambda: setattr(ctypes.c_uint64.from_address(addr), "value", value))

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        def wait():
            word = ctypes.c_uint64.from_address(addr)
            while (word.value - value) % (1 << 64) >= (1 << 63):  # cyclic GEQ
                time.sleep(1e-4)
        return self.enqueue(stream, wait)

    def cuLaunchHostFunc(self, stream, fn, data):
        def call():
            self.host_fns += 1
            _HOST_FN(fn)(data)
        return self.enqueue(stream, call)

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(5.0)

    def library(self) -> Any:
        """Plain functions, like a CDLL's, so CudaOps can set restype/argtypes on them."""
        return types.SimpleNamespace(**{name: (lambda m: lambda *a: m(*a))(getattr(self, name))
                                        for name in dir(self) if name.startswith("cu")})


class EmulatedCuda(cuda_ops.CudaOps):
    """``CudaOps`` on the emulator, with device memory torch sees as CPU memory: install it
    with ``device_tensors.install`` and its tensors take the CUDA path (staging, tickets)."""

    def __init__(self, emu: Emulator, stream: Any) -> None:
        self._emu = emu
        self.stream = stream  # device_tensors.ops_for hands it to the ops
        self._memory: list[Any] = []
        self._spans: list[tuple[int, int]] = []
        super().__init__(0, driver=emu.library())

    def alloc(self, nbytes: int) -> int:
        buf = (ctypes.c_char * max(nbytes, 1))()
        ctypes.memset(buf, 0xFF, max(nbytes, 1))  # NaN / -1 until a kernel writes it
        self._memory.append(buf)
        addr = ctypes.addressof(buf)
        self._spans.append((addr, nbytes))
        return addr

    def owns(self, addr: int, nbytes: int) -> bool:
        return any(a <= addr and addr + nbytes <= a + n for a, n in self._spans)
