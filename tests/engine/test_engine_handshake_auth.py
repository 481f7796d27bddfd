"""Attacker tests of the engine's keyed link handshake (libmccl/csrc/transport/handshake.h).

Ranks are threads; the attacker is a raw socket on loopback that knows the protocol but
not the job key. It may know the comm id (it sits in the open c10d store). What must hold:
a stranger never aborts set-up, never holds a link, and never learns the comm id or any
expected value from a reply; ranks with different keys fail promptly, naming the peer and
the job key; every handshake derives fresh frame keys, also on a reused pooled socket;
ranks that disagree on MCCL_WIRE_SECURITY fail with a ConfigError.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import AuthError, CollectiveTimeout, ConfigError, MCCLError

from support import link_peer
from support.borrowed import Mesh, allreduce_check
from support.engine import job_secret, make_options, run_threads

pytestmark = pytest.mark.timeout(120)

ENGINE_LOG = "libmccl.engine"


class Stranger:
    """A raw client on loopback: connects to `addr` and plays `script(sock)` in a thread,
    keeping every byte it received."""

    def __init__(self, addr: str, script) -> None:
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.received = b""
        self.error: BaseException | None = None
        self._script = script
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.received = self._script(self.sock)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def join(self) -> bytes:
        self._thread.join(30)
        assert not self._thread.is_alive(), "the stranger's exchange hung"
        self.sock.close()
        if self.error:
            raise self.error
        return self.received


def garbage(sock: socket.socket) -> bytes:
    sock.sendall(os.urandom(100))
    sock.shutdown(socket.SHUT_WR)
    return link_peer.recv_all(sock, 15)


def keyless(hello: bytes):
    """A well-formed hello, then a made-up proof: everything it gets back is returned."""
    def script(sock: socket.socket) -> bytes:
        sock.sendall(hello)
        got = link_peer.recv_exact(sock, link_peer.REPLY.size)
        sock.sendall(link_peer.PROOF.pack(link_peer.MAGIC, os.urandom(32)))
        return got + link_peer.recv_all(sock, 15)
    return script


def comm_id_traces(cid: int) -> list[bytes]:
    return [str(cid).encode(), struct.pack("<Q", cid), struct.pack(">Q", cid), b"%x" % cid]


def build_after(listeners, cid: int, opts, secrets=None, start_after=None):
    """Communicators for every listener; rank r's constructor waits for start_after[r] (an Event)."""
    addrs = [x.address for x in listeners]
    n = len(listeners)
    keys = secrets or [job_secret(opts)] * n

    def make(r):
        if start_after and start_after.get(r) is not None:
            assert start_after[r].wait(30)
        return _core.Communicator(r, n, cid, listeners[r], addrs, opts, secret=keys[r])
    return run_threads(n, make)


def collectives_ok(comms) -> None:
    def body(r, c):
        a = np.full(1000, r + 1, np.float32)
        c.wait(c.allreduce(a.ctypes.data, a.size, int(_core.DType.float32), int(_core.ReduceOp.SUM)), 30)
        assert np.all(a == sum(range(1, len(comms) + 1)))
    run_threads(len(comms), lambda r: body(r, comms[r]))
    run_threads(len(comms), lambda r: comms[r].shutdown(5.0))


def test_strangers_with_garbage_or_without_the_key_do_not_abort_set_up_and_are_logged_once(caplog):
    caplog.set_level(logging.DEBUG, logger=ENGINE_LOG)
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    cid = random.getrandbits(63)
    # Both knock on rank 1 before anyone builds: they sit first in its accept queue.
    junk = Stranger(listeners[1].address, garbage)
    nokey = Stranger(listeners[1].address, keyless(link_peer.hello(cid, 0, 1, 2, 0, 2)))
    comms = build_after(listeners, cid, make_options(connect_timeout_s=30.0))
    assert junk.join() == b""                     # dropped without a word
    got = nokey.join()
    assert len(got) == link_peer.REPLY.size       # the challenge, then nothing: no verdict
    collectives_ok(comms)
    drops = [r for r in caplog.records if r.name == ENGINE_LOG and "dropped a connection from 127.0.0.1" in r.message]
    assert len(drops) == 2, [r.message for r in drops]
    assert [r.levelno for r in drops].count(logging.WARNING) == 1, [(r.levelname, r.message) for r in drops]
    assert any("failed the proof of the job key" in r.message for r in drops), [r.message for r in drops]


def test_a_stranger_posing_as_rank_0_first_does_not_hold_the_link():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    cid = random.getrandbits(63)              # the attacker read it from the open store
    opts = make_options(connect_timeout_s=30.0)
    posed = threading.Event()
    impostors: list[Stranger] = []

    def make(r):
        if r == 0:
            assert posed.wait(30)             # the real rank 0 comes only after the impostor
        return _core.Communicator(r, 2, cid, listeners[r], [x.address for x in listeners], opts,
                                  secret=job_secret(opts))

    def pose():
        time.sleep(0.3)                       # rank 1 is accepting by now
        for idx in range(2):                  # both of rank 0's sockets
            impostors.append(Stranger(listeners[1].address, keyless(link_peer.hello(cid, 0, 1, 2, idx, 2))))
        posed.set()

    threading.Thread(target=pose, daemon=True).start()
    comms = run_threads(2, make)
    for s in impostors:
        got = s.join()
        status = link_peer.REPLY.unpack(got[:link_peer.REPLY.size])[1] if got else None
        assert len(got) == link_peer.REPLY.size and status == 0, got   # a challenge, never an "ok"
    collectives_ok(comms)                     # the real rank 0 holds both links


