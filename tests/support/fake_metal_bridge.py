"""A stand-in for the Metal bridge's C ABI (metal/bridge/mccl_metal.h), for Linux CI.

It behaves as Metal and torch's MPS stream do where MetalOps relies on them: encoded
commands do nothing until committed; committed command lists run in order on one worker
thread (the "GPU"), each command after a seeded pause; a shared event's value only grows;
a wait command holds the GPU until the event reaches its value; listeners run once the
event reaches theirs (at once if it already has); the mirror copies a CPU word into an
event once the word is high enough. MTLBuffers are host memory; a private buffer reports
no CPU address, as Metal does. Encoding or committing on a thread other than the one
that made the bridge (torch's thread) raises ForeignThreadCommit, like the fake device.
"""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
import time
from typing import Any, Callable

from libmccl.devices.device_order import ForeignThreadCommit, UncommittedCommands
from libmccl.devices.metal_ops import PRIVATE, SHARED

_WAKE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeBridge:
    def __init__(self, seed: int = 0, max_jitter_s: float = 0.003, wait_timeout_s: float = 30.0) -> None:
        self._rnd = random.Random(seed)
        self._jitter = max_jitter_s
        self._timeout = wait_timeout_s
        self._ids = itertools.count(0x1000, 0x10)
        self._owner = threading.get_ident()
        self._cv = threading.Condition()
        self._open: list[tuple[str, Callable[[], None]]] = []
        self._queue: list[list[tuple[str, Callable[[], None]]]] = []
        self._events: dict[int, dict[str, Any]] = {}
        self._buffers: dict[int, dict[str, Any]] = {}
        self._mirrors: list[tuple[int, int, int]] = []
        self.errors: list[BaseException] = []
        self.freed_events = 0
        self._closed = False
        self._gpu = threading.Thread(target=self._run, name="fake-metal-gpu", daemon=True)
        self._mirror = threading.Thread(target=self._mirror_loop, name="fake-metal-mirror", daemon=True)
        self._gpu.start()
        self._mirror.start()

    # -- test helpers -------------------------------------------------------------------------
    def new_buffer(self, nbytes: int, mode: int = SHARED) -> tuple[int, int]:
        """(MTLBuffer handle, host address) of a buffer torch would have allocated."""
        mem = (ctypes.c_char * nbytes)()
        handle = next(self._ids)
        self._buffers[handle] = {"mem": mem, "host": ctypes.addressof(mem), "len": nbytes, "mode": mode}
        return handle, ctypes.addressof(mem)

    def kernel(self, label: str, fn: Callable[[], None]) -> None:
        """Encode a "kernel" (a Python function the GPU thread runs), as torch's ops would."""
        self._guard(f"encode {label}")
        self._open.append((label, fn))

    def synchronize(self) -> None:
        with self._cv:
            if self._open:
                raise UncommittedCommands(f"[fake-metal] {len(self._open)} command(s) encoded, never committed")
            ok = self._cv.wait_for(lambda: not self._queue or self.errors, timeout=self._timeout)
        if self.errors:
            raise self.errors[0]
        assert ok, "fake GPU did not drain"

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- the C ABI, as MetalOps calls it --------------------------------------------------------
    def event_new(self) -> int:
        h = next(self._ids)
        self._events[h] = {"value": 0, "listeners": []}
        return h

    def event_free(self, event: int) -> None:
        self._events.pop(event)
        self.freed_events += 1

    def event_value(self, event: int) -> int:
        return self._events[event]["value"]

    def encode_signal(self, event: int, value: int) -> None:
        self._guard("encode_signal")
        self._open.append((f"signal {value:#x}", lambda: self._raise(event, value)))

    def encode_wait(self, event: int, value: int) -> None:
        self._guard("encode_wait")

        def wait() -> None:
            with self._cv:
                if not self._cv.wait_for(lambda: self._events[event]["value"] >= value or self._closed,
                                         timeout=self._timeout):
                    raise TimeoutError(f"[fake-metal] GPU wait for {value:#x} never released")
        self._open.append((f"wait {value:#x}", wait))

    def encode_copy(self, src: int, src_off: int, dst: int, dst_off: int, nbytes: int) -> None:
        self._guard("encode_copy")
        s, d = self._buffers[src], self._buffers[dst]
        assert src_off + nbytes <= s["len"] and dst_off + nbytes <= d["len"], "blit out of bounds"
        self._open.append(("blit", lambda: ctypes.memmove(d["host"] + dst_off, s["host"] + src_off, nbytes)))

    def commit(self) -> None:
        self._guard("commit")
        with self._cv:
            if self._open:
                self._queue.append(self._open)
                self._open = []
                self._cv.notify_all()

    def notify(self, event: int, value: int, word: int, wake: int) -> None:
        with self._cv:
            ev = self._events[event]
            ev["listeners"].append((value, word, wake))
            fire = self._due(ev)
        self._fire(fire)

    def mirror(self, event: int, word: int, value: int) -> None:
        with self._cv:
            self._mirrors.append((event, word, value))
            self._cv.notify_all()

    def buffer_info(self, buffer: int) -> tuple[int, int, int]:
        b = self._buffers[buffer]
        return (0 if b["mode"] == PRIVATE else b["host"]), b["len"], b["mode"]

    def wrap_host(self, addr: int, nbytes: int) -> int:
        h = next(self._ids)
        self._buffers[h] = {"mem": None, "host": addr, "len": nbytes, "mode": SHARED}
        return h

    def buffer_free(self, buffer: int) -> None:
        self._buffers.pop(buffer)

    # -- the "GPU" ----------------------------------------------------------------------------
    def _guard(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise ForeignThreadCommit(f"[fake-metal] {what} on thread {threading.current_thread().name}, "
                                      "not torch's: only the thread torch called us on may encode or commit")

    def _raise(self, event: int, value: int) -> None:
        with self._cv:
            ev = self._events[event]
            ev["value"] = max(ev["value"], value)
            fire = self._due(ev)
            self._cv.notify_all()
        self._fire(fire)

    @staticmethod
    def _due(ev: dict[str, Any]) -> list[tuple[int, int, int]]:
        due = [x for x in ev["listeners"] if x[0] <= ev["value"]]
        ev["listeners"] = [x for x in ev["listeners"] if x[0] > ev["value"]]
        return due

    @staticmethod
    def _fire(due: list[tuple[int, int, int]]) -> None:
        for value, word, wake in due:
            cell = ctypes.c_uint64.from_address(word)
            cell.value = max(cell.value, value)
            _WAKE(wake)(word)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                batch = self._queue[0]
            for label, cmd in batch:
                time.sleep(self._rnd.uniform(0, self._jitter))
                try:
                    cmd()
                except BaseException as exc:  # surfaces in synchronize()
                    self.errors.append(exc)
            with self._cv:
                self._queue.pop(0)
                self._cv.notify_all()

    def _mirror_loop(self) -> None:
        # Like the bridge's thread: sleeps while nothing is pending, looks every 200 us otherwise
        # (the engine's futex wake of a word cannot reach it).
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._mirrors or self._closed)
                if self._closed:
                    return
                keep = []
                for event, word, value in self._mirrors:
                    now = ctypes.c_uint64.from_address(word).value
                    if now >= value:
                        self._events[event]["value"] = max(self._events[event]["value"], now)
                        self._cv.notify_all()
                    else:
                        keep.append((event, word, value))
                self._mirrors = keep
                pending = bool(keep)
            if pending:
                time.sleep(0.0002)
