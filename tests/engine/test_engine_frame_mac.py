"""Per-frame MACs on the engine's links (integrity/mac.h; MCCL_WIRE_SECURITY=mac).

On sockets the caller connected, with keys per socket and direction (derived by the link
handshake from the job secret, transport/handshake.h): collectives and p2p
run as without them (large messages striped, read by the receive threads, reduced as
they arrive), a clean shutdown leaves the sockets reusable by the next job under new
keys, a byte altered on the way fails the op naming the peer instead of corrupting the
result, and ranks that disagree on MACs are refused at the handshake. Ranks are threads.
"""

from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import AuthError, ConfigError, MCCLError, ProtocolError

from support.borrowed import K, Mesh, allreduce_check
from support.engine import DT, SUM, job_secret, make_options, ptr, run_ranks, run_threads

MAC, OFF = _core.WireSecurity.mac, _core.WireSecurity.off


def build(n: int, fds, modes, comm_id: int | None = None, secrets=None, **kw) -> list:
    """modes: one WireSecurity for all ranks or one per rank; secrets: one per rank (default:
    the job secret wherever the mode needs one)."""
    cid = comm_id if comm_id is not None else random.getrandbits(63)
    modes = modes if isinstance(modes, list) else [modes] * n
    opts = [make_options(sockets_per_peer=K, connect_timeout_s=kw.get("connect_timeout_s", 10.0),
                         wire_security=m, **{k: v for k, v in kw.items() if k != "connect_timeout_s"})
            for m in modes]
    keys = secrets or [job_secret(o) for o in opts]
    addrs = [f"127.0.0.1:{1000 + r}" for r in range(n)]
    return run_threads(n, lambda r: _core.Communicator(r, n, cid, fds(r), addrs, opts[r], secret=keys[r]))


@pytest.mark.timeout(60)
def test_collectives_and_p2p_with_frame_macs_then_a_second_job_on_the_same_sockets():
    with Mesh(3) as mesh:
        comms = build(3, mesh.fds, MAC)
        allreduce_check(comms, 1 << 20)      # 4 MB: striped, received by the receive threads
        allreduce_check(comms, 3)

        def p2p(r, c):
            x = np.arange(1 << 16, dtype=np.float32) + r
            got = np.zeros_like(x)
            peer = (r + 1) % 3
            s = c.send(ptr(x), x.nbytes, peer, 9)
            c.wait(c.recv(ptr(got), got.nbytes, (r - 1) % 3, 9), 20)
            c.wait(s, 20)
            assert np.array_equal(got, np.arange(1 << 16, dtype=np.float32) + (r - 1) % 3)
        run_ranks(comms, p2p)
        # Both ends read each other's BYE and its tag: the sockets serve the next job.
        assert run_threads(3, lambda r: comms[r].shutdown(5.0)) == [True] * 3
        comms = build(3, mesh.fds, MAC)
        allreduce_check(comms, 1 << 18)
        assert run_threads(3, lambda r: comms[r].shutdown(5.0)) == [True] * 3


class Tamperer:
    """Sits between rank 0 and rank 1 on every socket and flips one byte, once, at
    ``at`` bytes into socket 0's rank-0-to-1 stream (past the 56-byte hello: in a frame)."""

    def __init__(self, at: int):
        self.at = at
        self.ends: list[tuple[socket.socket, socket.socket]] = []   # (rank 0's, rank 1's)
        self._mine: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        for s in range(K):
            a0, p0 = socket.socketpair()
            p1, b1 = socket.socketpair()
            self.ends.append((a0, b1))
            self._mine += [p0, p1]
            self._threads += [threading.Thread(target=self._pump, args=(p0, p1, s == 0), daemon=True),
                              threading.Thread(target=self._pump, args=(p1, p0, False), daemon=True)]
        for t in self._threads:
            t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        seen = 0
        try:
            while chunk := src.recv(1 << 16):
                if tamper and seen <= self.at < seen + len(chunk):
                    b = bytearray(chunk)
                    b[self.at - seen] ^= 0x40
                    chunk = bytes(b)
                seen += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def fds(self, r: int) -> dict[int, list[int]]:
        return {1 - r: [pair[r].fileno() for pair in self.ends]}

    def close(self) -> None:
        for a, b in self.ends:
            a.close()
            b.close()
        for s in self._mine:
            s.close()
        for t in self._threads:
            t.join(10)


def allreduce_once(comms) -> list:
    """Each rank's outcome of one 4 MB all-reduce: whether its result is right, or its error."""
    def body(r, c):
        a = np.full(1 << 20, r + 1, dtype=np.float32)
        try:
            c.wait(c.allreduce(ptr(a), a.size, DT[a.dtype], SUM), 20)
        except MCCLError as e:
            return e
        return bool(np.all(a == 3))
    return run_ranks(comms, body)


@pytest.mark.timeout(60)
def test_a_byte_altered_on_the_way_fails_the_op_naming_the_peer_instead_of_corrupting_it():
    at = 124 + 72 + 4096         # after the hello, the proof and the first frame's header: payload bytes
    # Without MACs the engine cannot tell: a rank ends with a wrong sum and no error.
    t = Tamperer(at)
    try:
        comms = build(2, t.fds, OFF)
        assert False in allreduce_once(comms)
        run_threads(2, lambda r: comms[r].shutdown(1.0))
    finally:
        t.close()
    t = Tamperer(at)
    try:
        comms = build(2, t.fds, MAC)
        outcome = allreduce_once(comms)
        run_threads(2, lambda r: comms[r].shutdown(1.0))
    finally:
        t.close()
    assert all(isinstance(o, MCCLError) for o in outcome), outcome
    assert isinstance(outcome[1], ProtocolError), outcome
    assert "failed its MAC check" in str(outcome[1]) and "(rank 0)" in str(outcome[1]), outcome[1]
    assert outcome[1].peer_rank == 0


@pytest.mark.timeout(60)
def test_different_job_secrets_on_the_two_ends_are_refused_at_the_handshake():
    with Mesh(2) as mesh:
        with pytest.raises(AuthError, match="job key"):
            build(2, mesh.fds, MAC, secrets=[job_secret(), bytes(32)], connect_timeout_s=3.0)


@pytest.mark.timeout(60)
def test_ranks_that_disagree_on_frame_macs_are_refused_at_the_handshake():
    with Mesh(2) as mesh:
        with pytest.raises(ConfigError, match="wire security mismatch.*MCCL_WIRE_SECURITY"):
            build(2, mesh.fds, [MAC, OFF], connect_timeout_s=3.0)


def test_a_missing_or_short_job_secret_is_refused():
    with Mesh(2) as mesh:
        opts = make_options(sockets_per_peer=K, connect_timeout_s=1.0, wire_security=MAC)
        with pytest.raises(ConfigError, match="32 bytes"):
            _core.Communicator(0, 2, 1, mesh.fds(0), ["a:1", "b:1"], opts, secret=b"short")
        with pytest.raises(ConfigError, match="no job secret"):
            _core.Communicator(0, 2, 1, mesh.fds(0), ["a:1", "b:1"], opts)
