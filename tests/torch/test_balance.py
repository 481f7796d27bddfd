"""Speed-aware batch shares (libmccl/training): the plan's arithmetic, re-planning when hosts
leave and join or slow down, and the weighted DDP update's exactness against one process
training on the whole global batch."""

from __future__ import annotations

import pytest

from mccl_common.errors import ConfigError
from libmccl.training.shares import SharePlanner, floor_share, plan_shares

GLOBAL = 24
STEPS = 4


# -- the plan -----------------------------------------------------------------------------------
def test_shares_proportional_integral_and_summing() -> None:
    assert plan_shares(24, [1.0, 1.0, 1.0, 1.0]) == [6, 6, 6, 6]
    assert plan_shares(24, [2.0, 1.0, 1.0]) == [12, 6, 6]
    # 4 hosts, 2 at half speed: 1 : 1 : 0.5 : 0.5 of 30 -> 10, 10, 5, 5.
    assert plan_shares(30, [2.0, 2.0, 1.0, 1.0]) == [10, 10, 5, 5]
    for speeds in ([3.3, 1.7, 0.9], [5, 5, 5, 5, 5, 5, 5], [1e-3, 7.0, 2.5, 2.5]):
        s = plan_shares(101, speeds)
        assert sum(s) == 101 and all(isinstance(x, int) for x in s)
    # Rounding is deterministic: leftovers to the largest remainders, ties to the lower rank.
    assert plan_shares(10, [1.0, 1.0, 1.0]) == [4, 3, 3]


def test_floor_keeps_a_stalled_rank_computing() -> None:
    s = plan_shares(40, [100.0, 100.0, 100.0, 0.001], floor=0.25)
    assert s[3] == floor_share(40, 4, 0.25) == 3 and sum(s) == 40
    assert s[0] == s[1] == s[2] - 1 or s[0] >= s[2]       # the rest split proportionally
    assert min(plan_shares(8, [1e6, 1e-6, 1e-6, 1e-6], floor=0.0)) == 1   # never an empty batch


def test_unmeasured_ranks_get_the_mean_speed() -> None:
    assert plan_shares(24, [None, None, None]) == [8, 8, 8]
    # A joiner (None) is planned at the mean of the measured speeds (2 and 4 -> 3).
    assert plan_shares(27, [2.0, 4.0, None]) == [6, 12, 9]


def test_bad_plans_are_refused_with_the_cause() -> None:
    with pytest.raises(ConfigError, match="smaller than the world"):
        plan_shares(3, [1.0] * 4)
    with pytest.raises(ConfigError, match="floor"):
        plan_shares(8, [1.0, 1.0], floor=1.5)
    with pytest.raises(ConfigError, match="speeds for a world of 3"):
        SharePlanner(12, 3, 0).adopt([1.0, 2.0])


# -- the planner: smoothing, step changes, leave and join ----------------------------------------
def _feed(p: SharePlanner, samples_per_s: float, steps: int) -> None:
    for _ in range(steps):
        p.observe(p.share, p.share / samples_per_s)


def test_step_change_replaces_the_speed_after_two_steps_but_noise_does_not() -> None:
    p = SharePlanner(32, 4, 3, warmup=0)
    _feed(p, 100.0, 5)
    assert p.speed == pytest.approx(100.0)
    _feed(p, 300.0, 1)                                  # one outlier: the EMA holds
    assert p.speed == pytest.approx(100.0)
    _feed(p, 100.0, 1)
    _feed(p, 50.0, 2)                                   # slowed to half: replaced after 2 steps
    assert p.speed == pytest.approx(50.0)


