"""What every fuzzed surface shares: the input record, the surface interface, and the TCP
exchange that decides whether the daemon answered.

An ``Input`` is what a corpus file stores: the surface, a stage (how the harness
delivers it: before or after a handshake, as a raw frame, ...) and its frames. A surface
turns captured real messages into a hypothesis strategy of Inputs, sends each one, and
says whether it was answered: a reply came, or the daemon closed the connection. On the
TCP surfaces the fuzzer half-closes after its last byte, so a daemon that waits for
more than it got sees EOF at once; one that neither answers nor closes within
``ANSWER_TIMEOUT_S`` left the request unanswered.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from .target import Daemon

ANSWER_TIMEOUT_S = 8.0          # link timeout (2 s) + a loaded 2-core machine's slack


@dataclass
class Input:
    surface: str
    stage: str
    frames: list[bytes]
    note: str = ""               # why a corpus input is there (what it found)

    def to_json(self) -> dict[str, Any]:
        return {"surface": self.surface, "stage": self.stage, "note": self.note,
                "frames": [base64.b64encode(f).decode() for f in self.frames]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Input":
        return cls(d["surface"], d["stage"], [base64.b64decode(f) for f in d["frames"]], d.get("note", ""))


@dataclass
class Verdict:
    answered: bool
    counted: bool = True         # False: a notification, which has no answer to wait for
    detail: str = ""


@dataclass
class Surface:
    """One input surface; subclasses fill in ``capture``, ``strategy`` and ``send``."""

    daemon: Daemon
    seeds: dict[str, list[Any]] = field(default_factory=dict)
    name = ""

    def capture(self) -> None:
        """Record real messages of a real client or peer as ``seeds`` (stage -> messages)."""
        raise NotImplementedError

    def strategy(self) -> st.SearchStrategy[Input]:
        raise NotImplementedError

    def send(self, inp: Input) -> Verdict:
        raise NotImplementedError

    def begin_batch(self) -> None:
        """Set up what a batch's inputs share (a connection, a job); the daemon is up."""

    def end_batch(self) -> int:
        """Tear the batch down; returns the requests that never got an answer."""
        return 0

    def save_seeds(self) -> dict[str, Any]:
        return {stage: msgs[:4] for stage, msgs in self.seeds.items()}


def connect(addr: str, timeout_s: float = 5.0) -> socket.socket:
    host, _, port = addr.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def drain_until_closed(sock: socket.socket, timeout_s: float = ANSWER_TIMEOUT_S) -> tuple[bool, bytes]:
    """Read until the daemon closes (True) or ``timeout_s`` passes (False); returns what came."""
    deadline = time.monotonic() + timeout_s
    got = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, bytes(got)
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return False, bytes(got)
        except OSError:         # reset: closed too
            return True, bytes(got)
        if not chunk:
            return True, bytes(got)
        if len(got) < (1 << 20):
            got += chunk


def send_and_close(sock: socket.socket, data: bytes, timeout_s: float = ANSWER_TIMEOUT_S) -> Verdict:
    """Send ``data``, half-close, and wait up to ``timeout_s`` for the daemon to close its end."""
    try:
        if data:
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return Verdict(True, detail="closed while we sent")   # the daemon hung up: an answer too
    try:
        closed, _ = drain_until_closed(sock, timeout_s)
        return Verdict(closed, detail="" if closed else "connection neither answered nor closed")
    finally:
        sock.close()


def json_line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode("utf-8", "surrogatepass") + b"\n"
