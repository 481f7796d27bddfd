"""Device gates for ``MCCL_DAEMON=1``: hold a rank's later ops until a device raised a ticket.

A device tensor's op is launched before the device has written its input (issue 10's O1:
the stream raises the op's ``ready`` ticket after the copies or kernels that write it).
In process, the engine's own queue holds a gate (``Communicator.gate``). Through mccld the
client's queue does: a ``Gate`` sits in it like an op, and nothing behind it starts, not
even the copy into the shared segment, until ``ready`` holds the target. The wait itself
runs on one ``GateWatcher`` thread per communicator, started at the first gate that is not
already open, so the client's I/O thread keeps serving the daemon's replies meanwhile; the
watcher sleeps on the ticket word (a device's host callback wakes it, libmccl/csrc/core/ticket.h)
and wakes the I/O thread when the gate opens, is poisoned or runs out of time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mccl_common.errors import AbortedError, CollectiveTimeout, ConfigError, MCCLError

# The watcher re-checks whether it was stopped or handed another gate this often; a
# ticket written by a CPU wakes it at once, so this only bounds how long a stop waits.
_SLICE_S = 0.1
_JOIN_S = 5.0


@dataclass
class Gate:
    """Ops queued after this one wait until ``ready`` >= ``target``."""
    ready: Any                    # a _core.Ticket
    target: int
    deadline: float = 0.0         # set when the gate reaches the head of the queue
    error: MCCLError | None = None

    def __post_init__(self) -> None:
        if self.ready is None or not hasattr(self.ready, "wait_for"):
            raise ConfigError(f"[daemon-client] a device gate needs a ticket, got {type(self.ready).__name__}")

    def open(self) -> bool:
        """Reached (True), or still closed (False); a poisoned ticket records its error and counts as open."""
        value = self.ready.value
        if value == self.ready.POISON and self.error is None:
            self.error = AbortedError("[daemon-client] device gate: the op's ready ticket was poisoned "
                                      "(its device work was abandoned); the ops behind it cannot run")
        return value >= self.target


class GateWatcher:
    """One thread that waits on the gate at the head of a client's queue and calls ``wake``
    when it opens, is poisoned or its deadline passes; ``wake`` must not block."""

    def __init__(self, name: str, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._name = name
        self._cv = threading.Condition()
        self._gate: Gate | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def watch(self, gate: Gate) -> None:
        """Wait on ``gate`` (replacing any gate watched before: the queue moved on)."""
        with self._cv:
            if self._stopped:
                return
            self._gate = gate
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._gate = None
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._gate is None and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                gate = self._gate
            if self._wait(gate):
                with self._cv:
                    if self._gate is gate:
                        self._gate = None
                self._wake()

    def _wait(self, gate: Gate) -> bool:
        """True once the I/O thread has something to do about ``gate``; False if we were
        stopped or handed another gate first."""
        while True:
            with self._cv:
                if self._stopped or self._gate is not gate:
                    return False
            left = gate.deadline - time.monotonic()
            if left <= 0:
                return True       # the I/O thread turns the overdue gate into the timeout
            try:
                if gate.ready.wait_for(gate.target, min(_SLICE_S, left), "[daemon-client] device gate"):
                    return True
            except AbortedError:
                return True       # poisoned: Gate.open() records why


def gate_timeout(gate: Gate, rank: int, timeout_s: float) -> CollectiveTimeout:
    return CollectiveTimeout(
        f"[daemon-client] Timed out after {timeout_s:.0f}s on rank {rank} waiting for a device gate: the device "
        f"never raised the op's ready ticket (value {gate.ready.value:#x}, target {gate.target:#x}); the stream "
        "that writes the tensor is stuck or its work was never committed")