def test_shares_replanned_when_hosts_leave_and_join() -> None:
    # Four ranks, rank 3 at half speed; every rank runs its own planner on the same gathered speeds.
    speeds = [100.0, 100.0, 100.0, 50.0]
    planners = [SharePlanner(28, 4, r, warmup=0, every=2) for r in range(4)]
    assert [p.share for p in planners] == [7, 7, 7, 7]
    for p, s in zip(planners, speeds):
        _feed(p, s, 2)
    assert all(p.due() for p in planners)
    for p in planners:
        p.adopt([q.speed for q in planners])
    assert [p.share for p in planners] == [8, 8, 8, 4]
    assert all(p.shares == planners[0].shares for p in planners)

    # Rank 1 leaves: the survivors are renumbered 0, 1, 2 (old 0, 2, 3) and keep their own speeds.
    left = [planners[0], planners[2], planners[3]]
    for new_rank, p in enumerate(left):
        p.new_world(3, new_rank)
    assert [p.share for p in left] == [10, 9, 9]        # equal until measured on the new world
    assert [p.speed for p in left] == pytest.approx([100.0, 100.0, 50.0])
    for p, s in zip(left, (100.0, 100.0, 50.0)):
        _feed(p, s, 1)
    assert all(p.due() for p in left)                   # the first step of a new world exchanges
    for p in left:
        p.adopt([q.speed for q in left])
    assert [p.share for p in left] == [11, 11, 6] and sum(left[0].shares) == 28

    # A fresh host joins as rank 3: unmeasured, it is planned at the mean until it reports.
    joiner = SharePlanner(28, 4, 3, warmup=0)
    world = left + [joiner]
    for r, p in enumerate(world):
        p.new_world(4, r)
    for p, s in zip(world, (100.0, 100.0, 50.0, 200.0)):
        _feed(p, s, 1)
    gathered = [p.speed for p in world[:3]] + [None]    # the joiner's first step was its warm-up
    for p in world:
        p.adopt(gathered)
    assert world[0].shares == plan_shares(28, [100.0, 100.0, 50.0, None])
    assert world[0].shares == plan_shares(28, [100.0, 100.0, 50.0, 250.0 / 3])   # the mean of the others


def test_exchange_schedule_is_the_same_on_every_rank() -> None:
    a, b = SharePlanner(16, 2, 0, warmup=1, every=3), SharePlanner(16, 2, 1, warmup=1, every=3)
    seen = []
    for step in range(10):
        a.observe(8, 0.1 if step != 4 else 1.0)         # a local jump on one rank only
        b.observe(8, 0.2)
        seen.append((a.due(), b.due()))
        if a.due():
            a.adopt([a.speed, b.speed])
            b.adopt([a.speed, b.speed])
    assert all(x == y for x, y in seen) and any(x for x, _ in seen)


# -- exactness against one process on the whole global batch ------------------------------------
def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batches():
    import torch

    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL, 16, generator=g), torch.randn(GLOBAL, 4, generator=g)) for _ in range(STEPS)]


