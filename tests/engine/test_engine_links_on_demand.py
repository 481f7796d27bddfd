"""Links on demand (transport/linker.h): set-up links a rank only to the collectives' peers;
any other peer is linked the first time an op sends to it, over a listener that lives as
long as the communicator. Ranks are threads of this process."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import CollectiveTimeout
from support.engine import SUM, make_options, ptr, ranks, run_ranks

K = make_options().sockets_per_peer


def wait(c, op_id, timeout=60.0):
    c.wait(op_id, timeout)


def sockets_for(a: int, b: int, n: int) -> int:
    d = abs(a - b)
    return K if d in (1, n - 1) else 1


def socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def not_partners(n: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(n) for b in range(a + 1, n) if b not in _core.collective_peers(a, n)]


def test_collective_peers_binding():
    assert _core.collective_peers(0, 8) == [1, 2, 4, 7]
    assert _core.collective_peers(5, 6) == [0, 1, 4]  # ring 4, 0; fold partner 1
    for n in (2, 5, 17, 200):
        for r in range(n):
            for p in _core.collective_peers(r, n):
                assert r in _core.collective_peers(p, n), (r, p, n)


def test_setup_links_only_the_collective_peers():
    n = 8
    with ranks(n) as cs:
        for r, c in enumerate(cs):
            peers = _core.collective_peers(r, n)
            st = c.stats()
            assert st["linked_peers"] == len(peers)
            assert c.link_count() == sum(sockets_for(r, p, n) for p in peers)


@pytest.mark.parametrize("receiver_first", [False, True])
def test_only_one_side_initiates(receiver_first):
    """A send to a peer that has not posted its receive (or the other way round) links them;
    the receiver never dials, so nothing waits for it to."""
    n = 8
    src, dst = 0, 5
    assert dst not in _core.collective_peers(src, n)
    payload = np.arange(100_000, dtype=np.int32)
    with ranks(n) as cs:
        before = cs[dst].stats()["linked_peers"]

        def body(r, c):
            if r == src:
                if receiver_first:
                    time.sleep(0.3)
                wait(c, c.send(ptr(payload), payload.nbytes, dst, 3))
            elif r == dst:
                if not receiver_first:
                    time.sleep(0.3)
                got = np.zeros_like(payload)
                wait(c, c.recv(ptr(got), got.nbytes, src, 3))
                return got
            return None

        got = run_ranks(cs, body)[dst]
        np.testing.assert_array_equal(got, payload)
        assert cs[dst].stats()["linked_peers"] == before + 1
        assert src in {p for p, v in cs[dst].stats()["per_peer"].items() if v["received"] > 0}


def test_concurrent_first_use_from_both_sides_builds_one_link_per_pair():
    """Every rank sends to every other at once: each pair of non-partners dials both ways at
    the same moment; the lower rank's dial wins, and each pair ends with exactly one link."""
    n = 8
    with ranks(n) as cs:
        start = threading.Barrier(n)

        def body(r, c):
            outs = {q: np.full(1000, r * 100 + q, np.int64) for q in range(n) if q != r}
            ins = {q: np.zeros(1000, np.int64) for q in range(n) if q != r}
            start.wait()
            ids = [c.send(ptr(outs[q]), outs[q].nbytes, q, 1) for q in outs]
            ids += [c.recv(ptr(ins[q]), ins[q].nbytes, q, 1) for q in ins]
            for i in ids:
                wait(c, i)
            return ins

        got = run_ranks(cs, body)
        for r in range(n):
            for q, buf in got[r].items():
                assert (buf == q * 100 + r).all()
        for r, c in enumerate(cs):
            assert c.stats()["linked_peers"] == n - 1
            assert c.link_count() == sum(sockets_for(r, q, n) for q in range(n) if q != r)


def test_any_source_receive_from_peers_never_linked():
    n = 8
    senders = [q for q in range(1, n) if q not in _core.collective_peers(0, n)]
    assert senders
    with ranks(n) as cs:

        def body(r, c):
            if r == 0:
                bufs = [np.zeros(4, np.int32) for _ in senders]
                ids = [c.recv(ptr(b), b.nbytes, -1, 9) for b in bufs]
                for i in ids:
                    wait(c, i)
                return sorted(int(b[0]) for b in bufs)
            if r in senders:
                a = np.full(4, r, np.int32)
                wait(c, c.send(ptr(a), a.nbytes, 0, 9))
            return None

        assert run_ranks(cs, body)[0] == senders


def test_receive_from_a_peer_that_never_connects_names_it():
    n = 6
    silent = 3
    assert silent not in _core.collective_peers(0, n)
    with ranks(n) as cs:
        buf = np.zeros(8, np.int32)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout) as ei:
            cs[0].wait(cs[0].recv(ptr(buf), buf.nbytes, silent, 0, timeout_s=1.0), 30.0)
        assert time.monotonic() - started < 20
        assert ei.value.peer_rank == silent
        assert f"rank {silent}" in str(ei.value) and "never connected" in str(ei.value)


def test_send_to_a_peer_that_is_gone_names_it():
    n = 6
    gone = 3
    with ranks(n) as cs:
        cs[gone].shutdown(2.0)  # left in good order: its partners carry on, its listener is closed
        buf = np.zeros(8, np.int32)
        with pytest.raises(CollectiveTimeout) as ei:
            cs[0].wait(cs[0].send(ptr(buf), buf.nbytes, gone, 0, timeout_s=1.0), 30.0)
        assert ei.value.peer_rank == gone
        assert f"rank {gone}" in str(ei.value)


