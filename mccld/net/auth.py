"""Mutual fleet-key authentication of a daemon-to-daemon link, and its encrypted frames.

Handshake (HMAC-SHA256, both sides prove the key, nonces from both sides so neither
a recorded exchange nor a reflected one authenticates). The initiator proves first: a
stranger that connects gets a nonce and nothing computed under the key, so it cannot
collect MACs to guess the key offline; the responder proves only to a peer that has
just proven it holds the key:
  A -> B  hello      proto, fleet, host_id=A, listen=LA, nonce nA
  B -> A  challenge  proto, fleet, host_id=B, listen=LB, nonce nB      (no MAC)
  A -> B  auth       mac_A = H(key, "init", fleet, A, LA, B, LB, nA, nB)
  B -> A  ok         mac_B = H(key, "resp", fleet, A, LA, B, LB, nA, nB)
Both MACs cover every field either side acts on (host ids, listen addresses, purpose),
so none can be changed on the way. A daemon refuses a peer that claims its own host id
(a reflected connection, or a misconfigured twin) and a key under 32 bytes.
Afterwards every frame is AES-256-GCM under H(session, "aead", direction) with
session = H(key, "session", nA, nB): a key of this link and direction alone (both nonces are
fresh), the frame's number in its direction as the GCM nonce, and the protocol version and
direction as associated data. So what daemons tell each other (job names, hosts, leases) is
unreadable on the path, and no frame can be injected, replayed, reordered or altered.

The hello also names the socket's purpose, covered by both MACs: "control" (a link, as
above) or "data:<id>" (a data socket of the daemon's pool, mccld/net/datalinks.py, named
<id> on both sides). A data socket carries engine frames after the handshake; the engine opens every job on it
with its own challenge-response on a per-job secret and derives fresh frame keys from both sides' nonces
(libmccl/csrc/transport/handshake.h), so no key depends on this session or repeats across jobs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

from mccl_common import aead
from mccl_common.daemon_settings import MIN_KEY_BYTES
from mccl_common.errors import AuthError, ConfigError, ProtocolError

from .. import PROTO_VERSION

NONCE_BYTES = 32
MAC_BYTES = 32
MAX_FRAME = 1 << 20
# A handshake frame is a few hundred bytes; before the peer proved the key it gets no more.
MAX_HANDSHAKE_FRAME = 16 << 10
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
    if n > MAX_HANDSHAKE_FRAME:
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
    """A link's frames after the handshake: each one encrypted and authenticated (AES-256-GCM,
    mccl_common.aead) under a key of this link and direction alone, numbered by the Box, so
    nobody on the path reads, injects, replays, reorders or alters one."""

    def __init__(self, key: bytes, nonce_a: bytes, nonce_b: bytes, initiator: bool, peer: str):
        session = _mac(key, "session", nonce_a, nonce_b)
        out_dir, in_dir = ("a2b", "b2a") if initiator else ("b2a", "a2b")
        self._out = aead.Box(_mac(session, "aead", out_dir))
        self._in = aead.Box(_mac(session, "aead", in_dir))
        self._out_aad = _aad(out_dir)
        self._in_aad = _aad(in_dir)
        self.peer = peer

    def seal(self, msg: dict[str, Any]) -> bytes:
        return self.seal_raw(json.dumps(msg, separators=(",", ":")).encode())

    def seal_raw(self, body: bytes) -> bytes:
        """The frame of the next message with these exact bytes (fuzzers and tests send bodies
        that ``seal`` would never produce)."""
        _, box = self._out.seal(body, self._out_aad)
        return _LEN.pack(len(box)) + box

    def open(self, sock: socket.socket) -> dict[str, Any]:
        (n,) = _LEN.unpack(_recv_exact(sock, 4))
        if n < aead.TAG_BYTES or n > MAX_FRAME:
            raise ProtocolError(f"[link] frame of {n} bytes from peer={self.peer} is malformed; "
                                "dropping the link (it will be redialled when needed)")
        body = self._in.open(_recv_exact(sock, n), self._in_aad)
        if body is None:
            raise AuthError(f"[link] frame from peer={self.peer} failed its authentication (injected, "
                            "replayed, reordered or corrupted on the path); dropping the link")
        try:
            msg = json.loads(body)
        except (ValueError, RecursionError):
            raise ProtocolError(f"[link] frame from peer={self.peer} is not JSON (or nests too deep)") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"[link] frame from peer={self.peer} has no message type")
        return msg


def _aad(direction: str) -> bytes:
    return f"mccl-link/{PROTO_VERSION}/{direction}".encode()


CONTROL = "control"


def _check_key(key: bytes) -> None:
    # The key is read and checked by DaemonConfig.read_key; this catches an embedder (or a
    # test) handing a weak one straight to the handshake, where it would be brute-forced.
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"[link] fleet key of {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
                          "(`mccld keygen` writes one) in MCCL_KEY_FILE")


def _hex(msg: dict[str, Any], field: str, n: int) -> bytes:
    """``n`` bytes from a hex field; ValueError for anything else (non-ASCII text included)."""
    raw = msg.get(field)
    if not isinstance(raw, str) or len(raw) != 2 * n or not raw.isascii():
        raise ValueError(field)
    return bytes.fromhex(raw)


class ClosedBeforeAnswer(ConnectionError):
    """The peer closed or reset our connection before its first answer: its port's gate made
    room for newer connections (a flood, mccld/net/gate.py) or it is stopping. Unlike a drop
    after our proof (another fleet key), dialing again may succeed."""


def initiate(sock: socket.socket, key: bytes, fleet: str, host_id: str, listen: str,
             peer: str, purpose: str = CONTROL) -> tuple[str, str, Session]:
    """Client side of the handshake; returns the peer's host id, its link address and the session.
    Raises ClosedBeforeAnswer when the peer hung up before answering our hello."""
    _check_key(key)
    na = secrets.token_bytes(NONCE_BYTES)
    try:
        send_plain(sock, {"type": "hello", "proto": PROTO_VERSION, "fleet": fleet, "host_id": host_id,
                          "listen": listen, "nonce": na.hex(), "purpose": purpose})
        msg = recv_plain(sock, peer)
    except ClosedBeforeAnswer:
        raise
    except ConnectionError as e:     # EOF, reset, broken pipe: not a timeout
        raise ClosedBeforeAnswer(str(e)) from None
    if msg.get("type") == "refused":
        raise AuthError(f"[link] peer={peer} refused our link: {str(msg.get('reason'))[:200]}; check that both "
                        "hosts use the same MCCL_FLEET and fleet key")
    try:
        if msg.get("type") != "challenge":
            raise ValueError("type")
        nb = _hex(msg, "nonce", NONCE_BYTES)
        peer_host, peer_listen = msg["host_id"], msg["listen"]
        if not isinstance(peer_host, str) or not isinstance(peer_listen, str):
            raise ValueError("host_id")
    except (KeyError, ValueError, TypeError):
        raise ProtocolError(f"[link] malformed challenge from peer={peer}; not an mccld") from None
    if msg.get("proto") != PROTO_VERSION or msg.get("fleet") != fleet:
        raise AuthError(f"[link] peer={peer} speaks proto {msg.get('proto')} of fleet "
                        f"{msg.get('fleet')!r}, we speak {PROTO_VERSION} of {fleet!r}")
    if peer_host == host_id:
        raise AuthError(f"[link] peer={peer} claims our own host id {host_id!r}; we dialled ourselves, or two "
                        "hosts share an MCCL_HOST_ID: give each host its own")
    send_plain(sock, {"type": "auth",
                      "mac": _mac(key, "init", fleet, purpose, host_id, listen, peer_host, peer_listen, na,
                                  nb).hex()})
    done = recv_plain(sock, peer)
    if done.get("type") == "refused":
        raise AuthError(f"[link] peer={peer} ({peer_host}) refused our link: we failed fleet-key "
                        "authentication there; the hosts hold different fleet keys")
    try:
        if done.get("type") != "ok":
            raise ValueError("type")
        their_mac = _hex(done, "mac", MAC_BYTES)
    except ValueError:
        raise ProtocolError(f"[link] malformed handshake answer from peer={peer}; not an mccld") from None
    if not hmac.compare_digest(their_mac, _mac(key, "resp", fleet, purpose, host_id, listen, peer_host,
                                               peer_listen, na, nb)):
        raise AuthError(f"[link] peer={peer} ({peer_host}) failed fleet-key authentication; "
                        "it does not hold our fleet key: copy the key file to it")
    return peer_host, peer_listen, Session(key, na, nb, initiator=True, peer=peer)


def respond(sock: socket.socket, key: bytes, fleet: str, host_id: str, listen: str,
            peer: str) -> tuple[str, str, Session, str]:
    """Server side of the handshake; refuses (and raises AuthError) on any mismatch.
    Returns the peer's host id, its link address, the session and the purpose it named.
    Nothing it sends before the peer proved the key depends on the key."""
    _check_key(key)
    msg = recv_plain(sock, peer)
    try:
        na = _hex(msg, "nonce", NONCE_BYTES)
        peer_host, peer_listen, purpose = msg["host_id"], msg["listen"], msg.get("purpose", CONTROL)
        if (msg.get("type") != "hello" or not all(isinstance(x, str) for x in (peer_host, peer_listen, purpose))
                or len(purpose) > 200 or len(peer_host) > 256 or len(peer_listen) > 64):
            raise ValueError
    except (KeyError, ValueError, TypeError):
        raise ProtocolError(f"[link] malformed hello from peer={peer}; not an mccld") from None
    if msg.get("proto") != PROTO_VERSION or msg.get("fleet") != fleet:
        send_plain(sock, {"type": "refused", "reason": f"fleet/proto mismatch (we are {fleet!r}/{PROTO_VERSION})"})
        raise AuthError(f"[link] refused peer={peer} ({peer_host!r}): fleet {str(msg.get('fleet'))[:64]!r} proto "
                        f"{str(msg.get('proto'))[:16]}, we are fleet {fleet!r} proto {PROTO_VERSION}")
    if peer_host == host_id:
        send_plain(sock, {"type": "refused", "reason": "you claim this daemon's own host id"})
        raise AuthError(f"[link] refused peer={peer}: it claims our own host id {host_id!r}; a reflected "
                        "connection, or two hosts share an MCCL_HOST_ID: give each host its own")
    nb = secrets.token_bytes(NONCE_BYTES)
    send_plain(sock, {"type": "challenge", "proto": PROTO_VERSION, "fleet": fleet, "host_id": host_id,
                      "listen": listen, "nonce": nb.hex()})
    reply = recv_plain(sock, peer)
    try:
        their_mac = _hex(reply, "mac", MAC_BYTES) if reply.get("type") == "auth" else b""
    except ValueError:
        their_mac = b""
    if not hmac.compare_digest(their_mac, _mac(key, "init", fleet, purpose, peer_host, peer_listen, host_id, listen,
                                               na, nb)):
        send_plain(sock, {"type": "refused", "reason": "bad fleet key"})
        raise AuthError(f"[link] refused peer={peer} ({peer_host!r}): it failed fleet-key authentication; "
                        "it does not hold this fleet's key")
    send_plain(sock, {"type": "ok", "mac": _mac(key, "resp", fleet, purpose, peer_host, peer_listen, host_id,
                                                listen, na, nb).hex()})
    return peer_host, peer_listen, Session(key, na, nb, initiator=False, peer=peer), purpose
