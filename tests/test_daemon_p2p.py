"""Daemon mode: all-to-all(v) and point-to-point through one mccld (the same checks run
across two hosts in test_daemon_fleet.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import run_ranks
from test_daemon_attach import connect, daemon, our_segments  # noqa: F401 - fixture

F16_BITS = np.uint16


def _v_sizes(src: int, world: int) -> list[int]:
    """Bytes rank ``src`` sends to each rank: uneven, and zero for some pairs."""
    return [((src + 2 * d) % 3) * 6 for d in range(world)]


def _v_data(src: int, world: int) -> np.ndarray:
    return (np.arange(sum(_v_sizes(src, world)), dtype=np.int64) * 7 + src * 1000 + 3).astype(np.uint8)


def check_alltoall(comm, rank: int, world: int) -> None:
    # uniform: rank r's block d is (r, d) in float16 bits
    send = np.array([[(r * 16 + d) | 0x3C00 for _ in range(3)] for r in [rank] for d in range(world)],
                    dtype=F16_BITS).reshape(-1)
    recv = np.zeros(3 * world, dtype=F16_BITS)
    comm.wait(comm.alltoall(send.ctypes.data, recv.ctypes.data, 6), 30)
    assert recv.tolist() == [(s * 16 + rank) | 0x3C00 for s in range(world) for _ in range(3)], recv
    # uneven with zero-size splits, and the caller's offsets leave gaps in both buffers
    sizes = _v_sizes(rank, world)
    data = _v_data(rank, world)
    gap = 5
    send_off = [sum(sizes[:d]) + gap * d for d in range(world)]
    sbuf = np.zeros(send_off[-1] + sizes[-1] + 1, dtype=np.uint8)
    for d in range(world):
        sbuf[send_off[d]:send_off[d] + sizes[d]] = data[sum(sizes[:d]):sum(sizes[:d + 1])]
    rsizes = [_v_sizes(s, world)[rank] for s in range(world)]
    recv_off = [sum(rsizes[:s]) + gap * s for s in range(world)]
    rbuf = np.full(recv_off[-1] + rsizes[-1] + gap, 0xEE, dtype=np.uint8)
    comm.wait(comm.alltoallv(sbuf.ctypes.data, sizes, send_off, rbuf.ctypes.data, rsizes, recv_off), 30)
    for s in range(world):
        theirs = _v_data(s, world)
        start = sum(_v_sizes(s, world)[:rank])
        got = rbuf[recv_off[s]:recv_off[s] + rsizes[s]]
        assert got.tolist() == theirs[start:start + rsizes[s]].tolist(), (s, got)
        assert (rbuf[recv_off[s] + rsizes[s]:recv_off[s] + rsizes[s] + gap] == 0xEE).all(), "wrote into a gap"


def check_p2p(comm, rank: int, world: int) -> None:
    right, left = (rank + 1) % world, (rank - 1) % world
    # ring with every recv posted before its send
    got = np.zeros(9, dtype=np.float64)
    r = comm.recv(got.ctypes.data, got.nbytes, left, 3)
    mine = np.full(9, rank + 0.5)
    comm.wait(comm.send(mine.ctypes.data, mine.nbytes, right, 3), 30)
    comm.wait(r, 30)
    assert (got == left + 0.5).all(), got
    # several messages on one (src, dst, tag) keep their order; another tag is matched
    # by tag, not by arrival (tag 9 is posted first but sent last)
    if rank == 0:
        msgs = [np.full(4, 10 + i, dtype=np.int32) for i in range(3)]
        late = np.full(2, 99, dtype=np.int32)
        ids = [comm.send(m.ctypes.data, m.nbytes, 1, 5) for m in msgs] + [comm.send(late.ctypes.data, 8, 1, 9)]
        for i in ids:
            comm.wait(i, 30)
    elif rank == 1:
        tag9 = np.zeros(2, dtype=np.int32)
        r9 = comm.recv(tag9.ctypes.data, 8, 0, 9)
        outs = [np.zeros(4, dtype=np.int32) for _ in range(3)]
        ids = [comm.recv(o.ctypes.data, o.nbytes, 0, 5) for o in outs]
        for i in ids + [r9]:
            comm.wait(i, 30)
        assert [int(o[0]) for o in outs] == [10, 11, 12] and (tag9 == 99).all()
    # any-source recv at rank 0, a zero-byte message from each sender
    if rank == 0:
        heard = []
        for _ in range(world - 1):
            buf = np.zeros(1, dtype=np.int64)
            comm.wait(comm.recv(buf.ctypes.data, 8, -1, 4), 30)
            heard.append(int(buf[0]))
            comm.wait(comm.recv(buf.ctypes.data, 0, heard[-1], 6), 30)
        assert sorted(heard) == list(range(1, world)), heard
    else:
        one = np.array([rank], dtype=np.int64)
        comm.wait(comm.send(one.ctypes.data, 8, 0, 4), 30)
        comm.wait(comm.send(one.ctypes.data, 0, 0, 6), 30)
    # p2p does not wait for the collective order: rank 0's all-reduce is pending (rank 1
    # has not submitted it) while rank 1's send reaches rank 0's posted recv
    x = np.ones(4, dtype=np.float32)
    if rank == 0:
        box = np.zeros(1, dtype=np.int64)
        r = comm.recv(box.ctypes.data, 8, 1, 8)
        a = comm.allreduce(x.ctypes.data, 4, 0, 0)
        comm.wait(r, 30)
        comm.wait(a, 30)
        assert box[0] == 42
    else:
        if rank == 1:
            time.sleep(0.3)
            v = np.array([42], dtype=np.int64)
            comm.wait(comm.send(v.ctypes.data, 8, 0, 8), 30)
        comm.wait(comm.allreduce(x.ctypes.data, 4, 0, 0), 30)
    assert (x == world).all()


def rank_exchanges(rank: int, world: int) -> str:
    comm, _store = connect(rank, world, comm_id=0xa2a)
    check_alltoall(comm, rank, world)
    check_p2p(comm, rank, world)
    comm.shutdown(10)
    return "ok"


@pytest.mark.timeout(120)
def test_alltoall_and_p2p_three_ranks(daemon):  # noqa: F811
    _d, env = daemon
    assert run_ranks(rank_exchanges, 3, env=env, timeout_s=100) == ["ok"] * 3
    assert not [s for s in our_segments() if s.split("-")[1] == "00000a2a"]


def verdict(e: Exception, started: float) -> str:
    """How a rank program reports the error it expected: kind, peer, seconds, message."""
    return f"{type(e).__name__} peer={getattr(e, 'peer_rank', None)} after {time.monotonic() - started:.2f} s: {e}"


def recv_never_matched(comm, rank: int, receiver: int, sender: int, timeout_s: float) -> str:
    """``receiver`` waits for a message ``sender`` never sends; the others try a barrier
    once the job must have failed."""
    from mccl_common.errors import MCCLError
    buf = np.zeros(4, dtype=np.int64)
    started = time.monotonic()
    try:
        if rank == receiver:
            comm.wait(comm.recv(buf.ctypes.data, buf.nbytes, sender, 11), 60)
        else:
            time.sleep(2 * timeout_s)
            comm.wait(comm.barrier(), 60)
    except MCCLError as e:
        return verdict(e, started)
    return "no error"


def rank_recv_times_out(rank: int, world: int) -> str:
    comm, _store = connect(rank, world, comm_id=0x71e, timeout_s=3.0)
    return recv_never_matched(comm, rank, 1, 0, 3.0)


@pytest.mark.timeout(90)
def test_recv_without_send_times_out_naming_the_peer(daemon):  # noqa: F811
    _d, env = daemon
    out = run_ranks(rank_recv_times_out, 2, env=env, timeout_s=60)
    kind, peer, _after, seconds, _s, msg = out[1].split(" ", 5)
    assert kind == "CollectiveTimeout" and peer == "peer=0" and "recv from rank 0 (tag 11" in msg, out[1]
    assert 3.0 <= float(seconds) < 3.0 + 2.0, out[1]      # the job timeout + the daemon's check interval
    assert out[0].startswith("CollectiveTimeout peer=0") and "recv from rank 0" in out[0], out[0]


def rank_size_mismatch(rank: int, world: int) -> str:
    from mccl_common.errors import MCCLError
    comm, _store = connect(rank, world, comm_id=0x5123, timeout_s=20.0)
    buf = np.zeros(2, dtype=np.int64)
    started = time.monotonic()
    try:
        if rank == 0:
            comm.wait(comm.send(buf.ctypes.data, 8, 1, 0), 30)
            comm.wait(comm.barrier(), 30)
        else:
            comm.wait(comm.recv(buf.ctypes.data, 16, 0, 0), 30)
    except MCCLError as e:
        return verdict(e, started)
    return "no error"


@pytest.mark.timeout(90)
def test_recv_of_another_size_fails_both_ranks_with_mismatch(daemon):  # noqa: F811
    _d, env = daemon
    for line in run_ranks(rank_size_mismatch, 2, env=env, timeout_s=60):
        assert line.startswith("CollectiveMismatch peer=0") and "rank 0 sent 8 bytes" in line, line
        assert float(line.split()[3]) < 5.0, line


def test_mailbox_matches_exactly_and_in_order():
    from mccl_common.errors import CollectiveMismatch, ProtocolError
    from mccld.p2p import Mailbox, Message, Posted

    def msg(src, tag, fill, n=2):
        return Message(src, 0, tag, np.full(n, fill, dtype=np.uint8))

    box = Mailbox()
    # sent before posted: held, then taken oldest-first per (src, tag)
    for m in (msg(1, 5, 10), msg(2, 5, 20), msg(1, 5, 11), msg(1, 6, 12)):
        assert box.deliver(m) is None
    assert box.post(Posted(b"c", 1, 0, 1, 6, 2, post=1)).data[0] == 12    # by tag, not arrival
    assert box.post(Posted(b"c", 2, 0, 1, 5, 2, post=2)).data[0] == 10
    assert box.post(Posted(b"c", 3, 0, -1, 5, 2, post=3)).data[0] == 20   # any source: oldest held
    assert box.post(Posted(b"c", 4, 0, 2, 5, 2, post=4)) is None          # rank 2 sent nothing more
    assert box.take(0, 2).data[0] == 10 and box.take(0, 3).src == 2
    assert box.post(Posted(b"c", 5, 0, -1, 5, 2, post=5)).data[0] == 11   # the last one held
    # posted before sent: the oldest posted recv that accepts the message gets it
    assert box.post(Posted(b"c", 6, 0, -1, 5, 2, post=6)) is None
    assert box.deliver(msg(1, 5, 13)).post == 6     # rank 2's recv (post 4) does not accept rank 1
    assert box.deliver(msg(2, 5, 21)).post == 4
    assert box.waiting() == [] and box.take(0, 4).data[0] == 21
    box.post(Posted(b"c", 7, 0, 1, 7, 2, post=7))
    with pytest.raises(CollectiveMismatch, match="rank 1 sent 3 bytes with tag 7"):
        box.deliver(msg(1, 7, 0, n=3))
    assert [p.post for p in box.waiting()] == [7]     # still there: the job's failure reaches it
    with pytest.raises(ProtocolError, match="no matched message"):
        box.take(0, 99)


def test_mailbox_caps_unreceived_bytes(monkeypatch):
    from mccl_common.errors import CollectiveMismatch
    from mccld import p2p
    monkeypatch.setattr(p2p, "_HELD_CAP_BYTES", 100)
    box = p2p.Mailbox()
    for i in range(2):
        assert box.deliver(p2p.Message(1, 0, 5, np.full(40, i, dtype=np.uint8))) is None
    with pytest.raises(CollectiveMismatch, match="more than .* unreceived"):
        box.deliver(p2p.Message(1, 0, 5, np.zeros(40, dtype=np.uint8)))
    # a recv that takes one makes room again; a message a posted recv takes is never held
    assert box.post(p2p.Posted(b"c", 1, 0, 1, 5, 40, post=1)).data[0] == 0
    assert box.deliver(p2p.Message(1, 0, 5, np.zeros(40, dtype=np.uint8))) is None
    box.post(p2p.Posted(b"c", 2, 0, 2, 5, 1000, post=2))
    assert box.deliver(p2p.Message(2, 0, 5, np.zeros(1000, dtype=np.uint8))).post == 2
    box.forget(0)
    assert box.deliver(p2p.Message(1, 0, 5, np.zeros(100, dtype=np.uint8))) is None
