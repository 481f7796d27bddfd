"""Staging blocks inside mccld's shared buffers, for device tensors under ``MCCL_DAEMON=1``
(issue 27).

A device bucket is staged through host memory (device_order.StagedOp). Through mccld the
daemon client then copied that host block into its data segment and the result back out:
one copy more each way than in process. Here the blocks are cut from shared buffers
(daemon.buffers.SharedBuffer, ``DaemonCommunicator.alloc_buffer``) that the device has
registered as its own pinned memory (``DeviceOps.register_host``: ``cuMemHostRegister`` on
CUDA), so the asynchronous device-to-host copy lands where mccld reduces, the all-reduce runs
in place (``DaemonCommunicator._start_in_place``) and the result goes straight back to the
device, ordered by the op's tickets as before.

Buffers ("slabs") are cut into blocks of one power-of-two size class each (device_pool) and
reused, so after the first step nothing is allocated or registered (registering pins pages,
which stalls the GPU like an allocation). The slabs' bytes stay within the same cap as the
device's own pool (MCCL_CUDA_STAGING_BYTES), their number within half of mccld's buffers per
rank (the rest stay the user's, libmccl.shared_empty). Where a block cannot come from here
(the cap, a refused buffer or registration, another device) ``take`` returns None and the op
stages through the device's own pool as before: correct, one copy more each way. A refused
registration is logged once at WARNING and turns this off for the communicator.

A slab is unregistered, then released (mccld unmaps its side), once none of its blocks is
in use and the communicator closes; one whose op was still queued on the device then is
released when that op retires.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from mccl_common.attach_protocol import MAX_BUFFERS_PER_RANK
from mccl_common.errors import MCCLError

from .device_pool import size_class

_log = logging.getLogger(__name__)

PAGE = 4096
SLAB_BYTES = 32 << 20        # a slab serves at least this much (several DDP buckets)
MAX_SLABS = MAX_BUFFERS_PER_RANK // 2


class _Slab:
    def __init__(self, buf: Any) -> None:
        self.buffer = buf          # the SharedBuffer: keeps the mapping alive
        self.in_use = 1            # born with the block its first op takes


class _Block:
    __slots__ = ("slab", "host", "nbytes")

    def __init__(self, slab: _Slab, host: int, nbytes: int) -> None:
        self.slab, self.host, self.nbytes = slab, host, nbytes


class SegmentStaging:
    """One daemon communicator's staging blocks for the device (``ops``) they were taken for."""

    def __init__(self, alloc_buffer: Callable[[int], Any], cap_bytes: int, setting: str, rank: int) -> None:
        self._alloc = alloc_buffer
        self._cap = cap_bytes
        self._setting = setting
        self._rank = rank
        self._lock = threading.Lock()
        self._ops: Any = None
        self._slabs: list[_Slab] = []
        self._idle: dict[int, list[_Block]] = {}
        self._bytes = 0
        self._off: str | None = None      # why this stopped serving blocks (logged once)
        self._full_logged = False
        self._closed = False

    def take(self, ops: Any, nbytes: int) -> tuple[int, _Block] | None:
        if not ops.registers_host:
            return None  # a device that cannot copy into others' memory: its own pool, nothing to say
        size = -(-size_class(nbytes) // PAGE) * PAGE
        with self._lock:
            if self._closed or self._off is not None or (self._ops is not None and ops is not self._ops):
                return None
            free = self._idle.get(size)
            if free:
                block = free.pop()
                block.slab.in_use += 1
                return block.host, block
            slab_bytes = max(size, SLAB_BYTES // size * size)
            full = self._bytes + slab_bytes > self._cap or len(self._slabs) >= MAX_SLABS
            if full:
                first, self._full_logged = not self._full_logged, True
            else:
                self._bytes += slab_bytes  # reserved before the slow part, outside the lock
        if full:
            (_log.warning if first else _log.debug)(
                "[mccl] rank %d: the staging blocks in mccld's shared buffers reached %d bytes in %d buffers "
                "(cap %s, at most %d buffers); further device buckets stage through the device's own pool, "
                "one copy more each way through mccld; raise %s if this repeats",
                self._rank, self._bytes, len(self._slabs), self._setting, MAX_SLABS, self._setting)
            return None
        slab = self._new_slab(ops, slab_bytes)
        if slab is None:
            return None
        blocks = [_Block(slab, slab.buffer.addr + i * size, size) for i in range(slab_bytes // size)]
        with self._lock:
            if not self._closed:  # else this one block is served, and the slab goes when it comes back
                self._idle.setdefault(size, []).extend(blocks[1:])
        return blocks[0].host, blocks[0]

    def _new_slab(self, ops: Any, slab_bytes: int) -> _Slab | None:
        buf = None
        try:
            buf = self._alloc(slab_bytes)
            if buf.addr % PAGE:
                raise MCCLError(f"[mccl] a shared buffer at {buf.addr:#x} is not page-aligned")
            ops.register_host(buf.addr, slab_bytes)
        except (MCCLError, OSError) as exc:
            if buf is not None:
                buf.release()
            with self._lock:
                self._bytes -= slab_bytes
                first, self._off = self._off is None, f"{type(exc).__name__}: {exc}"
            (_log.warning if first else _log.debug)(
                "[mccl] rank %d: device buckets cannot be staged in mccld's shared memory (%s); they stage "
                "through the device's own pinned blocks, one copy more each way through mccld",
                self._rank, self._off)
            return None
        slab = _Slab(buf)
        with self._lock:
            self._ops = ops
            self._slabs.append(slab)
        return slab

    def give(self, block: _Block) -> None:
        slab = block.slab
        with self._lock:
            slab.in_use -= 1
            if not self._closed:
                self._idle.setdefault(block.nbytes, []).append(block)
                return
            drop = slab.in_use == 0 and slab in self._slabs
            if drop:
                self._slabs.remove(slab)
        if drop:
            self._drop(slab)

    def close(self) -> None:
        """No more blocks: slabs none of whose blocks is in use go now, the others as their
        ops retire (``give``)."""
        with self._lock:
            self._closed = True
            self._idle.clear()
            idle = [s for s in self._slabs if s.in_use == 0]
            self._slabs = [s for s in self._slabs if s.in_use]
        for slab in idle:
            self._drop(slab)

    def _drop(self, slab: _Slab) -> None:
        try:
            self._ops.unregister_host(slab.buffer.addr)
        except MCCLError as exc:
            _log.warning("[mccl] rank %d: unregistering a staging buffer from the device failed (%s); "
                         "releasing it anyway", self._rank, exc)
        slab.buffer.release()
        with self._lock:
            self._bytes -= slab.buffer.nbytes

    def in_use(self) -> int:
        """Blocks handed out and not yet given back (tests)."""
        with self._lock:
            return sum(s.in_use for s in self._slabs)

    def slabs(self) -> int:
        with self._lock:
            return len(self._slabs)
