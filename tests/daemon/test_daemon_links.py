"""Daemon-to-daemon links on loopback: mutual fleet-key authentication, encrypted and
authenticated frames, refusals logged once, and a listener that survives garbage."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest

from mccl_common.errors import AuthError, PeerLostError

from mccld.net.links import LinkManager

KEY = b"k" * 32


class Peer:
    def __init__(self, host_id: str, key: bytes = KEY, fleet: str = "f"):
        self.got: list[tuple[str, dict]] = []
        self.event = threading.Event()
        self.links = LinkManager(key, fleet, host_id, "127.0.0.1", 0, 5.0, self._on_message)

    def _on_message(self, peer: str, msg: dict) -> None:
        self.got.append((peer, msg))
        self.event.set()

    def __enter__(self) -> "Peer":
        self.links.start()
        return self

    def __exit__(self, *exc) -> None:
        self.links.stop()


@pytest.mark.timeout(30)
def test_authenticated_link_is_reused_and_carries_messages():
    with Peer("a") as a, Peer("b") as b:
        link = a.links.link_to(b.links.address)
        assert link.peer_host == "b"
        assert a.links.link_to(b.links.address) is link          # persistent, reused
        link.send({"type": "job_setup", "x": 1})
        assert b.event.wait(5)
        assert b.got == [("a", {"type": "job_setup", "x": 1})]


@pytest.mark.timeout(30)
def test_wrong_key_and_wrong_fleet_are_refused_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger="mccld.net.links")
    with Peer("a") as a, Peer("intruder", key=b"x" * 32) as bad, Peer("other", fleet="g") as other:
        for _ in range(3):
            with pytest.raises(AuthError, match="failed fleet-key authentication"):
                bad.links.link_to(a.links.address)
        with pytest.raises(AuthError, match="fleet"):
            other.links.link_to(a.links.address)
        time.sleep(0.3)
        assert a.links.peers() == []
    refusals = [r for r in caplog.records if r.name == "mccld.net.links" and "peer=" in r.getMessage()]
    levels = sorted(r.levelname for r in refusals)
    # 4 failed handshakes seen from both ends: each (side, peer address) warns once, then DEBUG:
    # "a" refuses 127.0.0.1 four times, the intruder is refused by "a" three times, "other" once.
    assert levels == ["DEBUG"] * 5 + ["WARNING"] * 3, [(r.levelname, r.getMessage()) for r in refusals]


@pytest.mark.timeout(30)
def test_garbage_and_tampered_frames_drop_only_that_link():
    with Peer("a") as a, Peer("b") as b:
        host, port = b.links.address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(struct.pack("!I", 5) + b"\x00garb")     # not a handshake
            s.settimeout(5)
            assert s.recv(100) == b""                         # b hung up on it
        link = a.links.link_to(b.links.address)               # ...and still serves real peers
        # A frame with a bad MAC (as an on-path injector would send) kills the link.
        body = b'{"type":"job_failed"}'
        link.sock.sendall(struct.pack("!I", 32 + len(body)) + b"\x00" * 32 + body)
        deadline = time.monotonic() + 5
        while b.links.peers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.links.peers() == [] and b.got == []
        # The next use redials a fresh authenticated link.
        time.sleep(0.2)
        fresh = a.links.link_to(b.links.address)
        assert fresh is not link
        fresh.send({"type": "ping"})
        assert b.event.wait(5) and b.got == [("a", {"type": "ping"})]


@pytest.mark.timeout(30)
def test_dialing_nobody_is_peer_lost():
    with Peer("a") as a:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(PeerLostError, match="cannot connect"):
            a.links.link_to(f"127.0.0.1:{port}")


class Relay:
    """A TCP relay on the path of one link (all a sniffer sees, in ``seen``); with
    ``flip_frame=n`` it flips a bit in the n-th length-prefixed frame the dialler sends."""

    def __init__(self, target: str, flip_frame: int | None = None):
        host, port = target.split(":")
        self._target = (host, int(port))
        self._flip = flip_frame
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._srv.getsockname()[1]}"
        self.seen = bytearray()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        try:
            client, _ = self._srv.accept()
        except OSError:
            return
        up = socket.create_connection(self._target)
        self._socks += [client, up]
        for args in ((client, up, True), (up, client, False)):
            t = threading.Thread(target=self._pump, args=args, daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        buf, frames = bytearray(), 0
        try:
            while chunk := src.recv(65536):
                self.seen += chunk
                if not upward or self._flip is None:
                    dst.sendall(chunk)
                    continue
                buf += chunk
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack("!I", buf[:4])[0]:
                    n = 4 + struct.unpack("!I", buf[:4])[0]
                    frame, buf = bytearray(buf[:n]), buf[n:]
                    frames += 1
                    if frames == self._flip:
                        frame[-1] ^= 0x01
                    dst.sendall(frame)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._srv.close()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        for s in self._socks:
            s.close()


@pytest.mark.timeout(30)
def test_a_link_message_crosses_the_path_encrypted():
    """Up to link proto 1 a sealed frame was JSON in clear after its MAC: a sniffer read which
    jobs, hosts and leases the daemons spoke of."""
    with Peer("a") as a, Peer("b") as b:
        relay = Relay(b.links.address)
        try:
            link = a.links.link_to(relay.address)
            link.send({"type": "job_setup", "job": "secret-job-name-4c2a", "hosts": ["hidden-host-77"]})
            assert b.event.wait(5)
            assert b.got == [("a", {"type": "job_setup", "job": "secret-job-name-4c2a", "hosts": ["hidden-host-77"]})]
        finally:
            a.links.stop()
            relay.close()
        for what in (b"secret-job-name-4c2a", b"hidden-host-77", b"job_setup"):
            assert what not in relay.seen, f"{what!r} crossed the link in clear"


@pytest.mark.timeout(30)
def test_a_link_frame_with_a_flipped_ciphertext_bit_is_refused_and_drops_the_link(caplog):
    caplog.set_level(logging.DEBUG, logger="mccld.net.links")
    with Peer("a") as a, Peer("b") as b:
        relay = Relay(b.links.address, flip_frame=3)        # hello, auth, then the first sealed frame
        try:
            link = a.links.link_to(relay.address)
            link.send({"type": "job_setup", "x": 1})
            deadline = time.monotonic() + 10
            while not any("failed its authentication" in r.getMessage() for r in caplog.records) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any("frame from peer=" in r.getMessage() and "failed its authentication" in r.getMessage()
                       for r in caplog.records)
            assert b.got == []
        finally:
            a.links.stop()
            relay.close()
