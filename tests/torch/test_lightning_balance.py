"""libmccl.lightning_speed_balancer_callback under a real Lightning Trainer (2 forked ranks, CPU,
DDPStrategy): a rank made slow (a sleep per sample in its training step) gets a smaller share
of the global batch, and the update weighted by samples equals one process training on the
whole global batch (as tests/torch/test_balance.py asserts for plain DDP), on mccl and Gloo."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

# The slow rank sleeps 10 ms a sample (120 ms for an equal share): its speed stays far below the
# other rank's however loaded the machine, so the shares move in every run.
GLOBAL, STEPS, SLOW_S_PER_SAMPLE = 24, 8, 0.01


def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _data():
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(GLOBAL * STEPS, 16, generator=g), torch.randn(GLOBAL * STEPS, 4, generator=g)


def _reference() -> list:
    """One process, SGD on the global batches in order."""
    import torch

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _data()
    for k in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k * GLOBAL:(k + 1) * GLOBAL]), y[k * GLOBAL:(k + 1) * GLOBAL]).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def _rank(rank: int, world: int, backend: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    import libmccl
    from support.lightning_fit import fit, module
    from support.ranks import init_pg

    init_pg(rank, world, backend=backend)
    try:
        cb = libmccl.lightning_speed_balancer_callback(GLOBAL, every=1, warmup=1)
        ds = torch.utils.data.TensorDataset(*_data())
        loader = torch.utils.data.DataLoader(ds, batch_sampler=cb.batch_sampler(len(ds)))

        def slow(batch) -> None:   # the last rank computes 1/SLOW_S_PER_SAMPLE samples/s at most
            if rank == world - 1:
                time.sleep(SLOW_S_PER_SAMPLE * len(batch[0]))

        net = _net()
        trainer = fit(rank, world, module(net, 0.1, on_step=slow), loader, [cb], STEPS, backend)
        assert trainer.global_step == STEPS
        for p, r in zip(net.parameters(), _reference(), strict=True):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
        return {"used": [s for _, s in cb.shares_used], "history": cb.balancer.history}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["mccl", "gloo"])
def test_lightning_balancer_shares_follow_the_slow_rank_and_stay_exact(backend: str, ranks) -> None:
    out = ranks(_rank, 2, backend, timeout_s=100)
    used = out[0]["used"]
    assert used == out[1]["used"], "the ranks drew their batches under different plans"
    assert len(used) == STEPS and all(sum(s) == GLOBAL for s in used)
    assert used[0] == [GLOBAL // 2] * 2
    # The slow rank's share fell (a callback that did nothing would keep the equal split), and
    # the update stayed the large-batch one (asserted in the ranks, with the weighted hook).
    assert used[-1][1] < used[-1][0], used
    assert out[0]["history"], "no re-plan happened"


def _misuse(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    import libmccl
    from mccl_common.errors import ConfigError
    from support.lightning_fit import fit, module
    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        cb = libmccl.lightning_speed_balancer_callback(GLOBAL)
        ds = torch.utils.data.TensorDataset(*_data())
        plain = torch.utils.data.DataLoader(ds, batch_size=GLOBAL // world)
        with pytest.raises(ConfigError, match="batch_sampler is this callback's") as err:
            fit(rank, world, module(_net(), 0.1), plain, [cb], 2, "mccl")
        return str(err.value)
    finally:
        dist.destroy_process_group()


def test_lightning_balancer_refuses_a_loader_it_does_not_draw(ranks) -> None:
    ranks(_misuse, 2, timeout_s=100)


def test_lightning_balancer_argument_errors() -> None:
    import libmccl
    from mccl_common.errors import ConfigError

    with pytest.raises(ConfigError, match="global_batch must be a positive int"):
        libmccl.lightning_speed_balancer_callback(0)
    cb = libmccl.lightning_speed_balancer_callback(GLOBAL)
    with pytest.raises(ConfigError, match="fewer than one global batch of 24"):
        cb.batch_sampler(GLOBAL - 1)
    with pytest.raises(ConfigError, match="iterated outside the Trainer's fit"):
        next(iter(cb.batch_sampler(GLOBAL * 2)))
