"""Daemon mode: all-to-all(v) and point-to-point through one mccld (the same checks run
across two hosts in test_daemon_fleet.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from support.ranks import run_ranks
from support.daemon import connect, segments_left
from support.p2p import check_alltoall, check_p2p, recv_never_matched, verdict


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
    assert segments_left(0xa2a) == []


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
    from mccld.jobs.p2p import Mailbox, Message, Posted

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
    from mccld.jobs import p2p
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