def _reference():
    import torch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _balanced_rank(rank: int, world: int, backend: str, fixed: list[int] | None) -> dict:
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from libmccl.training import SpeedBalancer
    from support.ranks import init_pg

    if backend == "mccl":
        import libmccl

        libmccl.register()
    init_pg(rank, world, backend=backend)
    try:
        # fixed shares: no exchange ever; else every step exchanges (warm-up 0) and re-plans.
        bal = SpeedBalancer(GLOBAL, every=1, warmup=10**6 if fixed else 0, hysteresis=0.0)
        if fixed:
            bal.planner.shares = list(fixed)
        model = DDP(_model())
        model.register_comm_hook(bal.state, bal.hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        used = []
        for x, y in _batches():
            b = bal.batch_size()
            shares = bal.shares
            assert sum(shares) == GLOBAL and shares[rank] == b
            lo = sum(shares[:rank])
            used.append(shares)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[lo:lo + b]), y[lo:lo + b]).backward()
            if rank == world - 1 and not fixed:
                time.sleep(0.002 * b)          # a slower host: the plan may move, exactness must not
            opt.step()
        ref = _reference()
        for p, r in zip(model.module.parameters(), ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
        moved = not torch.allclose(next(model.module.parameters()), next(_model().parameters()))
        return {"used": used, "moved": moved, "exchanges": bal.planner.steps, "history": bal.history}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", "mccl"])
def test_weighted_update_equals_large_batch_with_unequal_shares(backend: str, ranks) -> None:
    fixed = [3, 13, 8]
    out = ranks(_balanced_rank, 3, backend, fixed, timeout_s=150)
    assert all(o["moved"] for o in out)
    assert all(u == fixed for o in out for u in o["used"])


@pytest.mark.timeout(180)
def test_weighted_update_exact_while_replanning(ranks) -> None:
    out = ranks(_balanced_rank, 3, "mccl", None, timeout_s=150)
    # Every rank followed the same plans (they are computed, never sent), and they re-planned.
    assert out[0]["used"] == out[1]["used"] == out[2]["used"]
    assert out[0]["history"], "no re-plan happened: the exchange path was not exercised"


def _leave_rank(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import libmccl
    from libmccl.training import SpeedBalancer
    from support.ranks import init_pg

    libmccl.register()
    init_pg(rank, world)
    bal = SpeedBalancer(GLOBAL, every=1, warmup=0, hysteresis=0.0)
    net = _model()
    model = DDP(net)
    model.register_comm_hook(bal.state, bal.hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []

    def step(x, y, world_now: int, rank_now: int) -> None:
        b = bal.batch_size()
        shares = bal.shares
        assert len(shares) == world_now and sum(shares) == GLOBAL and shares[rank_now] == b
        seen.append(shares)
        lo = sum(shares[:rank_now])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:lo + b]), y[lo:lo + b]).backward()
        opt.step()

    batches = _batches()
    for x, y in batches[:2]:
        step(x, y, world, rank)
    dist.destroy_process_group()
    if rank == world - 1:
        return {"left": True, "seen": seen}
    # The others re-form without the last rank (as a script re-forming its own group would).
    init_pg(rank, world - 1, port=port)
    try:
        speed = bal.speed
        bal.new_world()
        assert bal.speed == speed and bal.shares == [GLOBAL // (world - 1)] * (world - 1)
        model = DDP(net)
        model.register_comm_hook(bal.state, bal.hook)
        for x, y in batches[2:]:
            step(x, y, world - 1, rank)
        for p, r in zip(net.parameters(), _reference()):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
        return {"left": False, "seen": seen, "replans": len(bal.history)}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_rank_leaves_the_survivors_replan_and_stay_exact(ranks) -> None:
    from support.ranks import free_port

    out = ranks(_leave_rank, 3, free_port(), timeout_s=150)
    assert out[2]["left"] and not out[0]["left"]
    assert out[0]["seen"] == out[1]["seen"]
    assert [len(s) for s in out[0]["seen"]] == [3, 3, 2, 2]
    assert out[0]["seen"][2] == [12, 12]            # equal on the new world until measured there


@pytest.mark.timeout(180)
def test_through_mccld_exact_and_speeds_and_shares_reach_the_daemon(daemon, ranks) -> None:
    d, env = daemon
    out = ranks(_balanced_rank, 3, "mccl", None, env=dict(env, MCCL_DAEMON="1"), timeout_s=150)
    last = out[0]["used"][-1]
    got = {b["rank"]: b for b in d.stats.snapshot()["balance"]}
    assert sorted(got) == [0, 1, 2], d.stats.snapshot()["balance"]
    # Reported after the last exchange, which planned the last step's shares.
    assert [got[r]["share"] for r in range(3)] == last and all(got[r]["speed"] > 0 for r in range(3))
    # What `mcclctl jobs` gets from this daemon's status for the job (it ended: from the stats' jobs).
    from mccld.report.status_server import merge_status

    (job,) = {b["job"] for b in d.stats.snapshot()["balance"]}
    rows = merge_status({"jobs": [{"job": job, "world": 3}]}, d.stats.snapshot())["jobs"]
    assert rows[0]["balance"] == {str(r): {"speed": got[r]["speed"], "share": got[r]["share"]} for r in range(3)}
