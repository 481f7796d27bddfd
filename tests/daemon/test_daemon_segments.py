"""A client that tries to shrink its registered segment (issue 11): mccld used to die of SIGBUS
on the op's first touch past the new end, then failed the job once it checked sizes before each
op. Now a segment is a sealed memfd (mccl_common/shm.py): the truncation itself fails with
EPERM, before or while an op waits, and the ops complete. mccld runs as a subprocess here, so
a SIGBUS would show as its exit."""

from __future__ import annotations

import os
import time

import pytest

from support.daemon import RawClient, hand_over, open_own_memory

from mccl_common import shm

BIG = 1 << 20
ALLREDUCE = {"count": BIG // 4, "dtype": 0, "op": 0, "offset": 0}


def join(clients: list[RawClient], host: str, job: str) -> list[shm.Segment]:
    link = [c.hello()["link_addr"] for c in clients][0]
    for r, c in enumerate(clients):
        c.send({"type": "join", "job": job, "rank": r, "size": len(clients), "timeout_s": 30.0, "opts": {},
                "hosts": [{"host_id": host, "link_addr": link, "ranks": list(range(len(clients)))}]})
    assert all(c.recv(10)["ok"] for c in clients)
    segs = []
    for r, c in enumerate(clients):
        segs.append(shm.Segment(shm.segment_name(job, r, os.getpid(), 1), BIG, create=True))
        hand_over(c.rdir, segs[r])
        assert c.call({"type": "register", "job": job, "rank": r, "segment": segs[r].name, "nbytes": BIG})["ok"]
    return segs


def allreduce(c: RawClient, job: str, rank: int, seq: int, seg: shm.Segment) -> None:
    c.send({"type": "op", "job": job, "rank": rank, "seq": seq, "op": "allreduce",
            "args": {**ALLREDUCE, "segment": seg.name}})


def try_truncate(seg: shm.Segment) -> bool:
    """What a buggy or hostile client does to its own segment, through its own mapping (the
    memory has no name to open); True if the memory shrank."""
    fd = open_own_memory(seg.name)
    try:
        os.ftruncate(fd, shm.HEADER_BYTES)
        return True
    except PermissionError:
        return False
    finally:
        os.close(fd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["after_register", "while_pending"])
def test_a_client_cannot_shrink_its_segment_and_mccld_lives(mccld_proc, when):  # noqa: F811
    proc, rdir, host = mccld_proc
    clients = [RawClient(rdir), RawClient(rdir)]
    segs: list[shm.Segment] = []
    try:
        segs = join(clients, host, "d11")
        if when == "after_register":
            assert not try_truncate(segs[0]), "a registered segment shrank"
            allreduce(clients[0], "d11", 0, 1, segs[0])
        else:   # rank 0's op waits for rank 1's when the client tries
            allreduce(clients[0], "d11", 0, 1, segs[0])
            time.sleep(0.2)
            assert not try_truncate(segs[0]), "a segment shrank under a pending op"
        allreduce(clients[1], "d11", 1, 1, segs[1])
        replies = [c.recv(20) for c in clients]
        assert proc.poll() is None, f"mccld died (exit {proc.returncode})"
        assert all(r is not None and r["ok"] for r in replies), replies
    finally:
        for c in clients:
            c.close()
        for s in segs:
            s.close()
