"""Nothing outlives a process group: engine threads, sockets/fds, shared memory."""

from __future__ import annotations

import os
import time

import pytest

from support.collective_suite import MODES
from support.ranks import free_port, init_pg
from support.leak_check import held_segments

CYCLES = 3


def _snapshot() -> dict:
    import threading

    tasks = os.listdir("/proc/self/task")
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread exited between listdir and open
            pass
    return {"py_threads": sorted(t.name for t in threading.enumerate()), "tasks": len(tasks),
            "task_names": sorted(names), "fds": len(os.listdir("/proc/self/fd"))}


def _settled(baseline: dict, timeout_s: float = 10.0) -> dict:
    """Wait for asynchronous teardown (threads joining, sockets closing) to finish."""
    import gc

    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        now = _snapshot()
        if (now["tasks"] <= baseline["tasks"] and now["fds"] <= baseline["fds"]) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _init(rank: int, world: int, port: int) -> None:
    init_pg(rank, world, timeout_s=30, port=port)


def _cycle(rank: int, world: int, p2p: bool, port: int) -> None:
    import torch
    import torch.distributed as dist

    _init(rank, world, port)
    t = torch.ones(1 << 16)
    works = [dist.all_reduce(t, async_op=True) for _ in range(8)]
    for w in works:
        w.wait()
    out = torch.empty(world * 10)
    dist.all_gather_into_tensor(out, torch.ones(10))
    if p2p:
        peer = (rank + 1) % world
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(100), peer),
                                       dist.P2POp(dist.irecv, torch.empty(100), (rank - 1) % world)])
        for r in reqs:
            r.wait()
    dist.barrier()
    dist.destroy_process_group()


def _leak_rank(rank: int, world: int, p2p: bool, ports: list[int]) -> dict:
    _cycle(rank, world, p2p, ports[-1])  # warm-up: torch's own lazily created state is not ours
    baseline = _settled(_snapshot(), 2.0)
    during = None
    for i in range(CYCLES):
        if i == 0:
            import torch.distributed as dist

            _init(rank, world, ports[i])
            during = _snapshot()
            dist.destroy_process_group()
        else:
            _cycle(rank, world, p2p, ports[i])
    after = _settled(baseline)
    return {"baseline": baseline, "during": during, "after": after, "shm": sorted(held_segments())}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_threads_fds_or_shm_left_after_destroy(mode: str, ranks) -> None:
    with MODES[mode].setup() as env:
        results = ranks(_leak_rank, 2, "send_recv" not in MODES[mode].unsupported,
                        [free_port() for _ in range(CYCLES + 1)], timeout_s=150, env=env)
    for rank, res in enumerate(results):
        base, during, after = res["baseline"], res["during"], res["after"]
        # The engine did run threads and hold sockets while the group was up.
        assert during["tasks"] > base["tasks"] and during["fds"] > base["fds"], (rank, base, during)
        assert after["tasks"] == base["tasks"], (rank, base["task_names"], after["task_names"])
        assert after["py_threads"] == base["py_threads"], (rank, base["py_threads"], after["py_threads"])
        assert after["fds"] == base["fds"], (rank, base["fds"], after["fds"])
        assert not [n for n in after["task_names"] if n.startswith("mccl")], after["task_names"]
        assert not res["shm"], f"rank {rank} still maps or holds {res['shm']}"
