"""All-to-all(v) and point-to-point checks a rank runs on any communicator (engine, daemon
client, on one host or across a fleet), and how a rank program words the error it expected."""

from __future__ import annotations

import time

import numpy as np

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
