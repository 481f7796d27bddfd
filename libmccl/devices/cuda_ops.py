"""``DeviceOps`` for NVIDIA GPUs through the CUDA driver API, found at run time (ctypes), so
neither the build nor an import without CUDA needs it.

Tickets are 64-bit words in pinned host memory mapped into the device's address space
(``cuMemHostAlloc`` + ``cuMemHostGetDevicePointer``): the stream raises one with
``cuStreamWriteValue64`` after the kernels queued before it (O1) and holds back later work
with ``cuStreamWaitValue64`` until the engine has raised or poisoned another (O2); the
engine and the CPU see the same word through its host address, with the usual futex wait.
Buckets are staged through pinned host memory by ``cuMemcpy*Async`` on the same stream,
so the copies are ordered by the tickets and nothing calls a synchronize. CUDA submits as
it goes, so ``commit`` has nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any

from mccl_common.errors import ConfigError, MCCLError
from mccl_common.settings import EngineConfig, load

from .. import _core
from .device_order import TICKET_BASE, DeviceOps
from .device_pool import StagingPool

_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_EVENT_DEFAULT = 0x0
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
_WORDS_PER_SLAB = 512  # one 4 KiB pinned page of ticket words


def _load_driver() -> ctypes.CDLL:
    names = ["libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda")]
    errors = []
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise ConfigError("[cuda] the CUDA driver library (libcuda.so.1) was not found (" + "; ".join(errors)
                      + "); likely cause: no NVIDIA driver on this host; install it, or keep tensors on the CPU")


class _Driver:
    """The few driver entry points used, each checked; the _v2 stream memory operations
    (CUDA >= 11.7) are preferred, as the header does."""

    _SYMBOLS = {
        "cuInit": None, "cuGetErrorName": None, "cuCtxGetCurrent": None, "cuCtxSetCurrent": None,
        "cuDeviceGet": None, "cuDevicePrimaryCtxRetain": None,
        "cuMemHostAlloc": None, "cuMemHostGetDevicePointer": "cuMemHostGetDevicePointer_v2", "cuMemFreeHost": None,
        "cuMemcpyDtoHAsync": "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync": "cuMemcpyHtoDAsync_v2",
        "cuStreamWriteValue64": "cuStreamWriteValue64_v2", "cuStreamWaitValue64": "cuStreamWaitValue64_v2",
        "cuLaunchHostFunc": None,
    }
    # Used where present; without them staging stays in the driver's own pinned blocks
    # (segment_staging.py) and copies go untimed (copy_stats.py).
    _OPTIONAL = {
        "cuMemHostRegister": "cuMemHostRegister_v2", "cuMemHostUnregister": None,
        "cuEventCreate": None, "cuEventRecord": None, "cuEventElapsedTime": None,
    }

    def __init__(self, lib: Any = None) -> None:
        lib = lib if lib is not None else _load_driver()
        for name, preferred in self._SYMBOLS.items():
            fn = None
            for sym in filter(None, (preferred, name)):
                fn = getattr(lib, sym, None)
                if fn is not None:
                    break
            if fn is None:
                raise ConfigError(f"[cuda] the CUDA driver lacks {name}; likely cause: a driver older than "
                                  "CUDA 11.7; upgrade the NVIDIA driver")
            fn.restype = ctypes.c_int
            setattr(self, name, fn)
        for name, preferred in self._OPTIONAL.items():
            fn = next((f for f in (getattr(lib, sym, None) for sym in filter(None, (preferred, name)))
                       if f is not None), None)
            if fn is not None:
                fn.restype = ctypes.c_int
            setattr(self, name, fn)
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        self.cuStreamWriteValue64.argtypes = [vp, u64, u64, ctypes.c_uint]
        self.cuStreamWaitValue64.argtypes = [vp, u64, u64, ctypes.c_uint]
        self.cuMemcpyDtoHAsync.argtypes = [vp, u64, ctypes.c_size_t, vp]
        self.cuMemcpyHtoDAsync.argtypes = [u64, vp, ctypes.c_size_t, vp]
        self.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_uint]
        self.cuMemHostGetDevicePointer.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_uint]
        self.cuMemFreeHost.argtypes = [vp]
        self.cuLaunchHostFunc.argtypes = [vp, vp, vp]
        if self.cuMemHostRegister is not None and self.cuMemHostUnregister is not None:
            self.cuMemHostRegister.argtypes = [vp, ctypes.c_size_t, ctypes.c_uint]
            self.cuMemHostUnregister.argtypes = [vp]
        if all(getattr(self, n) is not None for n in ("cuEventCreate", "cuEventRecord", "cuEventElapsedTime")):
            # Events are pooled for the process's life (CudaOps.mark), never destroyed.
            self.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
            self.cuEventRecord.argtypes = [vp, vp]
            self.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        else:
            self.cuEventCreate = None
        self.check(self.cuInit(0), "cuInit")

    def check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        raise MCCLError(f"[cuda] {what} failed with {self.error_name(rc)}; see the CUDA "
                        "driver documentation for this error")

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self.cuGetErrorName(rc, ctypes.byref(name))
        return name.value.decode() if name.value else str(rc)


class _PinnedBlock:
    """Pinned host memory mapped into the device, freed when dropped."""

    def __init__(self, drv: _Driver, nbytes: int) -> None:
        self._drv = drv
        self.nbytes = nbytes
        self._ptr = ctypes.c_void_p()
        drv.check(drv.cuMemHostAlloc(ctypes.byref(self._ptr), max(nbytes, 1),
                                     _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP),
                  f"cuMemHostAlloc({nbytes})")
        dev = ctypes.c_uint64()
        drv.check(drv.cuMemHostGetDevicePointer(ctypes.byref(dev), self._ptr, 0), "cuMemHostGetDevicePointer")
        self.device = dev.value
        self.host: int = self._ptr.value

    def __del__(self) -> None:
        if self._ptr:
            self._drv.cuMemFreeHost(self._ptr)


class CudaOps(DeviceOps):
    name = "cuda"
    unified = False
    # A GPU write cannot wake a futex: without a wake the engine sees ``ready`` only at its
    # next look (the ticket's sleep slice, 2 ms). A host callback after the write wakes it
    # at once, for a few microseconds of the stream's time (scripts/cuda_check.py measures both).
    host_wake = True

    def __init__(self, device_index: int, driver: Any = None) -> None:
        """``driver``: the library to call instead of libcuda (libmccl.devices.cuda_emulator)."""
        self._drv = _Driver(driver)
        self._index = device_index
        self._lock = threading.Lock()
        self._slabs: list[_PinnedBlock] = []
        self._free_words: list[tuple[int, int]] = []  # (host address, device address)
        self._device_of: dict[int, int] = {}          # ticket host address -> device address
        self._words: dict[int, Any] = {}              # keeps each word's Ticket view alive
        self._events: list[Any] = []                  # idle timing events (mark)
        self._pool = StagingPool(lambda n: _PinnedBlock(self._drv, n), load(EngineConfig).cuda_staging_bytes,
                                 "MCCL_CUDA_STAGING_BYTES")
        self._bound = threading.local()
        self.registers_host = self._drv.cuMemHostRegister is not None and self._drv.cuMemHostUnregister is not None
        self._bind_context()
        dev = ctypes.c_int()
        self._drv.check(self._drv.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        # No device-attribute check: attribute 93 is CAN_USE_64_BIT_STREAM_MEM_OPS_V1, about the
        # old v1 entry points (off unless the kernel module enables them); an H200 reports 0
        # there while the _v2 stream memory operations bound above work. A device without
        # them fails its first write/wait with the driver's CUDA_ERROR_NOT_SUPPORTED (check()).

    def _bind_context(self) -> None:
        """The primary context on this thread (torch's threads have it once they ran CUDA work;
        a waiter thread may not): driver calls fail without a current context."""
        if getattr(self._bound, "yes", False):
            return
        ctx = ctypes.c_void_p()
        self._drv.check(self._drv.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self._drv.check(self._drv.cuDeviceGet(ctypes.byref(dev), self._index), "cuDeviceGet")
            self._drv.check(self._drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._drv.check(self._drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._bound.yes = True

    # -- tickets ---------------------------------------------------------------------------
    def new_ticket(self) -> Any:
        with self._lock:
            if not self._free_words:
                slab = _PinnedBlock(self._drv, _WORDS_PER_SLAB * 8)
                self._slabs.append(slab)
                self._free_words = [(slab.host + 8 * i, slab.device + 8 * i) for i in range(_WORDS_PER_SLAB)]
            host, dev = self._free_words.pop()
        # A recycled word is no longer referred to by any stream or engine wait (retire_ticket).
        ctypes.c_uint64.from_address(host).value = TICKET_BASE
        t = _core.Ticket.at(host)
        with self._lock:
            self._device_of[host] = dev
            self._words[host] = t
        return t

    def retire_ticket(self, ticket: Any) -> None:
        with self._lock:
            host = ticket.address
            self._words.pop(host, None)
            self._free_words.append((host, self._device_of.pop(host)))

    # -- stream operations -----------------------------------------------------------------------
    def signal(self, stream: Any, ticket: Any, value: int) -> None:
        # A plain store, not the atomic max of Ticket.signal: each word has one writer per op,
        # and the device writes a word only before anything else could raise or poison it.
        self._bind_context()
        self._drv.check(self._drv.cuStreamWriteValue64(stream, self._device_of[ticket.address], value,
                                                       _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue64")
        if self.host_wake:
            # mccl_ticket_wake is C (no GIL, no CUDA call, as host functions must be).
            self._drv.check(self._drv.cuLaunchHostFunc(stream, _core.Ticket.WAKE_FN, ticket.address),
                            "cuLaunchHostFunc")

    def wait(self, stream: Any, ticket: Any, value: int) -> None:
        self._bind_context()
        # GEQ is cyclic ((int64_t)(*addr - value) >= 0): with targets >= TICKET_BASE the
        # engine's poison (2^64-1) passes it too.
        self._drv.check(self._drv.cuStreamWaitValue64(stream, self._device_of[ticket.address], value,
                                                      _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue64")

    def copy_to_host(self, stream: Any, host: int, dev: int, nbytes: int) -> None:
        self._bind_context()
        self._drv.check(self._drv.cuMemcpyDtoHAsync(host, dev, nbytes, stream), "cuMemcpyDtoHAsync")

    def copy_to_device(self, stream: Any, dev: int, host: int, nbytes: int) -> None:
        self._bind_context()
        self._drv.check(self._drv.cuMemcpyHtoDAsync(dev, host, nbytes, stream), "cuMemcpyHtoDAsync")

    def commit(self, stream: Any) -> None:
        pass  # the driver submits each operation as it is queued

    # -- staging: pinned blocks from a pool (allocating pins pages and waits for the GPU) ----------
    def staging_buffer(self, nbytes: int) -> tuple[int, Any]:
        return self._pool.take(nbytes)

    def release_staging(self, owner: Any) -> None:
        self._pool.give(owner)

    @property
    def pool(self) -> StagingPool:
        return self._pool

    # -- host memory of others (mccld's shared buffers), pinned in place --------------------------
    def register_host(self, addr: int, nbytes: int) -> None:
        """Pin ``nbytes`` at ``addr`` (page-aligned) so the stream's asynchronous copies reach it.
        PORTABLE: any context of the process may copy; no DEVICEMAP, as copies address it by
        its host pointer and no kernel reads it. Raises MCCLError naming the driver's refusal."""
        if self._drv.cuMemHostRegister is None:
            raise MCCLError("[cuda] the CUDA driver lacks cuMemHostRegister; likely cause: a very old "
                            "driver; upgrade the NVIDIA driver")
        self._bind_context()
        self._drv.check(self._drv.cuMemHostRegister(addr, nbytes, _CU_MEMHOSTREGISTER_PORTABLE),
                        f"cuMemHostRegister({nbytes} bytes)")

    def unregister_host(self, addr: int) -> None:
        self._bind_context()
        self._drv.check(self._drv.cuMemHostUnregister(addr), "cuMemHostUnregister")

    # -- copy timing: an event before and after a run of copies ---------------------------------
    def mark(self, stream: Any) -> Any:
        if self._drv.cuEventCreate is None:
            return None
        with self._lock:
            ev = self._events.pop() if self._events else None
        if ev is None:
            out = ctypes.c_void_p()
            if self._drv.cuEventCreate(ctypes.byref(out), _CU_EVENT_DEFAULT) != 0:
                return None
            ev = out.value
        if self._drv.cuEventRecord(ev, stream) != 0:
            with self._lock:
                self._events.append(ev)
            return None
        return ev

    def elapsed_s(self, start: Any, end: Any) -> float | None:
        ms = ctypes.c_float()
        ok = self._drv.cuEventElapsedTime(ctypes.byref(ms), start, end) == 0
        with self._lock:
            self._events += [start, end]
        return ms.value / 1e3 if ok else None
