"""mccld's end of the descriptor hand-over (mccl_common/fd_handover.py).

One thread accepts connections on ``mccld.fds``; each carries one segment's name and its
descriptor. The sender is checked before anything is read (the kernel's uid: mccld's user,
root or MCCL_ATTACH_GROUP), and on Linux the memory must be sealed against shrinking. What passes waits here until the same
process registers that name over the attach socket (``take``): a descriptor is bound to the
uid and pid the kernel reported for its sender, and only a connection with the same
credentials gets it.

Bounds: one frame per connection, read within a deadline; at most MAX_HELD descriptors held
(MAX_HELD_PER_USER of one user's), each for at most HOLD_S (a client that hands over and never
registers loses it).
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import stat
import threading
import time
from pathlib import Path

from mccl_common import attach_protocol as protocol
from mccl_common import fd_handover, localtrust, shm
from mccl_common.errors import AuthError, MCCLError, ProtocolError

from .logutil import OnceLogger

log = logging.getLogger(__name__)

MAX_HELD = 1024
MAX_HELD_PER_USER = 128   # so one user's flood cannot fill the inbox for the others
HOLD_S = 120.0
_CONN_DEADLINE_S = 2.0


def _same_sender(creds: localtrust.PeerCreds | None, sender: localtrust.PeerCreds) -> bool:
    """Whether the attach connection's ``creds`` (None: unknown here) are the process that
    handed the descriptor over: same uid, and same pid where both are known."""
    return creds is None or (creds.uid == sender.uid and not (creds.pid and sender.pid and creds.pid != sender.pid))


class FdInbox:
    def __init__(self, runtime_dir: Path, group: int | None):
        self.path = runtime_dir / protocol.HANDOVER_NAME
        self._group = group
        self._held: dict[str, tuple[int, localtrust.PeerCreds, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._once = OnceLogger(log)

    def start(self) -> "FdInbox":
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()   # a dead daemon's (the caller holds the runtime dir's lock)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.path))
        if self._group is not None:
            os.chown(self.path, -1, self._group)
            os.chmod(self.path, 0o660)
        s.listen(64)
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="mccld-fd-inbox", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        with self._lock:
            held, self._held = self._held, {}
        for fd, _, _ in held.values():
            os.close(fd)

    def take(self, name: str, creds: localtrust.PeerCreds | None) -> int:
        """The descriptor handed over as ``name`` by the process with ``creds`` (the attach
        connection's); the caller owns it. ProtocolError if there is none for that sender."""
        with self._lock:
            entry = self._held.pop(name, None)
        if entry is None:
            raise ProtocolError(f"[daemon] field 'segment'={name} names no segment handed over on {self.path} "
                                f"(or it was more than {HOLD_S:.0f}s ago); the client hands over each segment's "
                                "descriptor before registering it: client and daemon releases differ?")
        fd, sender, _ = entry
        if not _same_sender(creds, sender):
            os.close(fd)
            raise AuthError(f"[daemon] segment {name} was handed over by pid {sender.pid} "
                            f"({localtrust.owner_name(sender.uid)}), but registered by pid {creds.pid} "
                            f"({localtrust.owner_name(creds.uid)}); a client registers only its own segments")
        return fd

    def discard(self, name: str, creds: localtrust.PeerCreds | None) -> bool:
        """Close the descriptor held as ``name`` for the process with ``creds``, which dropped
        that segment before registering it (else it would sit under the user's cap for HOLD_S).
        False if none is held for that sender."""
        with self._lock:
            entry = self._held.get(name)
            if entry is None or not _same_sender(creds, entry[1]):
                return False
            del self._held[name]
        os.close(entry[0])
        return True

    # -- the inbox thread -------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], 0.2)
            if not ready:
                self._expire()
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                self._once.warn("accept", "[daemon] fd inbox %s: accept failed: %s", self.path, e)
                continue
            try:
                self._receive(conn)
            except MCCLError as e:
                self._once.warn(f"bad:{type(e).__name__}", "%s", e)
                self._reply(conn, {"ok": False, "error": protocol.error_payload(e)})
            except OSError as e:
                self._once.warn("io", "[daemon] fd inbox %s: a client's hand-over failed: %s", self.path, e)
            finally:
                conn.close()

    def _receive(self, conn: socket.socket) -> None:
        creds = localtrust.socket_peer_creds(conn)
        if not localtrust.uid_allowed(creds, self._group):
            raise AuthError(f"[daemon] refused a segment from {localtrust.owner_name(creds.uid)} (pid {creds.pid}): "
                            "neither mccld's user nor in MCCL_ATTACH_GROUP")
        deadline = time.monotonic() + _CONN_DEADLINE_S
        conn.settimeout(_CONN_DEADLINE_S)
        fds = array.array("i")
        data, ancdata, _flags, _addr = conn.recvmsg(fd_handover.MAX_FRAME + 2, socket.CMSG_SPACE(fds.itemsize))
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(cdata[:len(cdata) - (len(cdata) % fds.itemsize)])
        try:
            if len(fds) != 1:
                raise ProtocolError(f"[daemon] fd hand-over with {len(fds)} descriptors, expected 1")
            msg = fd_handover.read_frame(conn, data, deadline)
            name = msg.get("segment")
            if not isinstance(name, str) or not protocol.SEGMENT_RE.match(name):
                raise ProtocolError(f"[daemon] fd hand-over names no segment ({str(name)[:80]!r})")
            if not stat.S_ISREG(os.fstat(fds[0]).st_mode):
                raise ProtocolError(f"[daemon] segment {name} handed over as something other than memory")
            shm.check_sealed(fds[0], name)   # refused at once, not when a job first maps it
            self._hold(name, fds[0], creds)
            fds = array.array("i")
        finally:
            for fd in fds:
                os.close(fd)
        self._reply(conn, {"ok": True})

    def _hold(self, name: str, fd: int, creds: localtrust.PeerCreds) -> None:
        self._expire()
        with self._lock:
            if len(self._held) >= MAX_HELD:
                raise ProtocolError(f"[daemon] already {MAX_HELD} segments handed over and not registered; a "
                                    "client hands over without registering: refused")
            if sum(c.uid == creds.uid for _, c, _ in self._held.values()) >= MAX_HELD_PER_USER:
                raise ProtocolError(f"[daemon] {localtrust.owner_name(creds.uid)} already handed over "
                                    f"{MAX_HELD_PER_USER} segments it did not register: refused; its clients leak "
                                    "them (or hand over without registering)")
            old = self._held.pop(name, None)
            self._held[name] = (fd, creds, time.monotonic())
        if old is not None:
            os.close(old[0])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [n for n, (_, _, t) in self._held.items() if now - t > HOLD_S]
            gone = [self._held.pop(n)[0] for n in stale]
        for fd in gone:
            os.close(fd)

    @staticmethod
    def _reply(conn: socket.socket, msg: dict) -> None:
        try:
            conn.sendall(fd_handover.encode(msg))
        except OSError:
            pass   # the client went; it learns nothing it needs

