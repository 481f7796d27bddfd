"""Daemon-owned bytes at a fixed address, for the engine to send from and receive into (p2p
messages, the collectives' scratch): ctypes, not numpy, which mccld does not otherwise need
and does not declare (issue 36). The memory comes from calloc: a large buffer's pages are
the kernel's zero pages until written, so creating one costs no pass over it."""

from __future__ import annotations

import ctypes


class RawBuffer:
    """``nbytes`` bytes at ``addr`` (never a null pointer, even for 0 bytes: the engine refuses those)."""

    __slots__ = ("_mem", "nbytes", "addr")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._mem = (ctypes.c_ubyte * max(nbytes, 1))()
        self.addr = ctypes.addressof(self._mem)

    @classmethod
    def of(cls, data: bytes) -> "RawBuffer":
        buf = cls(len(data))
        ctypes.memmove(buf.addr, data, len(data))
        return buf

    def tobytes(self) -> bytes:
        return ctypes.string_at(self.addr, self.nbytes)
