"""Shared buffers: memory a rank's tensors live in that its mccld maps too, so an all-reduce on
it moves no bytes between the training process and the daemon (``MCCL_DAEMON=1``).

Through mccld every all-reduce is otherwise copied into the rank's data segment and its
result copied back out: two passes over the buffer on the same cores and memory the links
need (docs/benchmarks.md: the daemon's gap at 8 hosts × 10 Gbit/s). A buffer is a segment like
the data segment (mccl_common/shm.py: a header with the ``ready``/``done`` tickets, then the
data), registered with ``buffer`` set so that mccld keeps it beside the data segment. An
all-reduce whose range lies inside one is sent with that segment and its offset, and the
daemon reduces and sends from the tensor's own memory.

The memory belongs to whoever holds the ``SharedBuffer`` (a tensor does, through ``view()``),
and stays valid after the communicator closes. What ends with the last reference is the
registration: the name is unlinked at once and mccld is told to unmap its side (``released``,
drained by the client's I/O thread). A finalizer may run on any thread, inside any lock, so
it only unlinks and appends to a deque.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import weakref
from typing import Any, Callable

from mccl_common import shm
from mccl_common.attach_protocol import MAX_BUFFERS_PER_RANK
from mccl_common.errors import ConfigError


def _released(name: str, pid: int, released: collections.deque) -> None:
    if os.getpid() != pid:
        return  # a forked child dropping its inherited reference: the buffer is still its parent's
    shm.unlink(name)
    released.append(name)


class SharedBuffer:
    """``nbytes`` at ``addr`` that this rank and mccld both map."""

    def __init__(self, seg: shm.Segment, released: collections.deque):
        self.segment = seg
        self.name, self.addr, self.nbytes = seg.name, seg.addr, seg.nbytes
        self.ticket_base = 0        # bytes of pipelined ops this buffer's tickets have counted
        self._finalizer = weakref.finalize(self, _released, seg.name, os.getpid(), released)

    def view(self) -> Any:
        """A writable ctypes array over the data that keeps this buffer (and its mapping) alive:
        ``torch.frombuffer`` and ``numpy.frombuffer`` hold on to it."""
        arr = (ctypes.c_char * self.nbytes).from_address(self.addr)
        arr._owner = self   # what the mapping's lifetime hangs on
        return arr

    @property
    def registered(self) -> bool:
        return self._finalizer.alive

    def holds(self, ptr: int, nbytes: int) -> bool:
        return self.registered and self.addr <= ptr and ptr + nbytes <= self.addr + self.nbytes

    def release(self) -> None:
        """Unregister now (also done when the last reference goes); the memory stays mapped for
        whoever still holds a view."""
        self._finalizer()


class BufferTable:
    """One communicator's live buffers. ``find`` runs per op on the caller's thread; the
    table holds weak references, so a buffer lives exactly as long as its tensors."""

    def __init__(self, rank: int):
        self.rank = rank
        self.released: collections.deque[str] = collections.deque()  # names mccld must unmap
        self._live: weakref.WeakValueDictionary[str, SharedBuffer] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def create(self, name: str, nbytes: int, ticket_at: Callable[[int], Any],
               hand_over: Callable[[shm.Segment], None]) -> SharedBuffer:
        """A new buffer whose descriptor ``hand_over`` gave mccld (before its register goes)."""
        if nbytes <= 0:
            raise ConfigError(f"[daemon-client] a shared buffer of {nbytes} bytes on rank {self.rank}; "
                              "ask for at least one byte")
        with self._lock:
            live = sum(b.registered for b in self._live.values())
            if live >= MAX_BUFFERS_PER_RANK:
                raise ConfigError(f"[daemon-client] rank {self.rank} already holds {live} shared "
                                  f"buffers (at most {MAX_BUFFERS_PER_RANK}); allocate fewer, larger ones "
                                  "and slice them, or drop the tensors of those no longer used")
        seg = shm.Segment(name, nbytes, create=True, ticket_at=ticket_at)
        try:
            hand_over(seg)
        except BaseException:
            seg.close()
            raise
        buf = SharedBuffer(seg, self.released)
        with self._lock:
            self._live[name] = buf
        return buf

    def find(self, ptr: int, nbytes: int) -> SharedBuffer | None:
        """The live buffer holding all of [ptr, ptr + nbytes), if one does."""
        with self._lock:
            bufs = list(self._live.values())
        for buf in bufs:
            if buf.holds(ptr, nbytes):
                return buf
        return None

    def dead(self, name: str) -> bool:
        """Whether buffer ``name`` was released (or never was one of ours)."""
        with self._lock:
            buf = self._live.get(name)
        return buf is None or not buf.registered

    def unlink_all(self) -> None:
        """The communicator is closing: no name outlives it (tensors keep their memory)."""
        with self._lock:
            bufs = list(self._live.values())
        for buf in bufs:
            buf.release()
