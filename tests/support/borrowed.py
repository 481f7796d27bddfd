"""Engine communicators on sockets the caller connected (as mccld builds them): a mesh of
connected TCP pairs and an all-reduce check over it."""

from __future__ import annotations

import random
import socket

import numpy as np

from libmccl import _core

from .engine import DT, SUM, job_secret, make_options, ptr, run_ranks, run_threads

K = 2


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


class Mesh:
    """K connected sockets between every two of n ranks; socks[r][p] are rank r's ends."""

    def __init__(self, n: int, tcp: bool = True):
        self.n = n
        self.socks: list[dict[int, list[socket.socket]]] = [{} for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                pairs = [tcp_pair() if tcp else socket.socketpair() for _ in range(K)]
                self.socks[i][j] = [a for a, _ in pairs]
                self.socks[j][i] = [b for _, b in pairs]

    def fds(self, r: int) -> dict[int, list[int]]:
        return {p: [s.fileno() for s in socks] for p, socks in self.socks[r].items()}

    def build(self, comm_ids: list[int] | None = None, secrets: list[bytes | None] | None = None, **kw) -> list:
        """One communicator per rank on these sockets; ``secrets`` (one per rank) default to
        the test process's job secret."""
        cid = random.getrandbits(63)
        ids = comm_ids or [cid] * self.n
        opts = make_options(sockets_per_peer=K, connect_timeout_s=kw.pop("connect_timeout_s", 10.0), **kw)
        keys = secrets or [job_secret(opts)] * self.n
        addrs = [f"127.0.0.1:{1000 + r}" for r in range(self.n)]   # names for messages only
        return run_threads(self.n, lambda r: _core.Communicator(r, self.n, ids[r], self.fds(r), addrs, opts,
                                                                secret=keys[r]))

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for per_rank in self.socks:
            for socks in per_rank.values():
                for s in socks:
                    s.close()


def allreduce_check(comms, count: int) -> None:
    def body(r, c):
        a = np.full(count, r + 1, dtype=np.float32)
        c.wait(c.allreduce(ptr(a), count, DT[a.dtype], SUM), 30)
        assert np.all(a == sum(range(1, len(comms) + 1)))
        b = np.arange(16, dtype=np.int64) * (r + 1) if r == 0 else np.zeros(16, dtype=np.int64)
        c.wait(c.broadcast(ptr(b), b.nbytes, 0), 30)
        assert np.array_equal(b, np.arange(16, dtype=np.int64))
        out = np.zeros(len(comms) * 4, dtype=np.int32)
        mine = np.full(4, r, dtype=np.int32)
        c.wait(c.allgather(ptr(mine), ptr(out), mine.nbytes), 30)
        assert np.array_equal(out, np.repeat(np.arange(len(comms), dtype=np.int32), 4))
        c.wait(c.barrier(), 30)
    run_ranks(comms, body)


def send_0_to_3(rank: int, comm) -> None:
    """Rank 0 sends 64 int32s to rank 3, which receives them from any source (tag 7)."""
    x = np.arange(64, dtype=np.int32)
    if rank == 0:
        comm.wait(comm.send(ptr(x), x.nbytes, 3, 7), 30)
    elif rank == 3:
        got = np.zeros(64, dtype=np.int32)
        comm.wait(comm.recv(ptr(got), got.nbytes, -1, 7), 30)
        assert np.array_equal(got, x)


def alltoall_check(rank: int, comm) -> None:
    """An all-to-all of 4 int32s per pair; each block says who sent it to whom."""
    n = comm.size
    send = np.arange(n * 4, dtype=np.int32) + 100 * rank
    out = np.zeros(n * 4, dtype=np.int32)
    comm.wait(comm.alltoall(ptr(send), ptr(out), 16), 30)
    assert np.array_equal(out, np.concatenate([np.arange(rank * 4, rank * 4 + 4) + 100 * s for s in range(n)]))
