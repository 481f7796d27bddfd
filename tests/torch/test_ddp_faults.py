"""A rank SIGKILLed in the middle of training: the survivor raises an MCCL error naming
the lost peer within seconds, through every torch consumer of our Works and Futures
(DDP's C++ reducer, Python and built-in comm hooks, FSDP2, functional collectives, raw
future chains), in process and through mccld; a SIGSTOPped rank makes DDP raise
"Timed out" at the process group's timeout. Before the fix DDP's reducer read a failed op's future as a
success holding an exception object and the survivor died of SIGSEGV."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest

from support.collective_suite import MODES
from support.ranks import collect, init_pg, reap, spawn_ranks

VICTIM = 1
KILL_STEP = 3
MAX_STEPS = 50
# The engine notices a reset link at once and the daemon a dead client within its
# check interval (0.1 s in tests): "a few seconds" leaves room for a loaded machine.
NOTICE_S = 8.0
PG_TIMEOUT_S = 60.0  # far above NOTICE_S: only the peer loss itself may end the step
STALL_TIMEOUT_S = 3.0  # the process group's timeout when the victim stops instead


def _model():
    import torch

    torch.manual_seed(0)
    # ~1.6 M parameters: with 1 MB buckets DDP runs several all-reduces per backward.
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 256))


def _python_allreduce_hook(state, bucket):
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer() / dist.get_world_size(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _wrap(kind: str, model):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "fsdp2":
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        return fully_shard(model)
    ddp = DDP(model, bucket_cap_mb=1)
    if kind == "ddp_python_hook":
        ddp.register_comm_hook(None, _python_allreduce_hook)
    elif kind == "ddp_fp16_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


def _steps(rank: int, marker_dir: str, sig: int = signal.SIGKILL):
    """Step numbers; the victim notes the time and kills (or stops) itself before KILL_STEP."""
    for step in range(MAX_STEPS):
        if rank == VICTIM and step == KILL_STEP:
            with open(os.path.join(marker_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), sig)
        yield step


def _outcome(exc: BaseException) -> dict:
    return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc), "at": time.time()}


def _train_rank(rank: int, world: int, kind: str, marker_dir: str, sig: int = signal.SIGKILL,
                timeout_s: float = PG_TIMEOUT_S) -> dict:
    """Train until something fails."""
    import torch
    import torch.distributed as dist

    init_pg(rank, world, timeout_s=timeout_s)
    try:
        model = _wrap(kind, _model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in _steps(rank, marker_dir, sig):
            model(torch.randn(8, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return {"types": ["nothing raised"], "message": "", "at": time.time()}
    except Exception as exc:  # noqa: BLE001 - what was raised is the result
        return _outcome(exc)
    finally:
        dist.destroy_process_group()  # after a peer loss this must neither hang nor crash


def _futures_rank(rank: int, world: int, kind: str, marker_dir: str) -> dict:
    """All-reduce through raw futures and then-chains until the peer is gone; report what
    each consumer saw: a C++ reader (TorchScript wait), collect_all, a then-chain,
    Future.wait and Work.wait."""
    import torch
    import torch.distributed as dist

    from support.futures import cxx_wait

    init_pg(rank, world, timeout_s=PG_TIMEOUT_S)
    t = torch.ones(1 << 20)
    try:
        for _ in _steps(rank, marker_dir):
            work = dist.all_reduce(t, async_op=True)
            fut = work.get_future()
            chained = fut.then(lambda f: f.value()[0] * 2)
            try:
                cxx_wait(fut)
            except Exception as exc:  # noqa: BLE001
                seen = {"cxx": _outcome(exc)}
                for name, wait in (("collect_all", torch.futures.collect_all([fut]).wait), ("then", chained.wait),
                                   ("future", fut.wait), ("work", work.wait)):
                    try:
                        wait()
                        seen[name] = {"types": ["nothing raised"], "message": ""}
                    except Exception as exc2:  # noqa: BLE001
                        seen[name] = _outcome(exc2)
                return seen
            t.fill_(1.0)
        return {"cxx": {"types": ["nothing raised"], "message": "", "at": time.time()}}
    finally:
        dist.destroy_process_group()


def _functional_rank(rank: int, world: int, kind: str, marker_dir: str) -> dict:
    """Functional collectives (DTensor, torch.compile): C++ waits on our Work."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    init_pg(rank, world, timeout_s=PG_TIMEOUT_S)
    t = torch.ones(1 << 20)
    try:
        for _ in _steps(rank, marker_dir):
            float(funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))[0])
        return {"types": ["nothing raised"], "message": "", "at": time.time()}
    except Exception as exc:  # noqa: BLE001 - what was raised is the result
        return _outcome(exc)
    finally:
        dist.destroy_process_group()