def test_no_reply_to_an_unauthenticated_peer_carries_the_comm_id():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    cid = random.getrandbits(63)
    wrong = cid ^ 0x5A5A
    # Every field wrong in turn: each would draw a refusal naming the acceptor's view.
    hellos = [link_peer.hello(wrong, 0, 1, 2, 0, 2),
              link_peer.hello(wrong, 0, 1, 3, 0, 2),
              link_peer.hello(wrong, 5, 1, 2, 0, 7),
              link_peer.hello(wrong, 0, 1, 2, 0, 2, terms=b"\xff" * 16)]
    strangers = [Stranger(listeners[1].address, keyless(h)) for h in hellos]
    comms = build_after(listeners, cid, make_options(connect_timeout_s=30.0))
    for s in strangers:
        got = s.join()
        assert not any(t in got for t in comm_id_traces(cid)), got
        assert len(got) == link_peer.REPLY.size, got    # the challenge and nothing else
    collectives_ok(comms)


def test_ranks_with_different_job_keys_fail_promptly_naming_the_peer_and_the_job_key():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    opts = make_options(connect_timeout_s=3.0)
    addrs = [x.address for x in listeners]
    secrets = [job_secret(opts), os.urandom(32)]

    def make(r):
        try:
            return _core.Communicator(r, 2, 42, listeners[r], addrs, opts, secret=secrets[r])
        except MCCLError as e:
            return e

    t0 = time.monotonic()
    out = run_threads(2, make, timeout=30)
    assert time.monotonic() - t0 < 15
    assert isinstance(out[0], AuthError), out[0]
    assert "job key" in str(out[0]) and f"peer={addrs[1]}" in str(out[0]), out[0]
    assert isinstance(out[1], (AuthError, CollectiveTimeout)), out[1]
    text = str(out[1])
    assert "never proved the job key" in text and addrs[0] in text and "127.0.0.1:" in text, text
    assert out[1].peer_rank == 0


def test_a_stranger_that_answers_a_dial_without_the_key_is_an_auth_error():
    lst = _core.Listener("127.0.0.1", 0)
    with socket.create_server(("127.0.0.1", 0)) as fake:
        def answer():
            conn, _ = fake.accept()
            with conn:
                conn.settimeout(10)
                link_peer.recv_exact(conn, link_peer.HELLO.size)
                conn.sendall(link_peer.REPLY.pack(link_peer.MAGIC, 0, 0, os.urandom(32)))
                link_peer.recv_exact(conn, link_peer.PROOF.size)
                conn.sendall(link_peer.REPLY.pack(link_peer.MAGIC, 0, 0, os.urandom(32)))   # "ok", unproved
                link_peer.recv_all(conn, 5)
        t = threading.Thread(target=answer, daemon=True)
        t.start()
        addr = "127.0.0.1:%d" % fake.getsockname()[1]
        opts = make_options(connect_timeout_s=10.0)
        with pytest.raises(AuthError, match=r"answered without proving the job key") as info:
            _core.Communicator(0, 2, 7, lst, [lst.address, addr], opts, secret=job_secret(opts))
        assert f"peer={addr}" in str(info.value)
        t.join(10)


def test_two_jobs_on_the_same_pooled_sockets_get_different_frame_keys():
    with Mesh(2) as mesh:
        ids = []
        for _ in range(2):
            comms = mesh.build()
            allreduce_check(comms, 1000)
            ids.append([c.link_key_ids() for c in comms])
            assert run_threads(2, lambda r: comms[r].shutdown(5.0)) == [True, True]
    for job in ids:
        # The two ends agree: one's send key is the other's receive key, per socket.
        assert [(s, r) for s, r in job[0][1]] == [(r, s) for s, r in job[1][0]]
        per_socket = [k for pair in job[0][1] for k in pair]
        assert len(set(per_socket)) == len(per_socket)    # no two sockets or directions share one
    first = {k for pair in ids[0][0][1] for k in pair}
    second = {k for pair in ids[1][0][1] for k in pair}
    assert not first & second, (ids[0], ids[1])


@pytest.mark.parametrize("modes", [("mac", "aead"), ("aead", "mac")])
def test_ranks_that_disagree_on_wire_security_fail_with_a_config_error(modes):
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    addrs = [x.address for x in listeners]
    opts = [make_options(connect_timeout_s=5.0, wire_security=getattr(_core.WireSecurity, m)) for m in modes]

    def make(r):
        try:
            return _core.Communicator(r, 2, 9, listeners[r], addrs, opts[r], secret=job_secret(opts[r]))
        except MCCLError as e:
            return e

    out = run_threads(2, make, timeout=30)
    for e in out:
        assert isinstance(e, ConfigError) and "MCCL_WIRE_SECURITY" in str(e), e


def test_strangers_that_connect_and_stay_silent_do_not_stall_set_up():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(2)]
    host, port = listeners[1].address.rsplit(":", 1)
    # Each would hold a one-at-a-time acceptor for its 10 s: three outlast the 8 s timeout.
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
    try:
        t0 = time.monotonic()
        comms = build_after(listeners, random.getrandbits(63), make_options(connect_timeout_s=8.0))
        assert time.monotonic() - t0 < 8.0
        collectives_ok(comms)
    finally:
        for s in silent:
            s.close()
