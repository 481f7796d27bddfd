"""Device gates through mccld (libmccl/daemon/gates.py): the client's queue holds every op
behind a gate until its ticket is raised, a unified all-reduce raises ``done`` only with the
result in place, and a poisoned or never-raised ticket fails the ranks with a named error
instead of hanging. One mccld in the test process, ranks spawned (test_daemon_attach.py).

The whole collectives' cases on device tensors through mccld are in
test_device_collectives.py; these are the protocol's edges.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from support.ranks import run_ranks
from support.daemon import F32, SUM, connect

SMALL, LARGE = 16, 1 << 18      # the fast path's size and a pipelined one (1 MB of floats)


def _not_done(comm, op: int) -> bool:
    from mccl_common.errors import CollectiveTimeout
    try:
        comm.wait(op, 0.05)
    except CollectiveTimeout:
        return True
    return False


def rank_gated(rank: int, world: int) -> list[str]:
    from libmccl import _core
    comm, _store = connect(rank, world, comm_id=0x6a7e)
    out = []
    for n in (SMALL, LARGE):
        ready = _core.Ticket()
        a = np.zeros(n, dtype=np.float32)
        comm.gate(ready, 0, 1)
        op = comm.allreduce(a.ctypes.data, a.size, F32, SUM)
        barrier = comm.barrier()
        time.sleep(0.3)
        held = _not_done(comm, op) and _not_done(comm, barrier)
        a[:] = rank + 1            # the "device" writes the input after the call returned ...
        ready.signal(1)            # ... and only then raises the ticket
        comm.wait(op, 20)
        comm.wait(barrier, 20)
        out.append(f"{n} held={held} ok={bool((a == 3).all())}")
    # A unified all-reduce's tickets (device_order.OrderedOp): done means the result is in place.
    ready, done = _core.Ticket(), _core.Ticket()
    a = np.zeros(LARGE, dtype=np.float32)
    base = 1 << 40
    op = comm.allreduce(a.ctypes.data, a.size, F32, SUM, ready=ready, done=done, base=base)
    time.sleep(0.2)
    early = done.value
    a[:] = rank + 1
    ready.signal(base + a.nbytes)
    done.wait(base + a.nbytes, 20, "test done")
    out.append(f"unified early={early} ok={bool((a == 3).all())}")
    comm.wait(op, 20)
    comm.shutdown(10)
    out.append(f"watchers left={sum(t.name.startswith('mccl-daemon-gate') for t in threading.enumerate())}")
    return out


@pytest.mark.timeout(120)
def test_ops_wait_for_their_gate_and_done_follows_the_result(daemon):  # noqa: F811
    d, env = daemon
    for lines in run_ranks(rank_gated, 2, env=env):
        assert lines == [f"{SMALL} held=True ok=True", f"{LARGE} held=True ok=True",
                         "unified early=0 ok=True", "watchers left=0"], lines


def rank_bad_gate(rank: int, world: int, how: str) -> str:
    from libmccl import _core
    from mccl_common.errors import MCCLError
    comm, _store = connect(rank, world, comm_id=0x6a7f, timeout_s=3)
    a = np.ones(SMALL, dtype=np.float32)
    done = _core.Ticket()
    if rank == 0:
        ready = _core.Ticket()
        comm.gate(ready, 0, 1)
        if how == "poisoned":
            threading.Timer(0.3, ready.poison).start()
        # "never": nothing raises it; the gate's deadline is the communicator's timeout
    started = time.monotonic()
    op = comm.allreduce(a.ctypes.data, a.size, F32, SUM, done=done)
    try:
        comm.wait(op, 30)
        result = "no error"
    except MCCLError as e:
        result = f"{type(e).__name__} after {time.monotonic() - started:.1f}s: {e}"
    comm.shutdown(5)
    return f"{result} | done poisoned={done.poisoned}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["poisoned", "never"])
def test_a_gate_that_never_opens_fails_the_ranks_naming_it(daemon, how):  # noqa: F811
    d, env = daemon
    mine, peer = run_ranks(rank_bad_gate, 2, how, env=env)
    want = "AbortedError" if how == "poisoned" else "CollectiveTimeout"
    assert mine.startswith(want) and "device gate" in mine and mine.endswith("done poisoned=True"), mine
    if how == "never":
        assert "Timed out" in mine and float(mine.split()[2].rstrip("s:")) < 10, mine
    # The peer's op is failed too (rank 0 left the job), and nothing hung past the timeouts.
    assert not peer.startswith("no error") and peer.endswith("done poisoned=True"), peer
