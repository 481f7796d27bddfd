"""Failures: a peer SIGKILLed or SIGSTOPped mid-collective, ranks that disagree on
sizes or ops, and bad arguments. Errors are typed, arrive within the timeout, and
never corrupt memory next to the buffers."""

from __future__ import annotations

import datetime
import os
import signal
import tempfile
import time

import pytest

from support.ranks import collect, free_port, init_pg, reap, spawn_ranks

BIG = 16 << 20  # elements (64 MB of float32): a kill lands mid-transfer


def _loop_allreduce(rank: int, world: int, marker_dir: str, timeout_s: float) -> tuple[str, str, float]:
    """All-reduce big tensors until something fails; report what was raised."""
    import torch
    import torch.distributed as dist

    init_pg(rank, world, timeout_s=timeout_s)
    t = torch.ones(BIG)
    dist.all_reduce(t)  # links are up everywhere
    open(os.path.join(marker_dir, f"rank{rank}"), "w").close()
    try:
        for _ in range(10_000):
            dist.all_reduce(t)
        return ("nothing", "", 0.0)
    except Exception as exc:  # noqa: BLE001 - the type is the result
        failed_at = time.time()
        names = [c.__name__ for c in type(exc).__mro__]
        return (type(exc).__name__, f"{names} {exc}", failed_at)


def _wait_markers(marker_dir: str, world: int, procs: list, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(marker_dir)) < world:
        assert time.monotonic() < deadline, f"ranks never started their loop: {os.listdir(marker_dir)}"
        assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
        time.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [3, 4])
def test_sigkill_mid_allreduce_raises_peer_lost_everywhere(world: int) -> None:
    timeout_s = 30.0
    with tempfile.TemporaryDirectory() as marker_dir:
        procs, results, _ = spawn_ranks(_loop_allreduce, world, marker_dir, timeout_s)
        try:
            _wait_markers(marker_dir, world, procs)
            time.sleep(0.2)  # inside an all-reduce by now (each takes far longer)
            victim = 1
            killed_at = time.time()
            os.kill(procs[victim].pid, signal.SIGKILL)
            out = collect(procs, results, timeout_s + 30, expect=world - 1)
        finally:
            reap(procs)
    for rank, (status, value) in sorted(out.items()):
        assert status == "ok", f"rank {rank}:\n{value}"
        name, detail, failed_at = value
        assert "PeerLostError" in detail, f"rank {rank} raised {name}: {detail}"
        assert failed_at - killed_at < timeout_s, f"rank {rank} took {failed_at - killed_at:.1f}s to notice"


@pytest.mark.timeout(180)
def test_sigstop_peer_times_out() -> None:
    world, timeout_s = 3, 8.0
    with tempfile.TemporaryDirectory() as marker_dir:
        procs, results, _ = spawn_ranks(_loop_allreduce, world, marker_dir, timeout_s)
        try:
            _wait_markers(marker_dir, world, procs)
            stopped_at = time.time()
            os.kill(procs[2].pid, signal.SIGSTOP)
            out = collect(procs, results, timeout_s * 4 + 30, expect=world - 1)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGCONT)
            reap(procs)
    for rank, (status, value) in sorted(out.items()):
        assert status == "ok", f"rank {rank}:\n{value}"
        name, detail, failed_at = value
        # The stopped rank's links stay open: only a deadline can notice it. The PG
        # timeout reached the engine: its deadline fires, before the glue's backstop
        # (timeout + 5 s) in Work.wait would.
        assert "CollectiveTimeout" in detail, f"rank {rank}: {detail}"
        took = failed_at - stopped_at
        # (The deadline counts from when the op began, which may precede the stop.)
        assert timeout_s / 2 < took < timeout_s + 4, f"rank {rank}: {took:.1f}s"


def _guarded(n: int, pad: int = 4096):
    import torch

    big = torch.full((pad + n + pad,), -7.0)
    return big, big[pad:pad + n]


def _mismatch_rank(rank: int, world: int, ports: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    from mccl_common.errors import CollectiveMismatch, MCCLError

    seen = {}
    # 1) all-reduce with a different element count on rank 1.
    init_pg(rank, world, timeout_s=20, port=ports[0])
    n = 1000 + (512 if rank == 1 else 0)
    big, buf = _guarded(n)
    buf.fill_(1.0)
    bystander = torch.arange(100.0)
    try:
        dist.all_reduce(buf)
        seen["allreduce"] = "no error"
    except MCCLError as exc:
        seen["allreduce"] = type(exc).__name__
        assert isinstance(exc, CollectiveMismatch), exc
        assert "1000" in str(exc) or "4000" in str(exc), f"message does not name the sizes: {exc}"
    pad = big[:4096], big[4096 + n:]
    assert all(bool((p == -7.0).all()) for p in pad), "memory next to the buffer was overwritten"
    assert torch.equal(bystander, torch.arange(100.0))
    dist.destroy_process_group()

    # 2) all-gather with different sizes (the receive buffer is sized from the local input).
    init_pg(rank, world, timeout_s=20, port=ports[1])
    m = 300 if rank == 0 else 200
    big, out = _guarded(world * m)
    try:
        dist.all_gather_into_tensor(out, torch.full((m,), float(rank)))
        seen["allgather"] = "no error"
    except MCCLError as exc:
        seen["allgather"] = type(exc).__name__
    assert bool((big[:4096] == -7.0).all()) and bool((big[4096 + world * m:] == -7.0).all())
    dist.destroy_process_group()

    # 3) different collectives on different ranks (both exchange data both ways).
    init_pg(rank, world, timeout_s=20, port=ports[2])
    t = torch.ones(64)
    try:
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.all_gather_into_tensor(torch.empty(world * 32), torch.ones(32))
        seen["op"] = "no error"
    except MCCLError as exc:
        seen["op"] = type(exc).__name__
    dist.destroy_process_group()

    # 4) A broadcast root only sends: it may finish before the receiver notices, but the
    # receiver must refuse data sized for another collective.
    init_pg(rank, world, timeout_s=20, port=ports[3])
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(64))
        else:
            dist.broadcast(torch.ones(64), src=1)
        seen["broadcast"] = "no error"
    except MCCLError as exc:
        seen["broadcast"] = type(exc).__name__
    dist.destroy_process_group()
    return seen


