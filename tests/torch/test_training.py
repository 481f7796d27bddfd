"""Training on mccl: DDP matches Gloo and single-process training; FSDP2, DeviceMesh /
DTensor redistribution and new_group subgroups work."""

from __future__ import annotations

import pytest

from support.collective_suite import MODES
from support.ranks import init_pg
from support.training import make_batches, make_model, reference, train


def _ddp_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_pg(rank, world)
    try:
        gloo = dist.new_group(backend="gloo")
        mccl_model = train(DDP(make_model()), make_batches(world), rank, world).module
        gloo_model = train(DDP(make_model(), process_group=gloo), make_batches(world), rank, world).module
        ref = reference(world)
        for pm, pg, pr in zip(mccl_model.parameters(), gloo_model.parameters(), ref):
            assert torch.allclose(pm, pg, atol=1e-6), (pm - pg).abs().max()
            assert torch.allclose(pm, pr, atol=1e-5), (pm - pr).abs().max()
        # The parameters moved: the comparison above is not between untouched models.
        assert not torch.allclose(next(mccl_model.parameters()), next(make_model().parameters()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "world"), [("inprocess", 2), ("inprocess", 3), ("daemon", 2)])
def test_ddp_matches_gloo_and_single_process(mode: str, world: int, ranks) -> None:
    with MODES[mode].setup() as env:
        ranks(_ddp_rank, world, timeout_s=150, env=env)


def _fsdp_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    init_pg(rank, world)
    try:
        model = make_model()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        train(model, make_batches(world), rank, world)
        ref = reference(world)
        for p, r in zip(model.parameters(), ref):
            full = p.full_tensor()  # all-gathers the shards over mccl
            assert torch.allclose(full, r, atol=1e-5), (full - r).abs().max()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_fsdp2_fully_shard(ranks) -> None:
    ranks(_fsdp_rank, 2, timeout_s=150)


def _mesh_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    init_pg(rank, world)
    try:
        full = torch.arange(world * 6 * 4, dtype=torch.float32).reshape(world * 6, 4)
        mesh = init_device_mesh("cpu", (world,))
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        assert torch.equal(sharded.to_local(), full.chunk(world)[rank])
        assert torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local(), full)   # all-gather
        assert torch.equal(sharded.redistribute(mesh, [Shard(1)]).full_tensor(), full)   # all-to-all
        # Partial -> Replicate is an all-reduce: every rank contributes full, so the sum is world * full.
        partial = DTensor.from_local(full.clone(), mesh, [Partial()])
        assert torch.equal(partial.redistribute(mesh, [Replicate()]).to_local(), world * full)
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        t = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
        assert torch.equal(t.full_tensor(), full)
        assert torch.equal(t.redistribute(mesh2, [Replicate(), Shard(1)]).to_local(), full.chunk(world // 2, 1)[
            mesh2.get_local_rank("tp")])
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_device_mesh_dtensor_redistribute(ranks) -> None:
    ranks(_mesh_rank, 4, timeout_s=150)


def _subgroup_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    init_pg(rank, world)
    try:
        evens = dist.new_group([0, 2])
        odds = dist.new_group([1, 3])
        mine = evens if rank % 2 == 0 else odds
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        assert t.item() == (2.0 if rank % 2 == 0 else 4.0), t
        # Groups are independent: the world group still works and sees everyone.
        w = torch.ones(3)
        dist.all_reduce(w)
        assert torch.equal(w, torch.full((3,), float(world)))
        out = [torch.empty(1) for _ in range(2)]
        dist.all_gather(out, torch.tensor([float(rank)]), group=mine)
        assert [o.item() for o in out] == ([0.0, 2.0] if rank % 2 == 0 else [1.0, 3.0])
        dist.destroy_process_group(mine)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_new_group_subgroups(ranks) -> None:
    ranks(_subgroup_rank, 4, timeout_s=150)


_TORCHRUN_SCRIPT = '''
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("mccl")  # nothing of MCCL imported: torch's entry point registered it
model = DDP(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
w = model.module.weight.grad.clone()
dist.all_reduce(w, op=dist.ReduceOp.MAX)
assert torch.equal(w, model.module.weight.grad), "gradients differ across ranks"
assert "libmccl" in sys.modules
with open(f"{sys.argv[1]}/rank{dist.get_rank()}", "w") as f:  # workers' stdout interleaves
    f.write(f"backend {dist.get_backend()} ok")
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_unchanged_script_under_torchrun(tmp_path) -> None:
    import sys

    from support.ranks import free_port, run_command

    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tmp_path)]
    out = run_command(cmd, 100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["backend mccl ok"] * 2


@pytest.mark.timeout(180)
def test_demo_runs_and_learns() -> None:
    import sys

    from support.ranks import run_command

    out = run_command([sys.executable, "-m", "tools.demo", "--world", "2", "--seconds", "8"], 170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[demo] OK" in out.stdout and "samples/s" in out.stdout, out.stdout


def _dcp_rank(rank: int, world: int, path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    init_pg(rank, world)
    try:
        model = make_model()
        fully_shard(model)
        train(model, make_batches(world), rank, world)
        saved = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        fresh = make_model()
        fully_shard(fresh)
        state = {"model": get_model_state_dict(fresh)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(fresh, state["model"])
        for k, v in get_model_state_dict(fresh).items():
            assert torch.equal(v.full_tensor(), saved[k]), k
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_distributed_checkpoint_roundtrip(tmp_path, ranks) -> None:
    """DCP plans with object collectives and reads the group's device types."""
    ranks(_dcp_rank, 2, str(tmp_path / "ckpt"), timeout_s=150)
