"""A pipelined all-reduce through mccld completes when its last result is in place, not when
mccld's reply arrives (libmccl/daemon/client.py `_pump`): `done` over the whole op means
nothing of it touches the segment any more. The reply is still awaited beside the next op,
and an error in it fails the communicator from there on.

mccld runs in the test process (support.daemon's `daemon` fixture); its replies to ops are
delayed, or turned into an error, by wrapping the daemon's `reply`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from support.daemon import F32, SUM, connect
from support.ranks import run_ranks
from mccl_common.errors import PeerLostError
from mccl_common import attach_protocol as protocol

pytestmark = pytest.mark.timeout(120)

COUNT = (8 << 20) // 4   # 8 MB: over one 2 MB piece, so pipelined
DELAY_S = 3.0


def _op_reply(payload: dict) -> bool:
    return payload == {"ok": True}   # a finished op's (a join's carries its local ranks)


def _delay_op_replies(d, timers: list) -> None:
    send = d.jobs.reply

    def late(ident, req, payload):
        if not _op_reply(payload):
            return send(ident, req, payload)
        t = threading.Timer(DELAY_S, send, (ident, req, payload))
        timers.append(t)
        t.start()
    d.jobs.reply = late


def rank_times_three_ops(rank: int, world: int) -> dict:
    comm, _store = connect(rank, world, comm_id=0xea71)
    took = []
    for i in range(3):
        a = np.full(COUNT, float(rank + 1 + i), dtype=np.float32)
        t0 = time.monotonic()
        comm.wait(comm.allreduce(a.ctypes.data, COUNT, F32, SUM), 30)
        took.append(time.monotonic() - t0)
        assert (a == sum(r + 1 + i for r in range(world))).all(), f"op {i}: wrong sum"
    stats = comm.stats()
    t0 = time.monotonic()
    comm.shutdown(2 * DELAY_S + 5)   # waits for the replies still owed
    return {"took": took, "shutdown_s": time.monotonic() - t0, "pipelined_ops": stats["pipelined_ops"],
            "phases": [stats[k] for k in ("pipelined_input_in_s", "pipelined_first_result_s",
                                          "pipelined_all_results_s", "pipelined_op_s")]}


def test_ops_complete_before_mccld_replies(daemon):
    d, env = daemon
    timers: list = []
    _delay_op_replies(d, timers)
    try:
        for r in run_ranks(rank_times_three_ops, 2, env=env, timeout_s=90):
            assert max(r["took"]) < DELAY_S, f"an op waited for mccld's late reply: {r}"
            assert r["pipelined_ops"] == 3
            inp, first, last, op = r["phases"]
            assert inp <= last and first <= last <= op, r
    finally:
        for t in timers:
            t.join(DELAY_S + 5)


def rank_error_after_results(rank: int, world: int) -> str:
    comm, _store = connect(rank, world, comm_id=0xea72)
    a = np.ones(COUNT, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, COUNT, F32, SUM), 30)   # complete: its results are in place
    assert (a == world).all()
    deadline = time.monotonic() + 20
    while True:   # the error reply arrives after the op completed; the next op gets it
        try:
            comm.wait(comm.barrier(), 10)
        except PeerLostError as e:
            comm.shutdown(5)
            return str(e)
        assert time.monotonic() < deadline, "the error in mccld's late reply never surfaced"
        time.sleep(0.05)


def test_an_error_in_the_late_reply_fails_the_next_op(daemon):
    d, env = daemon
    send, sent = d.jobs.reply, []

    def failing(ident, req, payload):
        if _op_reply(payload) and len(sent) < 2:   # the first op's replies, one per rank
            sent.append(req)
            err = PeerLostError("[daemon] job 0000ea72: injected after the op's last result", peer_rank=1)
            payload = {"ok": False, "error": protocol.error_payload(err)}
        return send(ident, req, payload)
    d.jobs.reply = failing
    for msg in run_ranks(rank_error_after_results, 2, env=env, timeout_s=60):
        assert "injected after the op's last result" in msg, msg