def test_stranger_connecting_mid_job_is_dropped_and_the_job_goes_on(caplog):
    n = 5
    with ranks(n) as cs:
        host, port = cs[0].peer_address(0).rsplit(":", 1)
        with caplog.at_level(logging.WARNING, logger="libmccl.engine"):
            for junk in (b"GET / HTTP/1.0\r\nX-Pad: " + b"x" * 100 + b"\r\n\r\n", b"\x00" * 200):
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(junk)
                    s.settimeout(5)
                    try:
                        assert s.recv(100) == b""  # dropped, told nothing
                    except ConnectionResetError:
                        pass

            def body(r, c):
                x = np.full(1000, float(r + 1), np.float32)
                wait(c, c.allreduce(ptr(x), x.size, int(_core.DType.float32), SUM))
                if r in (0, 3):  # not partners: a link made after the stranger came
                    out, got = np.full(10, r, np.int32), np.zeros(10, np.int32)
                    other = 3 - r
                    ids = [c.send(ptr(out), out.nbytes, other, 0), c.recv(ptr(got), got.nbytes, other, 0)]
                    for i in ids:
                        wait(c, i)
                    assert (got == other).all()
                return float(x[0])

            assert run_ranks(cs, body) == [n * (n + 1) / 2] * n
        dropped = [m for m in caplog.messages if "dropped a connection" in m]
        assert len(dropped) == 1, dropped  # once per source host at WARNING


def test_alltoall_17_ranks():
    n = 17
    nbytes = 333
    ins = [np.random.default_rng(r).integers(0, 255, n * nbytes, dtype=np.uint8) for r in range(n)]
    with ranks(n) as cs:

        def body(r, c):
            out = np.zeros(n * nbytes, np.uint8)
            wait(c, c.alltoall(ptr(ins[r]), ptr(out), nbytes))
            return out

        outs = run_ranks(cs, body, timeout=120)
        for r, out in enumerate(outs):
            want = np.concatenate([ins[q][r * nbytes:(r + 1) * nbytes] for q in range(n)])
            np.testing.assert_array_equal(out, want)
        for c in cs:
            assert c.stats()["linked_peers"] == n - 1


def test_socket_count_stays_logarithmic_at_64_ranks():
    n = 64
    bound = 4 * math.ceil(math.log2(n)) + 8
    sockets_before = socket_fds()
    with ranks(n) as cs:
        f32 = int(_core.DType.float32)

        def body(r, c):
            x = np.full(4096, 1.0, np.float32)
            wait(c, c.allreduce(ptr(x), x.size, f32, SUM))
            wait(c, c.broadcast(ptr(x), x.nbytes, 5))
            mine, g = np.full(64, r, np.uint8), np.zeros(n * 64, np.uint8)
            wait(c, c.allgather(ptr(mine), ptr(g), 64))
            assert (g.reshape(n, 64) == np.arange(n, dtype=np.uint8)[:, None]).all()
            ones, rs = np.ones(16 * n, np.float32), np.zeros(16, np.float32)
            wait(c, c.reduce_scatter(ptr(ones), ptr(rs), 16, f32, SUM))
            wait(c, c.barrier())  # by recursive doubling: it messaged every rank before
            return float(x[0]), float(rs[0])

        assert run_ranks(cs, body, timeout=240) == [(float(n), float(n))] * n
        per_rank = [c.link_count() for c in cs]
        # The sockets really open in this process: every link has two ends here, plus one
        # listener per rank (its dup; the test's Listener objects are closed after build).
        opened = socket_fds() - sockets_before
    assert max(per_rank) <= bound, (max(per_rank), bound)
    assert opened <= n * (bound + 1), (opened, n * (bound + 1))
    assert opened >= sum(per_rank)  # the count is of real sockets


def test_borrowed_links_to_the_collective_peers_only():
    """Built on handed-in sockets (mccld's way) to the collectives' peers only: the
    collectives run; an op that needs another peer fails at once with a ConfigError naming it."""
    from mccl_common.errors import ConfigError
    from support.borrowed import Mesh

    n = 5
    with Mesh(n) as mesh:
        for r in range(n):  # keep only the sockets to collective peers
            mesh.socks[r] = {p: s for p, s in mesh.socks[r].items() if p in _core.collective_peers(r, n)}
        comms = mesh.build()
        try:
            def body(r, c):  # the ring all-gather (the all-reduce of today may message anyone)
                mine, out = np.full(4, r, np.int32), np.zeros(4 * n, np.int32)
                wait(c, c.allgather(ptr(mine), ptr(out), mine.nbytes))
                assert c.stats()["linked_peers"] == len(_core.collective_peers(r, n))
                return out.tolist()

            assert run_ranks(comms, body) == [np.repeat(np.arange(n), 4).tolist()] * n
            outsider = next(q for q in range(1, n) if q not in _core.collective_peers(0, n))
            buf = np.zeros(4, np.int32)
            with pytest.raises(ConfigError) as ei:
                comms[0].wait(comms[0].send(ptr(buf), buf.nbytes, outsider, 0), 10.0)
            assert ei.value.peer_rank == outsider and "no link" in str(ei.value)
        finally:
            run_ranks(comms, lambda r, c: c.abort("test over"))
