"""ElasticState(keep_workers=True): when a host leaves, the ranks that stay re-form in place
(libmccl/elastic/reform.py) instead of restarting. Ranks are spawned processes here, each its
own "host" with its own drain file; the end-to-end runs under torchrun and mccld are
tests/e2e/test_elastic_drain.py and tools/bench/reform.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import libmccl  # noqa: F401 - registers the backend
from libmccl.elastic import reform as elastic_reform
from libmccl.elastic.state import DRAIN_ENV, REFORM_EXIT, ElasticState
from support.ranks import init_pg, run_ranks

pytestmark = pytest.mark.timeout(180)

GLOBAL = 12       # samples per step, split over 3 ranks, then 2
STEPS = 6
LEAVES_AFTER = 2  # the step after which the last rank's host leaves


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, 5, generator=g), torch.randn(GLOBAL, 1, generator=g)


def _reference() -> list[torch.Tensor]:
    """One process, the whole batch: what any world of equal slices must compute under DDP."""
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _train(rank: int, world: int, ckpt: str, leaver: int, extra_group: bool, ddp_kwargs: dict) -> dict:
    os.environ[DRAIN_ENV] = os.path.join(ckpt, f"drain-{rank}")     # each rank its own host
    os.environ["GROUP_RANK"] = str(rank)
    init_pg(rank, world)
    if extra_group:
        dist.new_group([0, 1])
    net = DDP(_model(), **ddp_kwargs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = ElasticState(ckpt, model=net, optimizer=opt, every=100, keep_workers=True)
    me, n, reformed = dist.get_rank(), dist.get_world_size(), []
    try:
        for step in range(state.resume(), STEPS):
            x, y = _batch(step)
            per = GLOBAL // n
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[me * per:(me + 1) * per]), y[me * per:(me + 1) * per]).backward()
            opt.step()
            if step == LEAVES_AFTER and rank == leaver:
                open(os.environ[DRAIN_ENV], "w").close()      # this host's user is back
            if state.step_done(step):
                me, n = dist.get_rank(), dist.get_world_size()
                reformed.append((step, me, n, os.environ["RANK"], os.environ["WORLD_SIZE"],
                                 os.environ["GROUP_RANK"]))
    except SystemExit as exc:
        return {"exit": exc.code, "world": n}
    params = [p.detach().tolist() for p in net.parameters()]     # plain lists: tensors would pass as fds
    dist.destroy_process_group()
    return {"exit": None, "reformed": reformed, "params": params, "same_object": isinstance(net, DDP)}


@pytest.mark.parametrize("leaver", [0, 2], ids=["rank0-leaves", "last-rank-leaves"])
def test_the_ranks_that_stay_re_form_in_place_and_train_on_exactly(tmp_path, leaver):
    out = run_ranks(_train, 3, str(tmp_path), leaver, False, {})
    assert out[leaver] == {"exit": 0, "world": 3}                  # the leaving host's rank ends
    stay = [r for r in range(3) if r != leaver]
    want = _reference()
    for new, old in enumerate(stay):
        res = out[old]
        assert res["exit"] is None, res
        # One re-form, after the drained step, into ranks 0 and 1 of 2, torchrun's variables too.
        assert res["reformed"] == [(LEAVES_AFTER, new, 2, str(new), "2", str(new))], res["reformed"]
        # The DDP the script holds averages over the new world: a world of 3 then 2 equal slices
        # trains as one process on the whole batch.
        for got, ref in zip(res["params"], want):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-6)


def test_ddp_options_survive_the_rebuild(tmp_path):
    out = run_ranks(_train, 3, str(tmp_path), 1, False,
                    {"find_unused_parameters": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 1})
    want = _reference()
    for old in (0, 2):
        assert out[old]["reformed"], out[old]
        for got, ref in zip(out[old]["params"], want):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-6)


def _train_balanced(rank: int, world: int, ckpt: str) -> dict:
    from libmccl.training import SpeedBalancer

    os.environ[DRAIN_ENV] = os.path.join(ckpt, f"drain-{rank}")
    os.environ["GROUP_RANK"] = str(rank)
    init_pg(rank, world)
    net = DDP(_model())
    bal = SpeedBalancer(GLOBAL)
    net.register_comm_hook(bal.state, bal.hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = ElasticState(ckpt, model=net, optimizer=opt, every=100, keep_workers=True)
    shares = []
    try:
        for step in range(state.resume(), STEPS):
            x, y = _batch(step)
            b = bal.batch_size()
            me = dist.get_rank()
            lo = sum(bal.shares[:me])
            shares.append(bal.shares)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[lo:lo + b]), y[lo:lo + b]).backward()
            opt.step()
            if step == LEAVES_AFTER and rank == 2:
                open(os.environ[DRAIN_ENV], "w").close()
            state.step_done(step)
    except SystemExit as exc:
        return {"exit": exc.code}
    params = [p.detach().tolist() for p in net.parameters()]
    hooked = len(net._comm_hooks)
    dist.destroy_process_group()
    return {"exit": None, "params": params, "shares": shares, "hooks": hooked}


def test_a_speed_balancer_hook_re_forms_in_place_and_the_update_stays_exact(tmp_path):
    """The SpeedBalancer's comm hook follows the default group: DDP is rebuilt with the hook
    registered again, the balancer re-plans the same global batch over the two ranks left, and
    the weighted update is still the one-process update on the whole batch."""
    out = run_ranks(_train_balanced, 3, str(tmp_path))
    assert out[2] == {"exit": 0}
    want = _reference()
    for r in (0, 1):
        assert out[r]["exit"] is None and out[r]["hooks"] == 1, out[r]
        assert [len(s) for s in out[r]["shares"]] == [3] * (LEAVES_AFTER + 1) + [2] * (STEPS - LEAVES_AFTER - 1)
        assert all(sum(s) == GLOBAL for s in out[r]["shares"])
        for got, ref in zip(out[r]["params"], want):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-6)


def test_a_job_with_its_own_groups_restarts_its_workers_instead(tmp_path):
    """A group made with new_group holds the old world; the ranks cannot re-form it in place,
    so every rank that stays exits for torchrun to restart it (as without keep_workers)."""
    out = run_ranks(_train, 3, str(tmp_path), 2, True, {})
    assert [o["exit"] for o in out] == [REFORM_EXIT, REFORM_EXIT, 0]


def _blockers(rank: int, world: int) -> list:
    init_pg(rank, world)
    try:
        net = DDP(_model())
        plain = elastic_reform.blocker(net, None)
        net.register_comm_hook(None, lambda _s, bucket: dist.all_reduce(bucket.buffer(), async_op=True).get_future())
        hooked = elastic_reform.blocker(net, None)
        bare = elastic_reform.blocker(_model(), None)
        from libmccl.training import SpeedBalancer

        balanced = DDP(_model())
        bal = SpeedBalancer(4)
        balanced.register_comm_hook(bal.state, bal.hook)
        follows = elastic_reform.blocker(balanced, None)
        dist.new_group([0])
        grouped = elastic_reform.blocker(_model(), None)
        return [plain, hooked, bare, grouped, follows]
    finally:
        dist.destroy_process_group()


def test_blocker_names_what_holds_the_old_world():
    (plain, hooked, bare, grouped, follows), = run_ranks(_blockers, 1)
    assert plain is None and bare is None and follows is None     # a SpeedBalancer's hook follows the group
    assert "communication hook" in hooked and "may hold the old group" in hooked
    assert "1 more process group" in grouped


def test_plan_numbers_the_ranks_and_hosts_that_stay():
    # Six ranks on three hosts (two each); host 1 leaves.
    plan = elastic_reform.Plan(leaving=(False, False, True, True, False, False), hosts=(0, 0, 1, 1, 2, 2),
                               store_addr="10.0.0.1", store_port=1234)
    assert plan.new_world == 4
    assert [plan.new_rank(r) for r in range(6)] == [0, 1, None, None, 2, 3]
    assert [plan.new_host_index(r) for r in (0, 1, 4, 5)] == [0, 0, 1, 1]
