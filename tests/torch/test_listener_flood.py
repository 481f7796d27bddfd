"""The issue-34 attack on a plain job: three ranks (spawned processes, init_process_group
("mccl") with a job key); a keyless process on the same host holds 40 idle connections to
each rank's engine listening port before the last rank joins the mesh (it publishes its
address only then; each rank writes its port to a file, where a port scan would find it). Before the fix
rank 0 failed with PeerLostError ("got no answer") in seconds and rank 1 hung until the
timeout; now the job completes both of its all-reduces."""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest

from support.ranks import collect, init_pg, reap, spawn_ranks

pytestmark = pytest.mark.timeout(180)

FLOOD = 40


def _two_allreduces(rank: int, world: int, d: str) -> list[float]:
    import torch
    import torch.distributed as dist
    from libmccl import _core

    real = _core.Listener

    def listener(host: str, port: int = 0):
        # Where a port scanner would find it; the last rank publishes its address (and so
        # lets the mesh be built) only once every port holds the flood.
        lst = real(host, port)
        with open(os.path.join(d, f"port{rank}.tmp"), "w") as f:
            f.write(str(lst.port))
        os.rename(os.path.join(d, f"port{rank}.tmp"), os.path.join(d, f"port{rank}"))
        if rank == world - 1:
            until = time.monotonic() + 60
            while not os.path.exists(os.path.join(d, "go")):
                assert time.monotonic() < until, "the test never let the last rank join"
                time.sleep(0.02)
        return lst
    _core.Listener = listener
    init_pg(rank, world, timeout_s=60)
    out = []
    for step in range(2):
        t = torch.full((4096,), float(rank + 1 + step))
        dist.all_reduce(t)
        out.append(float(t[0]))
    dist.destroy_process_group()
    return out


def port_of(d: str, rank: int, procs: list, within_s: float = 60.0) -> int:
    path = os.path.join(d, f"port{rank}")
    until = time.monotonic() + within_s
    while not os.path.exists(path):
        assert time.monotonic() < until and procs[rank].is_alive(), f"rank {rank} never listened"
        time.sleep(0.02)
    return int(open(path).read())


def idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def test_three_ranks_finish_both_all_reduces_with_40_idle_connections_on_every_listening_port():
    world = 3
    with tempfile.TemporaryDirectory() as d:
        procs, results, _ = spawn_ranks(_two_allreduces, world, d)
        held: list[socket.socket] = []
        try:
            for r in range(world):
                held += idle(port_of(d, r, procs), FLOOD)
            open(os.path.join(d, "go"), "w").close()
            # Within the ranks' own 60 s timeout, or they report an error.
            out = collect(procs, results, 120)
        finally:
            reap(procs)
            for s in held:
                s.close()
    errors = {r: v for r, (s, v) in out.items() if s != "ok"}
    assert not errors, errors
    assert [out[r][1] for r in range(world)] == [[6.0, 9.0]] * world
