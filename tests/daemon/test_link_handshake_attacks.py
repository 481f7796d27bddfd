"""Attacks on mccld's link handshake (issue 24, item 6), each by a client on loopback:
a stranger must learn nothing computed under the fleet key before it proved the key, a key
under 32 bytes never gets used, and a daemon refuses a peer claiming its own host id."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from mccl_common.daemon_settings import load_config
from mccl_common.errors import AuthError, ConfigError
from mccld import PROTO_VERSION
from mccld.net import auth
from mccld.net.links import LinkManager

KEY = b"handshake-test-fleet-key-" + b"h" * 16
FLEET = "hs"


class Peer:
    def __init__(self, host_id: str, key: bytes = KEY):
        self.links = LinkManager(key, FLEET, host_id, "127.0.0.1", 0, 5.0, lambda peer, msg: None)

    def __enter__(self) -> "Peer":
        self.links.start()
        return self

    def __exit__(self, *exc) -> None:
        self.links.stop()


def _frame(msg: dict) -> bytes:
    body = json.dumps(msg).encode()
    return struct.pack("!I", len(body)) + body


def _read_frame(sock: socket.socket, raw: bytearray) -> dict:
    """One handshake frame; its bytes are also appended to ``raw`` (all the stranger received)."""
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "the daemon closed the connection"
        head += chunk
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        assert chunk, "the daemon closed the connection"
        body += chunk
    raw += head + body
    return json.loads(body)


@pytest.mark.timeout(30)
def test_a_stranger_gets_no_mac_before_proving_the_key():
    """On b865314 the responder's challenge carried H(key, "resp", ...) over the stranger's own
    nonce: anyone reaching the link port collected a MAC to guess the key offline."""
    with Peer("victim") as victim:
        host, port = victim.links.address.split(":")
        na = b"\x01" * auth.NONCE_BYTES
        me, my_listen = "stranger", "127.0.0.1:9"
        raw = bytearray()
        with socket.create_connection((host, int(port)), timeout=5.0) as s:
            s.sendall(_frame({"type": "hello", "proto": PROTO_VERSION, "fleet": FLEET, "host_id": me,
                              "listen": my_listen, "nonce": na.hex(), "purpose": auth.CONTROL}))
            challenge = _read_frame(s, raw)
            assert challenge["type"] == "challenge" and "mac" not in challenge
            nb = bytes.fromhex(challenge["nonce"])
            # A guess at the key's proof: refused, and still nothing keyed comes back.
            s.sendall(_frame({"type": "auth", "mac": "00" * auth.MAC_BYTES}))
            answer = _read_frame(s, raw)
            assert answer == {"type": "refused", "reason": "bad fleet key"}
        # Every MAC the daemon could have computed for this exchange, in either role: none was sent.
        for role in ("resp", "init"):
            tag = auth._mac(KEY, role, FLEET, auth.CONTROL, me, my_listen, "victim", victim.links.address, na, nb)
            assert tag.hex().encode() not in raw and tag not in raw
        assert victim.links.peers() == []


@pytest.mark.timeout(30)
def test_the_initiator_proves_first_and_then_checks_the_responder():
    """The honest path still authenticates both ways: a responder without the key is caught
    by the initiator after the initiator proved itself (it gets "refused", no session)."""
    with Peer("a") as a, Peer("b") as b:
        link = a.links.link_to(b.links.address)
        assert link.peer_host == "b"
    with Peer("a") as a, Peer("impostor", key=b"another-fleet-key-" + b"z" * 20) as imp:
        with pytest.raises(AuthError, match="failed fleet-key authentication"):
            a.links.link_to(imp.links.address)
        assert a.links.peers() == [] and imp.links.peers() == []


@pytest.mark.timeout(30)
def test_a_daemon_refuses_a_peer_claiming_its_own_host_id():
    """On b865314 a daemon dialled by one with its own host id linked (and filed the link
    under its own name), so a reflected connection or a twin took its identity."""
    with Peer("twin") as responder, Peer("twin") as dialler:
        with pytest.raises(AuthError, match="own host id"):
            dialler.links.link_to(responder.links.address)
        assert responder.links.peers() == [] and dialler.links.peers() == []
    # The responder refuses it even when the dialler does not check the answer (a hostile one).
    with Peer("twin") as responder:
        host, port = responder.links.address.split(":")
        with socket.create_connection((host, int(port)), timeout=5.0) as s:
            s.sendall(_frame({"type": "hello", "proto": PROTO_VERSION, "fleet": FLEET, "host_id": "twin",
                              "listen": "127.0.0.1:9", "nonce": "02" * auth.NONCE_BYTES}))
            answer = _read_frame(s, bytearray())
        assert answer["type"] == "refused" and "own host id" in answer["reason"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["env", "file"])
def test_a_short_fleet_key_is_a_config_error_naming_where_it_came_from(tmp_path, where):
    """On b865314 MCCL_FLEET_KEY of any length was used as is (a 4-byte key: every link MAC
    brute-forced in seconds)."""
    if where == "env":
        cfg = load_config(env={"MCCL_FLEET_KEY": "short-key"})
        named = "MCCL_FLEET_KEY"
    else:
        kf = tmp_path / "fleet.key"
        kf.write_text("ab" * 16)          # 16 bytes as hex
        kf.chmod(0o600)
        cfg = load_config(env={"MCCL_KEY_FILE": str(kf)})
        named = str(kf)
    with pytest.raises(ConfigError, match=rf"{named}.* of (9|16) bytes; use at least 32"):
        cfg.read_key()
    assert len(load_config(env={"MCCL_FLEET_KEY": "k" * 32}).read_key()) == 32


@pytest.mark.timeout(30)
def test_the_handshake_refuses_to_run_under_a_short_key():
    """An embedder handing a weak key straight to the handshake gets a ConfigError, not a link."""
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(2.0)                 # without the check it would wait for an answer
        for side in (lambda: auth.initiate(a, b"k" * 31, FLEET, "x", "l", "p"),
                     lambda: auth.respond(a, b"k" * 31, FLEET, "x", "l", "p")):
            with pytest.raises(ConfigError, match="31 bytes"):
                side()
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)                     # nothing was sent under the weak key
