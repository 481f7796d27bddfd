"""Asynchronous use: many ops in flight, DDP comm hooks chaining futures, re-init."""

from __future__ import annotations

import datetime
import os
import time

import pytest

from support.ranks import free_port, init_pg
from support.engine import run_threads

IN_FLIGHT = 40


def _in_flight_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    init_pg(rank, world)
    try:
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        if rank == world - 1:
            # The last rank issues its ops only once every other rank issued all of its own: no
            # op can complete before, so on the other ranks every op below is provably in flight
            # together, and an issue that blocked would never let them get there (the event,
            # where a wall-clock bound on issuing once stood).
            store.wait([f"issued/{r}" for r in range(world - 1)], datetime.timedelta(seconds=60))
        tensors = [torch.full((1000 + i,), float(rank + i)) for i in range(IN_FLIGHT)]
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        gathers = [torch.empty(world * 3, dtype=torch.int64) for _ in range(IN_FLIGHT // 4)]
        works += [dist.all_gather_into_tensor(g, torch.full((3,), rank + i, dtype=torch.int64), async_op=True)
                  for i, g in enumerate(gathers)]
        if rank != world - 1:
            assert not any(w.is_completed() for w in works), "an op completed before every rank issued it"
            store.set(f"issued/{rank}", "1")
        for w in works:
            assert w.wait()
        assert all(w.is_completed() and w.is_success() for w in works)
        total = sum(range(world))
        for i, t in enumerate(tensors):
            assert torch.equal(t, torch.full((1000 + i,), float(total + world * i))), i
        for i, g in enumerate(gathers):
            want = torch.cat([torch.full((3,), r + i, dtype=torch.int64) for r in range(world)])
            assert torch.equal(g, want), i
        # Futures complete with the op's outputs.
        t = torch.ones(4)
        fut = dist.all_reduce(t, async_op=True).get_future()
        assert torch.equal(fut.wait()[0], torch.full((4,), float(world)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_many_async_ops_in_flight(ranks) -> None:
    ranks(_in_flight_rank, 3, timeout_s=100)


def _hook_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_pg(rank, world)
    calls = []

    def chained_hook(state, bucket):
        # allreduce -> divide -> record: two chained callbacks on the work's future.
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def divide(f):
            return f.value()[0].div_(world)

        def record(f):
            calls.append(bucket.index())
            return f.value()
        return fut.then(divide).then(record)

    def train(hook):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
        if hook is not None:
            model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    try:
        plain = train(None)
        chained = train(chained_hook)
        assert calls, "the comm hook never ran"
        fp16 = train(default_hooks.fp16_compress_hook)
        for a, b, c in zip(plain, chained, fp16):
            assert torch.allclose(a, b, atol=1e-6)
            assert torch.allclose(a, c, atol=1e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ddp_comm_hook_chaining_futures(ranks) -> None:
    ranks(_hook_rank, 2, timeout_s=100)


def _reinit_rank(rank: int, world: int, second_port: int) -> None:
    import torch
    import torch.distributed as dist

    # One store for every incarnation: keys of the first group must not leak into the next.
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    for round_ in range(3):
        dist.init_process_group("mccl", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.full((5,), float(rank + round_))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((5,), float(sum(range(world)) + world * round_))), (round_, t)
        dist.destroy_process_group()
    # And through env:// (a fresh store each time), as torchrun-style scripts do.
    init_pg(rank, world, port=second_port)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(world)))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_reinit_after_destroy(ranks) -> None:
    ranks(_reinit_rank, 3, free_port(), timeout_s=100)


# -- unit tests: ranks as threads, and the completion router on its own ------------


@pytest.mark.timeout(60)
def test_process_groups_as_threads() -> None:
    """ProcessGroupMCCL driven directly (no init_process_group), ranks as threads."""
    import torch
    import torch.distributed as dist

    from libmccl.torch.backend import ProcessGroupMCCL

    world, store = 3, dist.HashStore()

    def rank_fn(rank: int):
        pg = ProcessGroupMCCL(dist.PrefixStore("t/", store), rank, world, datetime.timedelta(seconds=30))
        try:
            t = torch.full((10,), float(rank))
            works = [pg.allreduce([t])]
            out = torch.empty(world * 2, dtype=torch.int32)
            works.append(pg.all_gather_single(out, torch.full((2,), rank, dtype=torch.int32)))
            a2a = torch.empty(world, dtype=torch.int64)
            works.append(pg.all_to_all_single(a2a, torch.arange(world) + 10 * rank, [], []))
            for w in works:
                w.wait()
            assert works[0].get_future().value()[0] is t
            return t.tolist(), out.tolist(), a2a.tolist(), pg.getBackendName()
        finally:
            pg.shutdown()
            pg.shutdown()  # idempotent

    for rank, (t, out, a2a, name) in enumerate(run_threads(world, rank_fn)):
        assert t == [float(sum(range(world)))] * 10
        assert out == [r for r in range(world) for _ in range(2)]
        assert a2a == [10 * s + rank for s in range(world)]
        assert name == "mccl"


@pytest.mark.timeout(30)
def test_router_early_completion_fail_all_and_guard() -> None:
    import torch

    from mccl_common.errors import AbortedError, MCCLError, PeerLostError
    from libmccl.torch.work import CompletionRouter, MCCLWork

    router = CompletionRouter(rank=0)
    # The engine may report an op before the glue recorded it.
    router.on_complete([(7, None, 3)])
    early = router.track(7, MCCLWork("recv", 0, [torch.ones(1)], (), None, 5.0))
    assert early.wait() and early.source_rank() == 3
    # Errors arrive typed, with the peer.
    failed = router.track(8, MCCLWork("allreduce", 0, [], (), None, 5.0))
    router.on_complete([(8, (1, "[engine] link to rank 2 lost", 2, "10.0.0.2:4000"), -1)])
    with pytest.raises(PeerLostError) as info:
        failed.wait()
    assert info.value.peer_rank == 2 and info.value.peer_addr == "10.0.0.2:4000"
    # A callback waiting on an unfinished op from the completion thread fails fast
    # instead of deadlocking the engine's completion thread.
    blocked = router.track(10, MCCLWork("allreduce", 0, [], (), None, 30.0))
    seen = []

    def hook(fut):
        try:
            blocked.wait()
        except MCCLError as exc:
            seen.append(exc)
    router.track(9, MCCLWork("barrier", 0, [], (), None, 5.0)).get_future().then(hook)
    router.on_complete([(9, None, -1)])
    assert seen and "completion thread" in str(seen[0])
    # Shutdown fails what is pending and anything tracked later.
    router.fail_all(AbortedError("[mccl] shut down"))
    with pytest.raises(AbortedError):
        blocked.wait()
    late = router.track(11, MCCLWork("barrier", 0, [], (), None, 5.0))
    with pytest.raises(AbortedError):
        late.wait()
    assert router.pending_count() == 0


@pytest.mark.timeout(30)
def test_wait_times_out_in_caller_thread() -> None:
    from mccl_common.errors import CollectiveTimeout
    from libmccl.torch.work import CompletionRouter, MCCLWork

    router = CompletionRouter(rank=1)
    work = router.track(1, MCCLWork("broadcast", 1, [], (), None, 0.2))
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"^\[mccl\] Timed out after 0\.3 s waiting for broadcast on rank 1"):
        work.wait(datetime.timedelta(seconds=0.3))
    assert 0.25 < time.monotonic() - started < 2
    assert not work.is_completed()


def _destroy_after_big_rank(rank: int, world: int, ports: list[int]) -> list[str]:
    import torch
    import torch.distributed as dist

    errors = []
    for i, port in enumerate(ports):
        init_pg(rank, world, timeout_s=60, port=port)
        big = torch.ones(16 << 20)
        try:
            dist.all_reduce(big)
            dist.all_reduce(big)
        except Exception as exc:  # noqa: BLE001 - collected and reported by the test
            errors.append(f"round {i}: {type(exc).__name__}: {exc}")
        dist.destroy_process_group()
    return errors


@pytest.mark.timeout(180)
def test_destroy_right_after_large_allreduce(ranks) -> None:
    """The end of every training script: the fastest rank tears down while slower
    ones still finish the last all-reduce. That must never fail them."""
    errors = ranks(_destroy_after_big_rank, 4, [free_port() for _ in range(4)], timeout_s=170)
    assert not any(errors), "\n".join(f"rank {r}: {e}" for r, errs in enumerate(errors) for e in errs)
