"""``DeviceOps`` for Apple GPUs, over the Metal bridge's C ABI (metal/bridge/mccl_metal.h).

Torch-free: it sees MTLBuffer handles, CPU addresses and byte counts; which tensor goes
where is ``metal_tensors``' choice. Everything the bridge is asked to do is decided here,
in code that runs on Linux against ``FakeBridge``-style stand-ins (tests/torch/test_metal_ops.py);
the Objective-C++ only encodes, commits and mirrors.

How the orderings map onto Metal (metal/README.md has the table):

O1 ``signal``: encode a signal of the ticket's own MTLSharedEvent into torch's command
   buffer (on torch's queue, this thread), and ask Metal's listener to raise the engine's
   ticket word once the GPU got there; the listener touches only the word and wakes its
   waiters (the engine's ``mccl_ticket_wake``).
O2 ``wait``: encode a wait for the event, and have the bridge's mirror thread copy the
   word into the event's ``signaledValue`` once the engine raised it (or poisoned it:
   2^64-1 releases every Metal wait, which compares ``>=``).
O3 ``commit``: ``torch::mps::commit()``, on the thread torch called us on, never elsewhere.

Two instances serve a process: ``unified=True`` for tensors in shared storage (the engine
reduces in ``[MTLBuffer contents] + offset``, no copy) and ``unified=False`` for private
storage, staged by blits into page-aligned host buffers wrapped as MTLBuffers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import deque
from typing import Any, Protocol

from mccl_common.errors import ConfigError

from .. import _core
from .device_order import TICKET_BASE, DeviceOps, OrderedOp

BRIDGE_ABI = 1
SHARED, PRIVATE = 0, 2  # MTLStorageMode numbers
_PAGE = mmap.PAGESIZE
# Staging buffers kept for reuse (DDP's buckets repeat every step) and the bytes they may hold.
_SPARE_BUFFERS = 8
# Retired tickets whose memory is freed only this many retirements later: Metal's listener
# block may still be calling the wake function on a word it has just raised.
_GRAVE = 64


class Bridge(Protocol):
    """What MetalOps needs of the bridge: mccl_metal.h, one method per C function."""

    def event_new(self) -> int: ...
    def event_free(self, event: int) -> None: ...
    def encode_signal(self, event: int, value: int) -> None: ...
    def encode_wait(self, event: int, value: int) -> None: ...
    def encode_copy(self, src: int, src_off: int, dst: int, dst_off: int, nbytes: int) -> None: ...
    def commit(self) -> None: ...
    def notify(self, event: int, value: int, word: int, wake: int) -> None: ...
    def mirror(self, event: int, word: int, value: int) -> None: ...
    def buffer_info(self, buffer: int) -> tuple[int, int, int]: ...  # (contents, length, mode)
    def wrap_host(self, addr: int, nbytes: int) -> int: ...
    def buffer_free(self, buffer: int) -> None: ...


class CBridge:
    """The bridge library loaded with ctypes; every failure is a ConfigError naming the call."""

    def __init__(self, lib_path: str, torch_lib: str) -> None:
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError as exc:
            raise ConfigError(f"[metal] cannot load the Metal bridge {lib_path}: {exc}; reinstall mccl on macOS "
                              "(it builds metal/bridge) or set MCCL_UNIFIED_COLLECTIVE=0") from None
        v = ctypes.c_void_p
        u64 = ctypes.c_uint64
        sig = {
            "mccl_metal_abi": ([], ctypes.c_int), "mccl_metal_error": ([], ctypes.c_char_p),
            "mccl_metal_open": ([ctypes.c_char_p], ctypes.c_int),
            "mccl_metal_has_unified_memory": ([], ctypes.c_int),
            "mccl_metal_event_new": ([], v), "mccl_metal_event_free": ([v], None),
            "mccl_metal_event_value": ([v], u64),
            "mccl_metal_encode_signal": ([v, u64], ctypes.c_int), "mccl_metal_encode_wait": ([v, u64], ctypes.c_int),
            "mccl_metal_encode_copy": ([v, u64, v, u64, u64], ctypes.c_int),
            "mccl_metal_commit": ([], ctypes.c_int),
            "mccl_metal_notify": ([v, u64, v, v], ctypes.c_int), "mccl_metal_mirror": ([v, v, u64], ctypes.c_int),
            "mccl_metal_buffer_info": ([v, ctypes.POINTER(v), ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_int)],
                                       ctypes.c_int),
            "mccl_metal_wrap_host": ([v, u64], v), "mccl_metal_buffer_free": ([v], None),
        }
        for name, (args, res) in sig.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise ConfigError(f"[metal] the Metal bridge {lib_path} lacks {name}: it is from another mccl "
                                  "version; reinstall mccl") from None
            fn.argtypes, fn.restype = args, res
        self._lib = lib
        if lib.mccl_metal_abi() != BRIDGE_ABI:
            raise ConfigError(f"[metal] the Metal bridge {lib_path} speaks ABI {lib.mccl_metal_abi()}, this mccl "
                              f"{BRIDGE_ABI}; reinstall mccl")
        self._check(lib.mccl_metal_open(torch_lib.encode()), "open")
        self.unified_memory = bool(lib.mccl_metal_has_unified_memory())

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = (self._lib.mccl_metal_error() or b"").decode(errors="replace")
            raise ConfigError(f"{text or '[metal] ' + what + ' failed'}; set MCCL_UNIFIED_COLLECTIVE=0 to stage "
                              "mps tensors through CPU copies")

    def event_new(self) -> int:
        ev = self._lib.mccl_metal_event_new()
        if not ev:
            raise ConfigError("[metal] newSharedEvent failed (no Metal device?)")
        return ev

    def event_free(self, event: int) -> None:
        self._lib.mccl_metal_event_free(event)

    def encode_signal(self, event: int, value: int) -> None:
        self._check(self._lib.mccl_metal_encode_signal(event, value), "encode_signal")

    def encode_wait(self, event: int, value: int) -> None:
        self._check(self._lib.mccl_metal_encode_wait(event, value), "encode_wait")

    def encode_copy(self, src: int, src_off: int, dst: int, dst_off: int, nbytes: int) -> None:
        self._check(self._lib.mccl_metal_encode_copy(src, src_off, dst, dst_off, nbytes), "encode_copy")

    def commit(self) -> None:
        self._check(self._lib.mccl_metal_commit(), "commit")

    def notify(self, event: int, value: int, word: int, wake: int) -> None:
        self._check(self._lib.mccl_metal_notify(event, value, word, wake), "notify")

    def mirror(self, event: int, word: int, value: int) -> None:
        self._check(self._lib.mccl_metal_mirror(event, word, value), "mirror")

    def buffer_info(self, buffer: int) -> tuple[int, int, int]:
        contents, length, mode = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_int()
        self._check(self._lib.mccl_metal_buffer_info(buffer, ctypes.byref(contents), ctypes.byref(length),
                                                     ctypes.byref(mode)), "buffer_info")
        return contents.value or 0, length.value, mode.value

    def wrap_host(self, addr: int, nbytes: int) -> int:
        buf = self._lib.mccl_metal_wrap_host(addr, nbytes)
        if not buf:
            self._check(1, "wrap_host")
        return buf

    def buffer_free(self, buffer: int) -> None:
        self._lib.mccl_metal_buffer_free(buffer)


class _Staging:
    """Page-aligned host memory wrapped as an MTLBuffer: blits write where the engine reads."""

    def __init__(self, bridge: Bridge, nbytes: int) -> None:
        self.nbytes = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        self._map = mmap.mmap(-1, self.nbytes)
        self.host = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.buffer = bridge.wrap_host(self.host, self.nbytes)
        self._bridge = bridge

    def free(self) -> None:
        self._bridge.buffer_free(self.buffer)
        # The ctypes view above pins the map's buffer export; mmap frees it with the object.


class MetalOps(DeviceOps):
    name = "mps"

    def __init__(self, bridge: Bridge, unified: bool) -> None:
        self.unified = unified
        self.registers_host = not unified  # staged buckets only: wrap_host is in every bridge
        self._bridge = bridge
        self._lock = threading.Lock()
        self._events: dict[int, tuple[Any, int]] = {}   # ticket word address -> (Ticket, event)
        self._grave: deque[tuple[Any, int]] = deque()
        self._sources: dict[int, list[Any]] = {}       # device address -> [MTLBuffer, offset, live ops]
        self._spare: list[_Staging] = []
        self._live: dict[int, _Staging] = {}          # host address -> staging buffer in use
        # Host memory of others wrapped as MTLBuffers (register_host): address -> (bytes, MTLBuffer)
        self._wrapped: dict[int, tuple[int, int]] = {}
        self._op_source: dict[int, int] = {}          # host address of a live op's buffer -> its device address
        self._wake = _core.Ticket.WAKE_FN

    # -- device addresses (staging only) -------------------------------------------------------
    def register_source(self, dev: int, buffer: int, offset: int) -> None:
        """``dev`` (torch's data_ptr of a private-storage tensor) is ``offset`` bytes into MTLBuffer
        ``buffer``: what the blits of the ops on it copy from and back to."""
        with self._lock:
            entry = self._sources.setdefault(dev, [buffer, offset, 0])
            entry[0], entry[1] = buffer, offset

    def on_op(self, op: OrderedOp) -> None:
        if not self.unified:
            with self._lock:
                if op.dev_ptr not in self._sources:
                    raise ConfigError(f"[metal] {op.what}: no MTLBuffer registered for the tensor at "
                                      f"{op.dev_ptr:#x} (metal_tensors registers it before the op)")
                self._sources[op.dev_ptr][2] += 1
                self._op_source[op.buffer] = op.dev_ptr

    def on_retire(self, op: Any) -> None:
        if self.unified or not isinstance(op, OrderedOp):
            return
        with self._lock:
            dev = self._op_source.pop(op.buffer, None)
            src = self._sources.get(dev)
            if src is not None:
                src[2] -= 1
                if src[2] <= 0:
                    del self._sources[dev]

    def _source(self, dev: int) -> tuple[int, int]:
        with self._lock:
            buffer, offset, _ = self._sources[dev]
        return buffer, offset

    # -- tickets ------------------------------------------------------------------------------
    def new_ticket(self) -> Any:
        ticket = _core.Ticket()
        # Tickets start at TICKET_BASE like the other devices' (device_order's convention);
        # the event starts at 0, so no target is met before the GPU or the engine gets there.
        ticket.signal(TICKET_BASE)
        event = self._bridge.event_new()
        with self._lock:
            self._events[ticket.address] = (ticket, event)
        return ticket

    def retire_ticket(self, ticket: Any) -> None:
        with self._lock:
            pair = self._events.pop(ticket.address, None)
            if pair is None:
                return
            self._grave.append(pair)
            dead = [self._grave.popleft() for _ in range(max(0, len(self._grave) - _GRAVE))]
        for _, event in dead:
            self._bridge.event_free(event)

    def _event(self, ticket: Any) -> int:
        with self._lock:
            return self._events[ticket.address][1]

    # -- stream operations (torch's thread) ----------------------------------------------------------
    def signal(self, stream: Any, ticket: Any, value: int) -> None:
        event = self._event(ticket)
        # The listener first: registered after the encode, a fast GPU could pass the value
        # before anyone listens (Metal then calls the block at once, but say it plainly).
        self._bridge.notify(event, value, ticket.address, self._wake)
        self._bridge.encode_signal(event, value)

    def wait(self, stream: Any, ticket: Any, value: int) -> None:
        event = self._event(ticket)
        self._bridge.mirror(event, ticket.address, value)
        self._bridge.encode_wait(event, value)

    def copy_to_host(self, stream: Any, host: int, dev: int, nbytes: int) -> None:
        buffer, offset = self._source(dev)
        staging, at = self._host_buffer(host, nbytes)
        self._bridge.encode_copy(buffer, offset, staging, at, nbytes)

    def copy_to_device(self, stream: Any, dev: int, host: int, nbytes: int) -> None:
        buffer, offset = self._source(dev)
        staging, at = self._host_buffer(host, nbytes)
        self._bridge.encode_copy(staging, at, buffer, offset, nbytes)

    def commit(self, stream: Any) -> None:
        self._bridge.commit()

    # -- staging ----------------------------------------------------------------------------
    def staging_buffer(self, nbytes: int) -> tuple[int, Any]:
        if self.unified:
            return super().staging_buffer(nbytes)
        with self._lock:
            fits = [s for s in self._spare if s.nbytes >= nbytes]
            if fits:
                s = min(fits, key=lambda s: s.nbytes)
                self._spare.remove(s)
            else:
                s = _Staging(self._bridge, nbytes)
            self._live[s.host] = s
        return s.host, s

    def _host_buffer(self, host: int, nbytes: int) -> tuple[int, int]:
        """(MTLBuffer, offset) of host memory a blit writes or reads: a staging buffer of ours,
        or a block in memory registered with ``register_host`` (mccld's shared buffers)."""
        with self._lock:
            own = self._live.get(host)
            if own is not None:
                return own.buffer, 0
            for addr, (length, buffer) in self._wrapped.items():
                if addr <= host and host + nbytes <= addr + length:
                    return buffer, host - addr
        raise ConfigError(f"[metal] {nbytes} bytes at {host:#x} are neither a staging buffer nor inside "
                          "registered host memory; stage through MetalOps.staging_buffer or register_host")

    # -- host memory of others: mccld's shared buffers, so blits land where mccld reduces ----------
    def register_host(self, addr: int, nbytes: int) -> None:
        """Wrap ``nbytes`` at ``addr`` as an MTLBuffer (newBufferWithBytesNoCopy), which wants a
        page-aligned address and a length in whole pages; ConfigError where Metal refuses."""
        if self.unified:
            raise NotImplementedError("[metal] tensors in shared storage are reduced in place, not staged")
        if addr % _PAGE or nbytes % _PAGE or nbytes <= 0:
            raise ConfigError(f"[metal] cannot wrap {nbytes} bytes at {addr:#x} as an MTLBuffer: Metal wants a "
                              f"page-aligned address and a multiple of the page ({_PAGE} bytes)")
        with self._lock:
            if any(a < addr + nbytes and addr < a + n for a, (n, _) in self._wrapped.items()):
                raise ConfigError(f"[metal] {nbytes} bytes at {addr:#x} overlap host memory already wrapped")
        buffer = self._bridge.wrap_host(addr, nbytes)
        with self._lock:
            self._wrapped[addr] = (nbytes, buffer)

    def unregister_host(self, addr: int) -> None:
        with self._lock:
            found = self._wrapped.pop(addr, None)
        if found is None:
            raise ConfigError(f"[metal] unregister_host({addr:#x}): no host memory wrapped there")
        self._bridge.buffer_free(found[1])

    def release_staging(self, owner: Any) -> None:
        with self._lock:
            self._live.pop(owner.host, None)
            self._spare.append(owner)
            stale = self._spare[:-_SPARE_BUFFERS]
            del self._spare[:-_SPARE_BUFFERS]
        for s in stale:
            s.free()


class MetalDevice:
    """The Metal bridge and the two ``MetalOps`` of this process, and where a tensor goes."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.in_place = MetalOps(bridge, unified=True)
        self.staged = MetalOps(bridge, unified=False)
        self._told: set[str] = set()

    def place(self, buffer: int, data_ptr: int, nbytes: int, what: str) -> tuple[MetalOps, int, str | None]:
        """(ops, device address, a note to log once or None) for ``nbytes`` at torch's
        ``data_ptr`` inside MTLBuffer ``buffer`` (torch's storage pointer for mps)."""
        contents, length, mode = self.bridge.buffer_info(buffer)
        offset = data_ptr - buffer
        if offset < 0 or offset + nbytes > length:
            raise ConfigError(f"[metal] {what}: {nbytes} bytes at offset {offset} do not fit the tensor's "
                              f"MTLBuffer of {length} bytes; is the storage pointer torch's MTLBuffer?")
        if contents and mode == SHARED:
            return self.in_place, contents + offset, None
        self.staged.register_source(data_ptr, buffer, offset)
        note = None
        key = f"mode{mode}"
        if key not in self._told:
            self._told.add(key)
            note = (f"[metal] {what}: the tensor's MTLBuffer has {'private' if mode == PRIVATE else f'mode {mode}'} "
                    "storage, which the CPU cannot read: its collectives stage through blits into host memory "
                    "(one copy each way, still ordered by tickets, never blocking the caller)")
        return self.staged, data_ptr, note


def bridge_path() -> str:
    """Where the build puts the bridge: next to the engine extension. Not next to this file: an
    editable install leaves the sources in the checkout and installs what CMake built elsewhere."""
    return os.path.join(os.path.dirname(os.path.abspath(_core.__file__)), "libmccl_metal.dylib")
