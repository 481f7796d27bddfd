"""A world-size-1 group (libmccl/torch/solo_comm.py): every collective gives what the engine
would, completes before the call returns, and no engine (threads, sockets) is started."""

from __future__ import annotations

import datetime
import sys

import pytest
import torch
import torch.distributed as dist

import libmccl
import libmccl.errors
from support.engine import thread_count

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def solo_group():
    libmccl.register()
    threads = thread_count()
    # A HashStore starts no thread of its own, so any new thread would be the engine's.
    dist.init_process_group("mccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield threads
    finally:
        dist.destroy_process_group()


def done_now(work) -> None:
    assert work.is_completed() and work.is_success()
    work.wait()


def test_collectives_of_one_rank(solo_group):
    x = torch.arange(10, dtype=torch.float32)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        t = x.clone()
        done_now(dist.all_reduce(t, op=op, async_op=True))
        assert torch.equal(t, x)
    strided = torch.arange(20, dtype=torch.int64)[::2]
    done_now(dist.all_reduce(strided, async_op=True))
    assert torch.equal(strided, torch.arange(0, 20, 2))
    done_now(dist.broadcast(t, 0, async_op=True))
    done_now(dist.reduce(t, 0, async_op=True))
    assert torch.equal(t, x)

    out = [torch.zeros(10)]
    done_now(dist.all_gather(out, x, async_op=True))
    assert torch.equal(out[0], x)
    flat = torch.zeros(10)
    done_now(dist.all_gather_into_tensor(flat, x, async_op=True))
    assert torch.equal(flat, x)
    rs = torch.zeros(10)
    done_now(dist.reduce_scatter(rs, [x], async_op=True))
    assert torch.equal(rs, x)
    rs2 = torch.zeros(10, dtype=torch.float16)
    done_now(dist.reduce_scatter_tensor(rs2, x.half(), async_op=True))
    assert torch.equal(rs2, x.half())
    a2a = torch.zeros(10)
    done_now(dist.all_to_all_single(a2a, x, async_op=True))
    assert torch.equal(a2a, x)
    g = [torch.zeros(10)]
    done_now(dist.gather(x, g, dst=0, async_op=True))
    assert torch.equal(g[0], x)
    s = torch.zeros(10)
    done_now(dist.scatter(s, [x], src=0, async_op=True))
    assert torch.equal(s, x)
    done_now(dist.barrier(async_op=True))
    coalesced = [x.clone(), x.clone() * 2]
    dist.all_reduce_coalesced(coalesced)
    assert torch.equal(coalesced[1], x * 2)
    # (<=: threads of earlier tests may still be winding down)
    assert thread_count() <= solo_group, "a world-size-1 group started engine threads"


def test_group_of_one_refuses_after_shutdown(solo_group):
    pg = dist.group.WORLD
    pg.shutdown()
    with pytest.raises(libmccl.errors.AbortedError):
        pg.allreduce([torch.zeros(1)])


def test_group_of_one_under_mccl_daemon_never_attaches(monkeypatch, tmp_path):
    """MCCL_DAEMON=1 with no mccld anywhere (an empty runtime dir): a group of one still works,
    on the caller's thread, because it has nothing to hand mccld."""
    monkeypatch.setenv("MCCL_DAEMON", "1")
    monkeypatch.setenv("MCCL_RUNTIME_DIR", str(tmp_path))
    libmccl.register()
    threads = thread_count()
    dist.init_process_group("mccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.arange(1 << 20, dtype=torch.float32)
        done_now(dist.all_reduce(t, async_op=True))
        assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))
        assert type(dist.group.WORLD.communicator).__name__ == "SoloCommunicator"
        assert "libmccl.daemon.client" not in sys.modules or not sys.modules["libmccl.daemon.client"]._live
        assert thread_count() <= threads
    finally:
        dist.destroy_process_group()


def test_a_ddp_step_of_one_rank_copies_stages_and_hands_off_nothing(solo_group, monkeypatch):
    """World size 1: DDP's bucket all-reduces (and a device tensor's identity ops) are done on
    the caller's thread with no staging buffer, no copy and no helper thread (the solo
    communicator's stats; the plan's allocating calls counted)."""
    from libmccl.devices import device_check, plan

    staged = []
    for name in ("input", "inout", "output", "scratch", "packed"):
        real = getattr(plan.Plan, name)
        monkeypatch.setattr(plan.Plan, name,
                            lambda self, *a, _n=name, _real=real: staged.append(_n) or _real(self, *a))
    comm = dist.group.WORLD.communicator
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    staged.clear()   # DDP's set-up all-gathers the parameters' shapes: a staged copy once, not per step
    before = comm.stats()
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 128)).square().mean().backward()
        opt.step()
    after = comm.stats()
    assert after["ops_completed"] - before["ops_completed"] >= 3 * 2, (before, after)  # buckets were reduced
    assert after["bytes_copied"] == before["bytes_copied"] and after["ops_deferred"] == 0, after
    assert staged == [], staged

    dev = device_check.emulated_cuda()
    try:
        t = dev.empty(1000, torch.float32)
        for work in (dist.all_reduce(t, async_op=True), dist.broadcast(t, 0, async_op=True),
                     dist.reduce(t, 0, async_op=True)):
            done_now(work)
    finally:
        dev.close()
    assert staged == [] and comm.stats()["ops_deferred"] == 0 and comm._helper is None
    assert thread_count() <= solo_group
