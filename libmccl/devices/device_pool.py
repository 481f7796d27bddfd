"""A pool of staging blocks for device tensors (torch-free: blocks are addresses).

Allocating pinned host memory is slow and, on CUDA, waits for the device: a
``cuMemHostAlloc`` inside a collective call blocked the caller until the GPU had run the
work queued in front of the bucket (33-56 ms on the H200, issue 10). So blocks are
allocated in power-of-two size classes and reused: after the first step of a job (DDP's
buckets repeat every step) a collective allocates nothing. The pool keeps at most
``cap_bytes`` of idle blocks; a block returned beyond that is freed (which stalls the
device too), logged once at WARNING with the setting that raises the cap.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

_log = logging.getLogger(__name__)

MIN_BLOCK = 64 << 10


def size_class(nbytes: int) -> int:
    """The block size serving ``nbytes``: a power of two, at least MIN_BLOCK."""
    return max(MIN_BLOCK, 1 << max(nbytes - 1, 0).bit_length())


class StagingPool:
    """``allocate(nbytes)`` returns an object with ``.host`` (an int address) and ``.nbytes``
    whose memory is released when the object is dropped."""

    def __init__(self, allocate: Callable[[int], Any], cap_bytes: int, setting: str) -> None:
        self._allocate = allocate
        self._cap = cap_bytes
        self._setting = setting
        self._lock = threading.Lock()
        self._idle: dict[int, list[Any]] = {}
        self._idle_bytes = 0
        self._warned = False
        self.allocations = 0  # blocks ever allocated (tests: none once the pool is warm)

    def take(self, nbytes: int) -> tuple[int, Any]:
        size = size_class(nbytes)
        with self._lock:
            free = self._idle.get(size)
            if free:
                block = free.pop()
                self._idle_bytes -= size
                return block.host, block
            self.allocations += 1
        block = self._allocate(size)
        return block.host, block

    def give(self, block: Any) -> None:
        with self._lock:
            if self._idle_bytes + block.nbytes <= self._cap:
                self._idle.setdefault(block.nbytes, []).append(block)
                self._idle_bytes += block.nbytes
                return
            warn, self._warned = not self._warned, True
        (_log.warning if warn else _log.debug)(
            "[mccl] the staging pool holds %d idle bytes, its cap (%s); freeing a %d-byte block, which "
            "waits for the device; raise %s if this repeats", self._idle_bytes, self._setting, block.nbytes,
            self._setting)  # the block is freed once the retiring op drops it

    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes
