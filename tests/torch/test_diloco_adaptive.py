"""DiLoCo with adaptive=True: inner steps per rank planned by speed within a time budget, the
outer average weighted by the inner steps each rank made. The plan's arithmetic; two ranks, one
slowed by a sleep in its loop, make unequal rounds and every outer update equals a plain Gloo
reference of the step-weighted average; misuse is refused by name."""

from __future__ import annotations

import os
import sys

import pytest

from mccl_common.errors import ConfigError
from libmccl.training.shares import plan_inner_steps
from support.ranks import init_pg

H, ROUNDS = 4, 4


# -- the plan -----------------------------------------------------------------------------------
def test_plan_is_the_budget_of_the_median_rank() -> None:
    # Equal speeds: H everywhere, whatever the speed.
    assert plan_inner_steps(8, [3.0, 3.0, 3.0]) == [8, 8, 8]
    # T = H / median = 8 / 2: twice the median makes 2H, half of it H/2.
    assert plan_inner_steps(8, [4.0, 2.0, 1.0]) == [16, 8, 4]
    # Even count: the median is the mean of the middle two (2 and 4 -> 3); T = 6 / 3 = 2.
    assert plan_inner_steps(6, [1.0, 2.0, 4.0, 8.0]) == [2, 4, 8, 12]
    # Clamped to [least, cap]: a stalled rank still makes a step, a fast one at most 2H.
    assert plan_inner_steps(4, [1000.0, 1.0, 1.0]) == [8, 4, 4]
    assert plan_inner_steps(4, [1e-6, 1.0, 1.0]) == [1, 4, 4]
    assert plan_inner_steps(4, [1e-6, 1.0, 1.0], least=2) == [2, 4, 4]
    assert plan_inner_steps(4, [3.0, 1.0], cap=5) == [5, 2]
    # Floored, so no plan outlasts the budget: T = 4/2.5 = 1.6 s; 2 x 1.6 = 3.2 -> 3, 3 x 1.6 = 4.8 -> 4
    # (rounded, 5 steps would take the faster rank 1.67 s and hold the round).
    assert plan_inner_steps(4, [2.0, 3.0]) == [3, 4]
    assert all(h / s <= 1.6 for h, s in zip(plan_inner_steps(4, [2.0, 3.0]), [2.0, 3.0]))
    # The median rank keeps H where T x its speed is a hair under H in floating point.
    assert plan_inner_steps(3, [0.35, 0.7, 1.4]) == [1, 3, 6]   # (3 / 0.7) x 0.7 = 2.9999999999999996


def test_plan_for_unmeasured_ranks_is_h() -> None:
    assert plan_inner_steps(5, [None, None]) == [5, 5]
    assert plan_inner_steps(5, [0.0, float("nan"), 2.0, 1.0]) == [5, 5, 6, 3]


def test_bad_plans_are_refused_with_the_cause() -> None:
    with pytest.raises(ConfigError, match="H must be an integer"):
        plan_inner_steps(0, [1.0])
    with pytest.raises(ConfigError, match="least"):
        plan_inner_steps(4, [1.0], cap=3)
    with pytest.raises(ConfigError, match="no ranks"):
        plan_inner_steps(4, [])


# -- the round ----------------------------------------------------------------------------------
def _slow_rank(rank: int, world: int, backend: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import libmccl
    from support.diloco_ref import inner_step, make_model, optimizers

    init_pg(rank, world, backend=backend)
    try:
        gloo = dist.new_group(backend="gloo")
        model = make_model()
        inner, outer = optimizers(model)
        # theta_global as the reference sees it, stepped by the same outer optimizer.
        ref = [p.detach().clone() for p in model.parameters()]
        ref_outer = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
        local: list = []
        # Registered before DiLoCo's hook, so it sees theta_local before a sync merges it.
        inner.register_step_post_hook(lambda *_: local.__setitem__(slice(None), [
            p.detach().clone() for p in model.parameters()]))
        checked = 0
        with libmccl.DiLoCo(model, inner, outer, sync_every=H, adaptive=True) as d:
            t = 0
            while len(d.history) < ROUNDS:
                t += 1
                assert t < 20 * H * ROUNDS, d.history
                if rank == 1:
                    time.sleep(0.05)          # the slow host
                inner_step(model, inner, rank, t)
                if len(d.history) == checked:
                    continue
                made = d.history[-1]["steps"]
                planned = d.history[-2]["plan"] if checked else [H] * world
                assert made == planned, d.history
                with torch.no_grad():
                    deltas = [(g - p) * made[rank] for g, p in zip(ref, local)]
                    for x in deltas:
                        dist.all_reduce(x, group=gloo)
                    for g, x in zip(ref, deltas):
                        g.grad = x / sum(made)
                ref_outer.step()
                for p, g in zip(model.parameters(), ref):
                    assert torch.allclose(p, g, rtol=1e-5, atol=1e-6), (p - g).abs().max()
                checked += 1
        # The slow rank was planned fewer inner steps than the fast one, and made them.
        assert any(h["steps"][0] > h["steps"][1] for h in d.history[1:]), d.history
        assert d.history[-1]["plan"][0] > d.history[-1]["plan"][1], d.history
        assert all(h["plan"][1] >= 1 and h["plan"][0] <= 2 * H for h in d.history)
        # Every rank holds the same plan (it is computed, never sent).
        mine = torch.tensor([x for h in d.history for x in h["plan"]], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=gloo)
        assert all(torch.equal(g, mine) for g in got)
        if os.environ.get("MCCL_DAEMON") == "1":
            assert "libmccl.daemon.client" in sys.modules, "the group did not go through mccld"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["mccl", "gloo"])
