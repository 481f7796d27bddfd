"""Timeouts read "Timed out ..." as torch's own backends word them (user code and torch
tooling match on it), right after our "[component]" prefix, with our detail after it:
the engine's collective deadline and wait, and mccld's job deadline. Work.wait's own
backstop is checked in test_work_futures.py."""

from __future__ import annotations

import re

import time

import numpy as np
import pytest

from support.ranks import run_ranks
from mccl_common.errors import CollectiveTimeout
from support.daemon import connect
from support.engine import DT, SUM, make_options, ptr, ranks


@pytest.mark.timeout(60)
def test_engine_collective_deadline_and_wait_say_timed_out() -> None:
    with ranks(2, opts=make_options(timeout_s=1.0)) as comms:
        a = np.zeros(1000, np.float32)
        op = comms[0].allreduce(ptr(a), a.size, DT[a.dtype], SUM)  # rank 1 never calls it
        with pytest.raises(CollectiveTimeout,
                           match=r"^\[engine\] Timed out after 0\.2 s waiting for op #\d+; it is still running"):
            comms[0].wait(op, 0.2)
        with pytest.raises(CollectiveTimeout) as info:
            comms[0].wait(op, 20)
    assert info.value.peer_rank == 1
    assert info.value.args[0].startswith("[allreduce] Timed out after 1.0 s in op #"), info.value
    assert "waiting for" in str(info.value) and "rank 1" in str(info.value), info.value


def _rank_skips_the_collective(rank: int, world: int) -> str:
    comm, _store = connect(rank, world, comm_id=0x71e0, timeout_s=2.0)
    a = np.ones(16, dtype=np.float32)
    try:
        if rank == 0:
            with pytest.raises(CollectiveTimeout) as info:
                comm.wait(comm.allreduce(a.ctypes.data, a.size, DT[a.dtype], SUM), 30)
            return str(info.value)
        time.sleep(4.0)  # never submits the all-reduce
        return ""
    finally:
        comm.shutdown(5)


@pytest.mark.timeout(90)
def test_daemon_job_deadline_says_timed_out(daemon) -> None:  # noqa: F811
    _d, env = daemon
    message = run_ranks(_rank_skips_the_collective, 2, env=env, timeout_s=60)[0]
    # A small op times out in mccld's native dispatcher ("2.0 s"), a larger one in its job
    # worker ("2s"): both say it torch's way first.
    assert re.match(r"\[daemon\] Timed out after 2(\.0 )?s in job ", message), message
    assert re.search(r"local rank\(s\) \[1\] did not submit (collective #1|their next small collective)", message), \
        message