@pytest.mark.timeout(180)
def test_size_and_op_mismatch_raise_collective_mismatch(ranks) -> None:
    seen = ranks(_mismatch_rank, 2, [free_port() for _ in range(4)], timeout_s=150)
    for rank in range(2):
        assert {k: seen[rank][k] for k in ("allreduce", "allgather", "op")} == {
            "allreduce": "CollectiveMismatch", "allgather": "CollectiveMismatch", "op": "CollectiveMismatch"}, seen
    assert seen[0]["broadcast"] == "CollectiveMismatch", seen


def _skipped_rank(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    from mccl_common.errors import CollectiveTimeout

    init_pg(rank, world, timeout_s=60)
    try:
        if rank == 0:
            work = dist.all_reduce(torch.ones(10), async_op=True)
            started = time.monotonic()
            with pytest.raises(CollectiveTimeout):
                work.wait(datetime.timedelta(seconds=1.5))
            return time.monotonic() - started
        time.sleep(3)  # rank 1 never issues the all-reduce
        return 0.0
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_wait_with_timeout_raises_in_caller(ranks) -> None:
    waited = ranks(_skipped_rank, 2, timeout_s=100)[0]
    assert 1.4 < waited < 5, waited


def _set_timeout_rank(rank: int, world: int) -> tuple[float, str]:
    import torch
    import torch.distributed as dist

    from mccl_common.errors import CollectiveTimeout, ConfigError

    init_pg(rank, world, timeout_s=60)
    try:
        pg = dist.group.WORLD
        with pytest.raises(ConfigError, match="must be positive"):
            pg.set_timeout(datetime.timedelta(seconds=0))
        pg.set_timeout(datetime.timedelta(seconds=1))
        if rank == 0:
            work = dist.all_reduce(torch.ones(10), async_op=True)
            started = time.monotonic()
            # wait() may take 30 s: only the engine's own (new) deadline can end it sooner.
            with pytest.raises(CollectiveTimeout) as info:
                work.wait(datetime.timedelta(seconds=30))
            return time.monotonic() - started, str(info.value)
        time.sleep(4)  # rank 1 never issues the all-reduce
        return 0.0, ""
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_set_timeout_bounds_the_engines_per_op_deadline(ranks) -> None:
    waited, msg = ranks(_set_timeout_rank, 2, timeout_s=100)[0]
    assert 0.9 < waited < 4, (waited, msg)
    assert "rank 1" in msg, msg


def _bad_args_rank(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from libmccl.torch import compat
    from mccl_common.errors import ConfigError

    init_pg(rank, world)
    messages = []

    def refused(fn, *words):
        with pytest.raises(ConfigError) as info:
            fn()
        text = str(info.value)
        # "[component] what failed ...": the glue's checks say [mccl], the engine's [reduce].
        assert text.startswith("[") and all(w.lower() in text.lower() for w in words), text
        messages.append(text)

    try:
        refused(lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND), "BAND")
        refused(lambda: dist.all_reduce(torch.ones(3).to(torch.float8_e4m3fn)), "float8")
        premul = compat.premul_sum(2.0)
        refused(lambda: dist.all_reduce(torch.ones(3), op=premul), "PREMUL_SUM")
        refused(lambda: dist.all_gather([torch.empty(3)], torch.ones(3)), "output_tensors", "expected 2")
        refused(lambda: dist.all_gather([torch.empty(3), torch.empty(4)], torch.ones(3)), "4 elements")
        refused(lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3)), "expected 6")
        refused(lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(7)), "expected 6")
        refused(lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [1, 3], [1, 1]), "split_sizes")
        refused(lambda: dist.broadcast(torch.ones(2), src=5), "root=5")
        # torch refuses self-sends itself; reach the group directly to check ours.
        refused(lambda: dist.group.WORLD.send([torch.ones(2)], rank, 0), "itself")
        refused(lambda: dist.all_reduce(torch.ones(2).to_sparse()), "layout")
        # After all those refusals the group is intact: nothing reached the engine.
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(world)))
        # Complex SUM is element-wise on (re, im) and allowed.
        c = torch.full((2,), 1 + 2j, dtype=torch.complex64)
        dist.all_reduce(c)
        assert torch.equal(c, torch.full((2,), world * (1 + 2j), dtype=torch.complex64))
    finally:
        dist.destroy_process_group()
    return messages


@pytest.mark.timeout(120)
def test_bad_arguments_are_refused_clearly(ranks) -> None:
    messages = ranks(_bad_args_rank, 2, timeout_s=100)[0]
    assert len(messages) == 11


def _param_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    init_pg(rank, world)
    try:
        # A non-contiguous view of a parameter: staged, then copied back under no_grad.
        weight = torch.nn.Parameter(torch.full((4, 3), float(rank)))
        dist.broadcast(weight.t(), src=1)
        assert torch.equal(weight.detach(), torch.full((4, 3), 1.0)) and weight.requires_grad
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_collective_on_parameter_view(ranks) -> None:
    ranks(_param_rank, 2, timeout_s=50)
