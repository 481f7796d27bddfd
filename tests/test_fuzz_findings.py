"""Bugs the fuzzer (scripts/fuzz) found, each pinned by a direct test of the code that had it."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from libmccl.errors import ProtocolError
from mccld import auth, status_protocol

DEEP = b"[" * 20_000 + b"]" * 20_000        # deeper than json can parse, small enough for a socketpair


@pytest.mark.timeout(30)
def test_deeply_nested_link_handshake_frame_is_a_protocol_error():
    """Found on the link port: the RecursionError escaped the handshake thread, which died
    without closing the socket, so each such unauthenticated connection held an fd and
    was never answered."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", len(DEEP)) + DEEP)
        with pytest.raises(ProtocolError, match="nests too deep"):
            auth.recv_plain(b, "fuzzer")


@pytest.mark.timeout(30)
def test_deeply_nested_link_frame_after_the_handshake_is_a_protocol_error():
    """The same in a sealed frame: the link's reader thread died and the link stayed listed."""
    sender = auth.Session(b"k" * 32, b"a" * 32, b"b" * 32, initiator=True, peer="x")
    receiver = auth.Session(b"k" * 32, b"a" * 32, b"b" * 32, initiator=False, peer="fuzzer")
    frame = bytearray(sender.seal({"type": "x"}))
    body = b'{"type": "x", "deep": ' + DEEP + b"}"
    tag = auth._mac(sender._key, "a2b", "1", body)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(bytes(frame) + struct.pack("!I", auth.MAC_BYTES + len(body)) + tag + body)
        assert receiver.open(b) == {"type": "x"}
        with pytest.raises(ProtocolError, match="nests too deep"):
            receiver.open(b)


@pytest.mark.timeout(30)
def test_deeply_nested_status_request_is_a_protocol_error():
    """On the status endpoint the RecursionError reached the catch-all and was logged as an
    unexpected failure with a traceback, for every such request."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(DEEP + b"\n")
        with pytest.raises(ProtocolError, match="not a JSON object"):
            status_protocol.Conn(b, "fuzzer").recv("request")
