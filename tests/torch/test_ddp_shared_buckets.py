"""libmccl.ddp_shared_buckets (libmccl/torch/ddp_buckets.py): DDP's buckets reduced in memory mccld
maps give the copied path's parameters bit for bit, under bucket rebuilds, static_graph,
find_unused_parameters, no_sync accumulation, set_to_none and a sub-group, and the buckets'
all-reduces run in place (the daemon client's zero_copy_ops); groups of one never attach to mccld."""

from __future__ import annotations

import pytest

from support.collective_suite import MODES

pytestmark = pytest.mark.timeout(240)

# (gradient_as_bucket_view, zero_grad(set_to_none), find_unused_parameters, static_graph, accumulate, subgroup)
_CASES = [
    (True, False, False, False, 1, False),
    (True, True, False, False, 1, False),
    (True, False, True, False, 2, False),
    (True, True, False, True, 1, True),
    (False, True, False, False, 2, False),
    (False, False, True, False, 1, True),
]
_STEPS = 4


def _model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 512)
            self.b = torch.nn.Linear(512, 256)
            self.unused = torch.nn.Linear(256, 256)   # skipped on odd steps (find_unused_parameters)
            self.c = torch.nn.Linear(256, 8)
            # A channels_last weight: DDP's bucket view of it has its strides, not contiguous ones.
            self.conv = torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)

        def forward(self, x, step=0):
            h = torch.tanh(self.b(torch.tanh(self.a(x))))
            if step % 2 == 0:
                h = h + self.unused(h)
            img = x.view(-1, 4, 4, 4).contiguous(memory_format=torch.channels_last)
            return self.c(h) + self.conv(img).sum(dim=(2, 3))

    torch.manual_seed(0)
    return Net()


def _train(rank, world, hooked, case):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import libmccl

    as_view, to_none, unused, static, accumulate, sub = case
    group = dist.new_group(list(range(world))) if sub else None
    model = DDP(_model(), process_group=group, gradient_as_bucket_view=as_view, find_unused_parameters=unused,
                static_graph=static, bucket_cap_mb=0.4)
    if hooked:
        model.register_comm_hook(group, libmccl.ddp_shared_buckets)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7 + rank)
    comm = (group or dist.group.WORLD).communicator
    in_place = []
    for step in range(_STEPS):
        before = comm.stats().get("zero_copy_ops", 0)
        gen = comm._gen   # segments and shared buffers created so far
        for micro in range(accumulate):
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            ctx = model.no_sync() if micro < accumulate - 1 else torch.enable_grad()
            with ctx:
                step_arg = step if unused else 0
                torch.nn.functional.mse_loss(model(x, step_arg), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=to_none)
        in_place.append(comm.stats().get("zero_copy_ops", 0) - before)
    # The buckets keep their shared memory from step to step (a new buffer each step would
    # also mean a copy into it each step).
    assert comm._gen == gen, f"{comm._gen - gen} buffers created in the last step"
    params = [p.detach().clone() for p in model.parameters()]
    del model, opt
    if group is not None:
        dist.destroy_process_group(group)
    return params, in_place


def _groups_of_one(rank: int, world: int) -> None:
    """Under MCCL_DAEMON=1, new_group([me]) and a DeviceMesh dimension of size 1 are groups of
    one: served on the caller's thread, never through mccld."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mine = [dist.new_group([r]) for r in range(world)][rank]
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "one"))
    for g in (mine, mesh.get_group("one")):
        assert type(g.communicator).__name__ == "SoloCommunicator", type(g.communicator)
        t = torch.full((1 << 20,), float(rank))
        work = dist.all_reduce(t, group=g, async_op=True)
        assert work.is_completed()
        assert torch.equal(t, torch.full((1 << 20,), float(rank)))
    dp = mesh.get_group("dp")
    t = torch.ones(4)
    dist.all_reduce(t, group=dp)
    assert torch.equal(t, torch.full((4,), float(world)))


def _rank(rank: int, world: int, cases: list) -> list:
    import torch
    import torch.distributed as dist

    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        report = []
        for case in cases:
            copied, none_in_place = _train(rank, world, False, case)
            shared, in_place = _train(rank, world, True, case)
            for i, (a, b) in enumerate(zip(copied, shared)):
                assert torch.equal(a, b), f"case {case}: parameter {i} differs by {(a - b).abs().max()}"
            assert sum(none_in_place) == 0, none_in_place
            # The buckets above the small-op queue (4 KB here) run in place: at least one in the
            # first step, both of the rebuilt ones once DDP rebuilt them (static_graph: a step later).
            assert min(in_place) >= 1 and in_place[-1] >= 2, (case, in_place)
            report.append(in_place)
        # A rank out of shared buffers (one allowed here): the buckets beyond it are copied
        # through mccld as before, with the same results.
        import libmccl.daemon.buffers as buffers
        buffers.MAX_BUFFERS_PER_RANK = 1
        copied, _ = _train(rank, world, False, cases[0])
        shared, in_place = _train(rank, world, True, cases[0])
        assert all(torch.equal(a, b) for a, b in zip(copied, shared))
        assert 1 <= in_place[-1] < report[0][-1], (in_place, report[0])
        _groups_of_one(rank, world)
        return report
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_shared_buckets_equal_the_copied_path_and_run_in_place(ranks, world: int) -> None:
    # At 3 ranks x / 3 and x * (1/3) differ in the last bit: DDP divides a gradient already in
    # its bucket view (gradient_as_bucket_view, set_to_none=False), the hook multiplies
    # (README); the cases where DDP multiplies too must still be equal.
    cases = _CASES if world == 2 else [c for c in _CASES if c[1] or not c[0]]
    with MODES["daemon"].setup() as env:
        env = dict(env, MCCL_DAEMON_FAST_BYTES="4096")
        ranks(_rank, world, cases, timeout_s=200, env=env)