def _run_survivor(fn, kind: str, env: dict, *args) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as marker_dir:
        procs, results, _ = spawn_ranks(fn, 2, kind, marker_dir, *args, env=env)
        try:
            out = collect(procs, results, 120, expect=1)
        finally:
            reap(procs)
        with open(os.path.join(marker_dir, "killed_at")) as f:
            killed_at = float(f.read())
    status, value = out[1 - VICTIM]
    assert status == "ok", value
    return value, killed_at


def _assert_names_lost_peer(seen: dict, killed_at: float, typed: bool) -> None:
    text = " ".join(seen["types"]) + " " + seen["message"]
    assert "PeerLostError" in text, seen
    assert f"rank {VICTIM}" in seen["message"], f"the error does not name the lost peer: {seen}"
    if typed:
        assert "PeerLostError" in seen["types"], f"expected the typed error itself: {seen}"
    took = seen["at"] - killed_at
    assert took < NOTICE_S, f"the survivor took {took:.1f}s to notice the lost peer: {seen}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["inprocess", "daemon"])
@pytest.mark.parametrize("kind", ["ddp", "ddp_python_hook", "ddp_fp16_hook", "fsdp2"])
def test_survivor_of_a_killed_rank_raises_in_training(kind: str, mode: str) -> None:
    with MODES[mode].setup() as env:
        seen, killed_at = _run_survivor(_train_rank, kind, env)
    # DDP's reducer and comm hooks reach the error through C++ futures, which carry
    # it as RuntimeError with our message; FSDP2 waits on our Work in Python.
    _assert_names_lost_peer(seen, killed_at, typed=kind == "fsdp2")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["inprocess", "daemon"])
def test_survivor_sees_the_error_through_every_future_consumer(mode: str) -> None:
    with MODES[mode].setup() as env:
        seen, killed_at = _run_survivor(_futures_rank, "futures", env)
    assert set(seen) == {"cxx", "collect_all", "then", "future", "work"}, seen
    _assert_names_lost_peer(seen["cxx"], killed_at, typed=False)
    for name in ("collect_all", "then", "future"):  # RuntimeError from torch's future, naming ours
        assert "PeerLostError" in seen[name]["message"] and f"rank {VICTIM}" in seen[name]["message"], seen
    assert "PeerLostError" in seen["work"]["types"], seen["work"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["inprocess", "daemon"])
def test_survivor_raises_the_typed_error_through_functional_collectives(mode: str) -> None:
    with MODES[mode].setup() as env:
        seen, killed_at = _run_survivor(_functional_rank, "functional", env)
    _assert_names_lost_peer(seen, killed_at, typed=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["inprocess", "daemon"])
def test_survivor_of_a_stopped_rank_times_out_in_ddp(mode: str) -> None:
    with MODES[mode].setup() as env:
        seen, stopped_at = _run_survivor(_train_rank, "ddp", env, signal.SIGSTOP, STALL_TIMEOUT_S)
    assert "CollectiveTimeout: [" in seen["message"] and "] Timed out after " in seen["message"], seen
    assert f"rank(s) [{VICTIM}]" in seen["message"] or f"rank {VICTIM}" in seen["message"], seen
    took = seen["at"] - stopped_at
    assert STALL_TIMEOUT_S - 1 < took < STALL_TIMEOUT_S + NOTICE_S, f"timed out after {took:.1f}s: {seen}"