def test_slow_rank_makes_fewer_steps_and_the_update_is_the_weighted_average(backend: str, ranks) -> None:
    ranks(_slow_rank, 2, backend, timeout_s=100)


@pytest.mark.timeout(120)
def test_through_mccld_the_slow_rank_makes_fewer_steps_and_the_update_is_the_weighted_average(daemon,
                                                                                              ranks) -> None:
    _, env = daemon
    ranks(_slow_rank, 2, "mccl", timeout_s=100, env=dict(env, MCCL_DAEMON="1"))


def _misuse_rank(rank: int, world: int) -> None:
    import torch.distributed as dist

    import libmccl
    from support.diloco_ref import inner_step, make_model, optimizers

    init_pg(rank, world)
    try:
        model = make_model()
        inner, outer = optimizers(model)
        with pytest.raises(ConfigError, match="fragments=1"):
            libmccl.DiLoCo(model, inner, outer, sync_every=4, fragments=2, adaptive=True)
        with pytest.raises(ConfigError, match="join=False"):
            libmccl.DiLoCo(model, inner, outer, sync_every=4, join=True, adaptive=True)
        # One rank adaptive, the other not: the weights would mix, so the first sync refuses.
        with pytest.raises(ConfigError, match="disagree on adaptive"):
            with libmccl.DiLoCo(model, inner, outer, sync_every=2, adaptive=rank == 0):
                for t in (1, 2):
                    inner_step(model, inner, rank, t)
        # A checkpoint of the other schedule is refused.
        plain = libmccl.DiLoCo(model, inner, outer, sync_every=2).state_dict()
        with pytest.raises(ConfigError, match="adaptive=False"):
            libmccl.DiLoCo(model, inner, outer, sync_every=2, adaptive=True).load_state_dict(plain)
        # A rank off its planned sync step (as if it ran another plan) is named.
        with pytest.raises(ConfigError, match="planned sync"):
            with libmccl.DiLoCo(model, inner, outer, sync_every=2, adaptive=True) as d:
                d._planned = 1 + rank         # rank 0 syncs after 1 step, rank 1 after 2
                for t in (1, 2):
                    inner_step(model, inner, rank, t)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_adaptive_misuse_is_refused_by_name(ranks) -> None:
    ranks(_misuse_rank, 2, timeout_s=100)


def _step_counted_rank(rank: int, world: int) -> str:
    import torch.distributed as dist

    import libmccl
    from support.diloco_ref import inner_step, make_model, optimizers

    init_pg(rank, world)
    try:
        model = make_model()
        inner, outer = optimizers(model)
        # Rank 0's loop ends one step into round 2 (round 1 is H steps on every rank, nothing being
        # measured yet); rank 1's runs on, so whatever its plan, it syncs round 2 and meets rank 0's
        # leaving row there. The plans depend on speeds; these counts do not.
        steps = H + 1 if rank == 0 else 20 * H
        with pytest.raises(ConfigError, match="left the loop at different rounds") as err:
            with libmccl.DiLoCo(model, inner, outer, sync_every=H, adaptive=True):
                for t in range(1, steps + 1):
                    inner_step(model, inner, rank, t)
        return str(err.value)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_an_adaptive_loop_ended_on_a_step_count_is_named_on_every_rank_not_a_hang(ranks) -> None:
    # Without the leaving row rank 1 would wait at its round-2 sync for the group's timeout (60 s here).
    out = ranks(_step_counted_rank, 2, timeout_s=100)
    for msg in out:
        assert "rank 0 left the loop after 1 rounds and 1 inner steps" in msg, msg
        assert "rank 1 syncs after 1 rounds" in msg and "len(diloco.history)" in msg, msg
