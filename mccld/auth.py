"""Mutual fleet-key authentication of a daemon-to-daemon link, and per-frame MACs.

Handshake (HMAC-SHA256, both sides prove the key, nonces from both sides so neither
a recorded exchange nor a reflected one authenticates):
  A -> B  hello      proto, fleet, host_id=A, listen=LA, nonce nA
  B -> A  challenge  proto, fleet, host_id=B, listen=LB, nonce nB,
                     mac_B = H(key, "resp", fleet, A, LA, B, LB, nA, nB)
  A -> B  auth       mac_A = H(key, "init", fleet, A, LA, B, LB, nA, nB)
  B -> A  ok
Afterwards every frame carries H(session, direction, seq, payload) with
session = H(key, "session", nA, nB), so frames cannot be injected, replayed or reordered.

The hello also names the socket's purpose, covered by both MACs: "control" (a link, as
above) or "data:<id>" (a data socket of the daemon's pool, mccld/datalinks.py, named
<id> on both sides). A data socket carries engine frames after the handshake; with MCCL_FRAME_MAC=1 the engine
tags each of them under keys ``Session.frame_keys`` derives per job and direction.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

from mccl_common.errors import AuthError, ProtocolError

from . import PROTO_VERSION

NONCE_BYTES = 32
MAC_BYTES = 32
MAX_FRAME = 1 << 20
_LEN = struct.Struct("!I")


def _mac(key: bytes, *parts: str | bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(_LEN.pack(len(b)) + b)  # length-prefixed: no ambiguity between field boundaries
    return h.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("link closed by peer")
        buf += chunk
    return bytes(buf)


def send_plain(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_plain(sock: socket.socket, peer: str) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ProtocolError(f"[link] handshake frame of {n} bytes from peer={peer}; not an mccld")
    try:
        msg = json.loads(_recv_exact(sock, n))
    except (ValueError, RecursionError):   # RecursionError: nested deeper than the parser goes
        raise ProtocolError(f"[link] handshake frame from peer={peer} is not JSON (or nests too deep); "
                            "not an mccld") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"[link] handshake frame from peer={peer} is not an object; not an mccld")
    return msg


class Session:
    """Per-link frame authentication after the handshake."""

    def __init__(self, key: bytes, nonce_a: bytes, nonce_b: bytes, initiator: bool, peer: str):
        self._key = _mac(key, "session", nonce_a, nonce_b)
        self._out_dir, self._in_dir = ("a2b", "b2a") if initiator else ("b2a", "a2b")
        self._send_seq = 0
        self._recv_seq = 0
        self.peer = peer

    def frame_keys(self, job: str) -> tuple[bytes, bytes]:
        """(send, receive) keys that seal the engine's frames (libmccl/csrc/integrity/aead.h)
        on this socket for ``job``: no two jobs or directions share one, so the engine's record
        numbers, which start at 0 for every job, never repeat a nonce under one key."""
        return _mac(self._key, "frames", self._out_dir, job), _mac(self._key, "frames", self._in_dir, job)

    def seal(self, msg: dict[str, Any]) -> bytes:
        body = json.dumps(msg, separators=(",", ":")).encode()
        tag = _mac(self._key, self._out_dir, str(self._send_seq), body)
        self._send_seq += 1
        return _LEN.pack(MAC_BYTES + len(body)) + tag + body

    def open(self, sock: socket.socket) -> dict[str, Any]:
        (n,) = _LEN.unpack(_recv_exact(sock, 4))
        if n < MAC_BYTES or n > MAX_FRAME:
            raise ProtocolError(f"[link] frame of {n} bytes from peer={self.peer} is malformed; "
                                "dropping the link (it will be redialled when needed)")
        raw = _recv_exact(sock, n)
        tag, body = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if not hmac.compare_digest(tag, _mac(self._key, self._in_dir, str(self._recv_seq), body)):
            raise AuthError(f"[link] frame from peer={self.peer} failed its MAC check (injected, "
                            "replayed or corrupted); dropping the link")
        self._recv_seq += 1
        try:
            msg = json.loads(body)
        except (ValueError, RecursionError):
            raise ProtocolError(f"[link] frame from peer={self.peer} is not JSON (or nests too deep)") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"[link] frame from peer={self.peer} has no message type")
        return msg


CONTROL = "control"


def initiate(sock: socket.socket, key: bytes, fleet: str, host_id: str, listen: str,
             peer: str, purpose: str = CONTROL) -> tuple[str, str, Session]:
    """Client side of the handshake; returns the peer's host id, its link address and the session."""
    na = secrets.token_bytes(NONCE_BYTES)
    send_plain(sock, {"type": "hello", "proto": PROTO_VERSION, "fleet": fleet, "host_id": host_id,
                      "listen": listen, "nonce": na.hex(), "purpose": purpose})
    msg = recv_plain(sock, peer)
    if msg.get("type") == "refused":
        raise AuthError(f"[link] peer={peer} refused our link: {msg.get('reason')}; check that both "
                        "hosts use the same MCCL_FLEET and fleet key")
    try:
        nb = bytes.fromhex(msg["nonce"])
        peer_host, their_mac = str(msg["host_id"]), bytes.fromhex(msg["mac"])
        peer_listen = str(msg["listen"])
    except (KeyError, ValueError, TypeError):
        raise ProtocolError(f"[link] malformed challenge from peer={peer}; not an mccld") from None
    if msg.get("proto") != PROTO_VERSION or msg.get("fleet") != fleet:
        raise AuthError(f"[link] peer={peer} speaks proto {msg.get('proto')} of fleet "
                        f"{msg.get('fleet')!r}, we speak {PROTO_VERSION} of {fleet!r}")
    if len(nb) != NONCE_BYTES or not hmac.compare_digest(
            their_mac, _mac(key, "resp", fleet, purpose, host_id, listen, peer_host, peer_listen, na, nb)):
        raise AuthError(f"[link] peer={peer} ({peer_host}) failed fleet-key authentication; "
                        "it does not hold our fleet key: copy the key file to it")
    send_plain(sock, {"type": "auth",
                      "mac": _mac(key, "init", fleet, purpose, host_id, listen, peer_host, peer_listen, na,
                                  nb).hex()})
    done = recv_plain(sock, peer)
    if done.get("type") != "ok":
        raise AuthError(f"[link] peer={peer} rejected our key: {done.get('reason')}; "
                        "the hosts hold different fleet keys")
    return peer_host, peer_listen, Session(key, na, nb, initiator=True, peer=peer)


