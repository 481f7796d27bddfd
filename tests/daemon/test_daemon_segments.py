"""A client that truncates its registered segment (issue 11): mccld used to die of SIGBUS on
the op's first touch past the new end. Now the op's job fails with a ProtocolError naming
the segment, and the daemon (a subprocess here, so a SIGBUS shows as its exit) serves the
next job."""

from __future__ import annotations

import os
import time

import pytest

from support.daemon import RawClient

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
        assert c.call({"type": "register", "job": job, "rank": r, "segment": segs[r].name, "nbytes": BIG})["ok"]
    return segs


def allreduce(c: RawClient, job: str, rank: int, seq: int, seg: shm.Segment) -> None:
    c.send({"type": "op", "job": job, "rank": rank, "seq": seq, "op": "allreduce",
            "args": {**ALLREDUCE, "segment": seg.name}})


def truncate(seg: shm.Segment) -> None:
    """What a buggy client does to its own segment: the file shrinks under every mapping."""
    fd = os.open(f"/dev/shm/{seg.name}", os.O_RDWR)
    try:
        os.ftruncate(fd, shm.HEADER_BYTES)
    finally:
        os.close(fd)


def next_job_works(rdir, host: str, job: str) -> None:
    c = RawClient(rdir)
    try:
        (seg,) = join([c], host, job)
        allreduce(c, job, 0, 1, seg)
        assert c.recv(20)["ok"], "mccld did not serve the next job"
        seg.close()
        seg.unlink()
    finally:
        c.close()


def names_segment(reply: dict | None, seg: shm.Segment) -> bool:
    return (reply is not None and not reply["ok"] and reply["error"]["kind"] == "ProtocolError"
            and seg.name in reply["error"]["message"] and "truncated" in reply["error"]["message"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["after_register", "while_pending"])
def test_a_truncated_segment_fails_its_job_and_mccld_lives(mccld_proc, when):  # noqa: F811
    proc, rdir, host = mccld_proc
    clients = [RawClient(rdir), RawClient(rdir)]
    segs: list[shm.Segment] = []
    try:
        segs = join(clients, host, "d11")
        if when == "after_register":
            truncate(segs[0])
            allreduce(clients[0], "d11", 0, 1, segs[0])
        else:   # rank 0's op waits for rank 1's when the file shrinks
            allreduce(clients[0], "d11", 0, 1, segs[0])
            time.sleep(0.2)
            truncate(segs[0])
        allreduce(clients[1], "d11", 1, 1, segs[1])
        replies = [c.recv(20) for c in clients]
        assert proc.poll() is None, f"mccld died (exit {proc.returncode})"
        assert all(names_segment(r, segs[0]) for r in replies), replies
        next_job_works(rdir, host, "d12")
        assert proc.poll() is None
    finally:
        for c in clients:
            c.close()
        for s in segs:
            s.close()
            s.unlink()
