"""A hand-written end of the engine's keyed link handshake (libmccl/csrc/transport/handshake.h),
for tests that play a stranger, a fake peer or an attacker on loopback. HMAC-SHA256 is Python's
hmac (OpenSSL); frame keys are not derived here, so a fake peer can only talk frames with
MCCL_WIRE_SECURITY=off or send garbage."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

MAGIC = 0x4C43434D
VERSION = 3
HELLO = struct.Struct("<IIQIIIII16sI32s")   # 88 bytes
REPLY = struct.Struct("<III32s")            # 44 bytes, then the reason
PROOF = struct.Struct("<I32s")
DIAL_LABEL = b"mccl link v3 dialer proof\0"
ACCEPT_LABEL = b"mccl link v3 acceptor proof\0"
MODES = {"off": 0, "mac": 1, "aead": 2}


def hello(comm_id: int, frm: int, to: int, world: int, idx: int = 0, k: int = 2, terms: bytes = bytes(16),
          mode: str = "aead", nonce: bytes | None = None, version: int = VERSION) -> bytes:
    return HELLO.pack(MAGIC, version, comm_id, frm, to, world, idx, k, terms, MODES[mode],
                      nonce if nonce is not None else os.urandom(32))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def recv_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything the peer sends until it closes (or `timeout` passes quietly)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def dialer_proof(secret: bytes, hello_bytes: bytes, nonce_a: bytes) -> bytes:
    return hmac.new(secret, DIAL_LABEL + hello_bytes + nonce_a, hashlib.sha256).digest()


def acceptor_proof(secret: bytes, hello_bytes: bytes, nonce_a: bytes, status: int, reason: bytes) -> bytes:
    return hmac.new(secret, ACCEPT_LABEL + hello_bytes + nonce_a + struct.pack("<II", status, len(reason)) + reason,
                    hashlib.sha256).digest()


def accept(conn: socket.socket, secret: bytes | None, timeout: float = 10.0) -> tuple:
    """Play the acceptor on `conn`: check the dialer's proof and answer ok with our own.
    Returns the dialer's hello fields."""
    conn.settimeout(timeout)
    h = recv_exact(conn, HELLO.size)
    fields = HELLO.unpack(h)
    assert fields[0] == MAGIC and fields[1] == VERSION, fields[:2]
    nonce_a = os.urandom(32)
    conn.sendall(REPLY.pack(MAGIC, 0, 0, nonce_a))
    magic, proof = PROOF.unpack(recv_exact(conn, PROOF.size))
    if secret is not None:
        assert hmac.compare_digest(proof, dialer_proof(secret, h, nonce_a)), "the dialer's proof is wrong"
    tag = acceptor_proof(secret, h, nonce_a, 0, b"") if secret is not None else bytes(32)
    conn.sendall(REPLY.pack(MAGIC, 0, 0, tag))
    return fields
