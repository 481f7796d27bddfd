"""Handing a segment's descriptor to mccld: a Unix socket beside the attach socket.

ZeroMQ's ipc:// transport cannot carry file descriptors, and mccld must never open a client's
memory by name (anyone who can open the name could read it, or truncate it under mccld). So
for each segment (data segment, shared buffer, small-op queue) the client makes one short
connection to ``mccld.fds`` in the runtime dir and sends one message, the segment's name,
with the descriptor attached (SCM_RIGHTS). mccld answers with one line of JSON and keeps the
descriptor until the client registers that name over the attach socket (mccld/fd_inbox.py).

Both ends check the other with the kernel's credentials first: the client that the socket's
listener is the daemon's user (before it sends anything), mccld that the sender may attach
(its user, root, MCCL_ATTACH_GROUP); the descriptor then goes only to a register from a
connection with the sender's own uid and pid, so one client can neither take another's memory
nor slip its own under another's registration.

Frame: 2-byte big-endian length, then that many bytes of JSON ``{"segment": name}``; the
reply likewise, ``{"ok": true}`` or ``{"ok": false, "error": {...}}``.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

from . import attach_protocol as protocol
from . import localtrust
from .errors import AuthError, DaemonUnavailableError, ProtocolError

MAX_FRAME = 1024
TIMEOUT_S = 5.0


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg).encode()
    return struct.pack(">H", len(body)) + body


def read_frame(sock: socket.socket, first: bytes, deadline: float) -> dict[str, Any]:
    """One frame whose first bytes (``first``) were read already; bounded by MAX_FRAME and
    ``deadline``."""
    buf = bytearray(first)
    while len(buf) < 2 or len(buf) < 2 + struct.unpack(">H", bytes(buf[:2]))[0]:
        if len(buf) >= 2 and struct.unpack(">H", bytes(buf[:2]))[0] > MAX_FRAME:
            raise ProtocolError(f"[fd-handover] frame of {struct.unpack('>H', bytes(buf[:2]))[0]} bytes, at most "
                                f"{MAX_FRAME}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"[fd-handover] Timed out after {TIMEOUT_S:.0f}s reading a frame")
        sock.settimeout(left)
        chunk = sock.recv(MAX_FRAME + 2 - len(buf))
        if not chunk and not buf:
            # Nothing of a frame at all: the other end went away (a killed mccld, for the
            # client), which is not a malformed message.
            raise ConnectionResetError("closed before the first byte of a frame")
        if not chunk:
            raise ProtocolError("[fd-handover] connection closed inside a frame")
        buf += chunk
    n = struct.unpack(">H", bytes(buf[:2]))[0]
    if len(buf) != 2 + n:
        raise ProtocolError("[fd-handover] bytes after the frame; one frame per connection")
    try:
        msg = json.loads(bytes(buf[2:]))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("[fd-handover] frame is not JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("[fd-handover] frame is not a JSON object")
    return msg


def hand_over(rdir: Path, name: str, fd: int, daemon_uid: int, timeout_s: float = TIMEOUT_S) -> None:
    """Give mccld serving ``rdir`` (running as ``daemon_uid``) the descriptor of segment ``name``,
    waiting at most ``timeout_s`` for its answer."""
    path = rdir / protocol.HANDOVER_NAME
    deadline = time.monotonic() + timeout_s
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
        except OSError as e:
            raise DaemonUnavailableError(f"[daemon-client] cannot hand segment {name} to mccld at {path} "
                                         f"({e.strerror or e}); mccld stopped, or is older than this client") from None
        uid = localtrust.socket_peer_creds(s).uid
        if uid != daemon_uid:
            raise AuthError(f"[daemon-client] the process listening on {path} runs as {localtrust.owner_name(uid)}, "
                            f"not as {localtrust.owner_name(daemon_uid)}; another local user may be impersonating "
                            "mccld. Segment not handed over; stop that process and restart mccld")
        socket.send_fds(s, [encode({"segment": name})], [fd])
        reply = read_frame(s, b"", deadline)
    except (socket.timeout, TimeoutError):
        raise DaemonUnavailableError(f"[daemon-client] Timed out after {timeout_s:.0f}s handing segment {name} to "
                                     f"mccld at {path}; it is wedged or overloaded") from None
    except ConnectionError as e:
        raise DaemonUnavailableError(f"[daemon-client] mccld at {path} closed the connection while segment {name} "
                                     f"was handed over ({e.strerror or e}); it crashed or was stopped") from None
    finally:
        s.close()
    if not reply.get("ok"):
        raise protocol.error_from_payload(reply.get("error") or {})
