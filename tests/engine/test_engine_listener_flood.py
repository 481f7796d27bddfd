"""A keyless host floods the engine's listeners with idle connections (issue 34).

Anyone on the LAN can connect to a rank's listening port; only a holder of the job key can
prove it. The attacker here only connects and stays silent, from the same host as the
ranks (loopback), so a cap per source host alone cannot tell it from the real peers: the
listener must keep room for the newest connection, and a dialer whose connection was
dropped for room must dial again. Before the fix the listener held 32 connections for
10 s each and closed every later one at accept, the real peer's too, and the dialer gave
up at once: set-up failed with PeerLostError, and a link opened mid-job failed the send.
Ranks are threads of this process; the attacker's sockets are plain sockets.
"""

from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import CollectiveTimeout
from support.engine import SUM, job_secret, make_options, ptr, ranks, run_ranks, run_threads

pytestmark = pytest.mark.timeout(120)

FLOOD = 40  # per listening port: more than the old listener's 32 handshake slots


class IdleFlood:
    """`per_port` idle connections to each address, held until close(); counts how many
    the listener closed on its side (it may drop strangers to make room)."""

    def __init__(self, addrs: list[str], per_port: int) -> None:
        self.socks: list[socket.socket] = []
        for addr in addrs:
            host, port = addr.rsplit(":", 1)
            for _ in range(per_port):
                self.socks.append(socket.create_connection((host, int(port)), timeout=10))

    def closed_by_listener(self) -> int:
        n = 0
        for s in self.socks:
            s.setblocking(False)
            try:
                n += s.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                n += 1
        return n

    def close(self) -> None:
        for s in self.socks:
            s.close()


def build(listeners, cid: int, opts, last_after: threading.Event):
    """Every rank's communicator; the last rank starts building only once `last_after` is set."""
    addrs = [x.address for x in listeners]
    n = len(listeners)

    def make(r):
        if r == n - 1:
            assert last_after.wait(30)
        return _core.Communicator(r, n, cid, listeners[r], addrs, opts, secret=job_secret(opts))
    return run_threads(n, make, timeout=90)


def allreduce_twice(comms) -> None:
    n = len(comms)

    def body(r, c):
        for step in range(2):
            a = np.full(4096, r + 1 + step, np.float32)
            c.wait(c.allreduce(a.ctypes.data, a.size, int(_core.DType.float32), int(SUM)), 30)
            assert np.all(a == sum(range(1 + step, n + 1 + step))), (r, step, a[:4])
    run_ranks(comms, body)


def test_three_ranks_set_up_and_all_reduce_twice_with_40_idle_connections_on_every_listener():
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(3)]
    opts = make_options(connect_timeout_s=30.0)
    flood = None
    flooded = threading.Event()

    def attack():
        nonlocal flood
        # The attacker scanned the ports: every listener holds 40 idle connections before the
        # last rank joins; ranks 0 and 1 may be linking already.
        flood = IdleFlood([x.address for x in listeners], FLOOD)
        flooded.set()

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        # Finishing at all means within the set-up timeout: a timeout raises in build().
        comms = build(listeners, random.getrandbits(63), opts, flooded)
        allreduce_twice(comms)
        run_threads(3, lambda r: comms[r].shutdown(5.0))
    finally:
        attacker.join(30)
        if flood:
            flood.close()


def test_a_link_opened_mid_job_to_a_flooded_rank_carries_the_first_send():
    n = 8
    src, dst = 0, 3
    assert dst not in _core.collective_peers(src, n)
    other = next(q for q in range(n) if q not in (src, dst) and q not in _core.collective_peers(dst, n))
    with ranks(n) as cs:
        flood = IdleFlood([cs[0].peer_address(dst)], FLOOD)
        try:
            payload = np.arange(50_000, dtype=np.int32)

            def body(r, c):
                if r == src:
                    c.wait(c.send(ptr(payload), payload.nbytes, dst, 7), 30)
                elif r == dst:
                    got = np.zeros_like(payload)
                    c.wait(c.recv(ptr(got), got.nbytes, src, 7), 30)
                    # The flooded rank goes on linking on demand: its own first send too.
                    c.wait(c.send(ptr(got), got.nbytes, other, 8), 30)
                    return got
                elif r == other:
                    got = np.zeros_like(payload)
                    c.wait(c.recv(ptr(got), got.nbytes, dst, 8), 30)
                    return got
                return None

            got = run_ranks(cs, body)
            np.testing.assert_array_equal(got[dst], payload)
            np.testing.assert_array_equal(got[other], payload)

            def after(r, c):  # and every collective still runs
                x = np.full(1000, float(r + 1), np.float32)
                c.wait(c.allreduce(ptr(x), x.size, int(_core.DType.float32), SUM), 30)
                return float(x[0])
            assert run_ranks(cs, after) == [n * (n + 1) / 2] * n
        finally:
            flood.close()


def test_a_peer_whose_listener_closes_every_dial_is_named_at_the_set_up_timeout():
    """A listener that closes each connection at once (as a full one of the old kind did):
    the dialer tries again until its set-up timeout, then says which peer and why, instead
    of failing at the first close (or waiting past its timeout)."""
    lst = _core.Listener("127.0.0.1", 0)
    closes = 0
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as full:
        full.settimeout(0.1)

        def close_all():
            nonlocal closes
            while not stop.is_set():
                try:
                    conn, _ = full.accept()
                except socket.timeout:
                    continue
                conn.close()
                closes += 1
        t = threading.Thread(target=close_all, daemon=True)
        t.start()
        addr = "127.0.0.1:%d" % full.getsockname()[1]
        opts = make_options(connect_timeout_s=2.0)
        try:
            with pytest.raises(CollectiveTimeout) as info:
                _core.Communicator(0, 2, 11, lst, [lst.address, addr], opts, secret=job_secret(opts))
        finally:
            stop.set()
            t.join(10)
    text = str(info.value)
    assert f"peer={addr}" in text and "closed our handshake" in text and "flood" in text, text
    assert info.value.peer_rank == 1
    assert closes >= 2, closes     # dialed again after the first close
