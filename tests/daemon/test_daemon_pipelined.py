"""The pipelined all-reduce through one mccld (mccld/jobs/pipelined.py, the client's pump).

The daemon runs in the test process with a tiny pipeline (a 1 MB op has 64 pieces);
the ranks are spawned processes. Random delays are injected on both sides of the tickets:
in the clients' copies (their ``ctypes.memmove``) and in the daemon's reductions and
copies, so every stage finds the one before it sometimes ahead, sometimes behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import numpy as np
import pytest

from mccl_common.errors import ConfigError, PeerLostError
from support.daemon import BAND, F32, SUM, connect
from support.pipelined import check_killed_rank, rank_pipelined
from support.ranks import run_ranks


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 3])
def test_pipelined_allreduce_with_random_delays_is_exact(jittery_daemon, world):
    _d, env = jittery_daemon
    assert run_ranks(rank_pipelined, world, env=env) == ["ok"] * world


def rank_refused_then_served(rank: int, world: int) -> str:
    """A pipelined op the daemon refuses (bitwise op on floats) fails alone, at once: the
    clients, already copying in and waiting on done, get the reply; the next op runs."""
    comm, _store = connect(rank, world)
    a = np.ones(1 << 18, dtype=np.float32)
    started = time.monotonic()
    try:
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, BAND), 20)
        raise AssertionError("BAND on float32 was accepted")
    except ConfigError as e:
        assert "not defined on floating-point" in str(e), e
    assert time.monotonic() - started < 5.0
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    assert (a == world).all()
    comm.shutdown(5)
    return "ok"


@pytest.mark.timeout(120)
def test_refused_pipelined_op_fails_alone(jittery_daemon):
    _d, env = jittery_daemon
    assert run_ranks(rank_refused_then_served, 2, env=env) == ["ok", "ok"]


def rank_dies_mid_op(rank: int, world: int) -> str:
    comm, _store = connect(rank, world, comm_id=0xdead05, timeout_s=30)
    a = np.ones(1 << 18, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 20)
    if rank == 1:
        import libmccl.daemon.submit as dc  # where the copies are
        calls = []

        def memmove_then_die(dst, src, n):
            calls.append(n)
            if len(calls) == 10:  # ten pieces copied in: the daemon is mid-way through the op
                os.kill(os.getpid(), signal.SIGKILL)
            return ctypes.memmove(dst, src, n)

        dc.ctypes = type("C", (), {"memmove": staticmethod(memmove_then_die)})
    started = time.monotonic()
    try:
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 25)
    except PeerLostError as e:
        assert "rank 1" in str(e) and "died" in str(e), e
        return f"PeerLostError after {time.monotonic() - started:.2f}s"
    raise AssertionError("the collective succeeded although rank 1 died")


@pytest.mark.timeout(120)
def test_client_killed_mid_pipelined_op(jittery_daemon):
    _d, env = jittery_daemon
    check_killed_rank(rank_dies_mid_op, 0xdead05, env)
    # The daemon serves the next job.
    assert run_ranks(rank_pipelined, 2, env=env) == ["ok", "ok"]