def respond(sock: socket.socket, key: bytes, fleet: str, host_id: str, listen: str,
            peer: str) -> tuple[str, str, Session, str]:
    """Server side of the handshake; refuses (and raises AuthError) on any mismatch.
    Returns the peer's host id, its link address, the session and the purpose it named."""
    msg = recv_plain(sock, peer)
    try:
        na, peer_host, peer_listen = bytes.fromhex(msg["nonce"]), str(msg["host_id"]), str(msg["listen"])
        purpose = str(msg.get("purpose", CONTROL))
        if msg.get("type") != "hello" or len(na) != NONCE_BYTES or len(purpose) > 200:
            raise ValueError
    except (KeyError, ValueError, TypeError):
        raise ProtocolError(f"[link] malformed hello from peer={peer}; not an mccld") from None
    if msg.get("proto") != PROTO_VERSION or msg.get("fleet") != fleet:
        send_plain(sock, {"type": "refused", "reason": f"fleet/proto mismatch (we are {fleet!r}/{PROTO_VERSION})"})
        raise AuthError(f"[link] refused peer={peer} ({peer_host}): fleet {msg.get('fleet')!r} proto "
                        f"{msg.get('proto')}, we are fleet {fleet!r} proto {PROTO_VERSION}")
    nb = secrets.token_bytes(NONCE_BYTES)
    send_plain(sock, {"type": "challenge", "proto": PROTO_VERSION, "fleet": fleet, "host_id": host_id,
                      "listen": listen, "nonce": nb.hex(),
                      "mac": _mac(key, "resp", fleet, purpose, peer_host, peer_listen, host_id, listen, na,
                                  nb).hex()})
    reply = recv_plain(sock, peer)
    try:
        their_mac = bytes.fromhex(reply["mac"])
    except (KeyError, ValueError, TypeError):
        their_mac = b""
    if not hmac.compare_digest(their_mac, _mac(key, "init", fleet, purpose, peer_host, peer_listen, host_id, listen,
                                               na, nb)):
        send_plain(sock, {"type": "refused", "reason": "bad fleet key"})
        raise AuthError(f"[link] refused peer={peer} ({peer_host}): it failed fleet-key authentication; "
                        "it does not hold this fleet's key")
    send_plain(sock, {"type": "ok"})
    return peer_host, peer_listen, Session(key, na, nb, initiator=False, peer=peer), purpose
