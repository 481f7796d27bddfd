"""libmccl.elastic.ElasticState in one process (a world of one): what it saves and restores,
which checkpoint it resumes from, and the drain decision. The re-forming itself, across
torchruns on several hosts, is tests/e2e/test_elastic_drain.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import libmccl  # noqa: F401 - registers the backend
from libmccl.elastic.state import AWARE_SUFFIX, DRAIN_ENV, REFORM_ENV, REFORM_EXIT, ElasticState
from mccl_common.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world_of_one():
    dist.init_process_group("mccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parts():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return net, opt, sched


def train(net, opt, sched, steps):
    for _ in range(steps):
        opt.zero_grad()
        net(torch.ones(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()


def test_resume_restores_model_optimizer_scheduler_extra_and_rng(world_of_one, tmp_path):
    net, opt, sched = parts()
    state = ElasticState(tmp_path, model=net, optimizer=opt, scheduler=sched, every=1000, extra={"epoch": 2})
    assert state.resume() == 0 and state.resumed_from is None
    train(net, opt, sched, 5)
    state.extra["offset"] = 123
    random.seed(7)
    torch.manual_seed(7)
    state.save(4)
    want_rand, want_torch = random.random(), torch.rand(3)
    weights = [p.detach().clone() for p in net.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()]
    lr = sched.get_last_lr()

    net2, opt2, sched2 = parts()        # a restarted process: fresh objects
    train(net2, opt2, sched2, 1)        # ... that even moved a bit before resuming
    state2 = ElasticState(tmp_path, model=net2, optimizer=opt2, scheduler=sched2, every=1000)
    assert state2.resume() == 5 and state2.resumed_from == 4
    assert all(torch.equal(a, b) for a, b in zip(weights, net2.parameters()))
    assert all(torch.equal(m, opt2.state[p]["momentum_buffer"]) for m, p in zip(momentum, net2.parameters()))
    assert sched2.get_last_lr() == lr and state2.extra == {"epoch": 2, "offset": 123}
    assert random.random() == want_rand and torch.equal(torch.rand(3), want_torch)


def test_only_complete_checkpoints_count_and_two_are_kept(world_of_one, tmp_path):
    net, opt, sched = parts()
    state = ElasticState(tmp_path, model=net, optimizer=opt, scheduler=sched, every=2)
    for step in range(7):
        train(net, opt, sched, 1)
        state.step_done(step)           # saves after steps 1, 3, 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000005"]
    (tmp_path / "step-000000009").mkdir()   # a save that died before its marker
    assert ElasticState(tmp_path, model=net, optimizer=opt, every=2).resume() == 6


def test_a_drain_saves_this_step_and_leaves(world_of_one, tmp_path, monkeypatch):
    drain = tmp_path / "drain-job"
    monkeypatch.setenv(DRAIN_ENV, str(drain))
    net, opt, sched = parts()
    state = ElasticState(tmp_path / "ck", model=net, optimizer=opt, scheduler=sched, every=100)
    state.step_done(0)                  # no drain: nothing saved, nothing exits
    assert not (tmp_path / "ck").exists()
    drain.touch()
    with pytest.raises(SystemExit) as info:
        state.step_done(1)
    assert info.value.code == 0         # this host is the one leaving (the others exit REFORM_EXIT)
    assert (tmp_path / "drain-job.left").read_text() == "1"
    assert (tmp_path / "ck" / "step-000000001" / "COMPLETE").exists()
    assert REFORM_EXIT == 75
    dist.init_process_group("mccl", store=dist.HashStore(), rank=0, world_size=1)  # the fixture's teardown


def test_a_joining_host_makes_every_rank_save_and_re_form(world_of_one, tmp_path, monkeypatch):
    reform = tmp_path / "reform"
    monkeypatch.setenv(REFORM_ENV, str(reform))
    net, opt, sched = parts()
    state = ElasticState(tmp_path / "ck", model=net, optimizer=opt, scheduler=sched, every=100)
    # The marker tells torchrun's rendezvous handler these workers stop at a step boundary.
    assert (tmp_path / ("reform" + AWARE_SUFFIX)).exists()
    state.step_done(0)
    assert not (tmp_path / "ck").exists()
    reform.touch()                      # the handler saw a host waiting to join
    with pytest.raises(SystemExit) as info:
        state.step_done(1)
    assert info.value.code == REFORM_EXIT   # nobody leaves: every rank restarts into the larger world
    assert (tmp_path / "ck" / "step-000000001" / "COMPLETE").exists()
    dist.init_process_group("mccl", store=dist.HashStore(), rank=0, world_size=1)  # the fixture's teardown
    net2, opt2, sched2 = parts()
    assert ElasticState(tmp_path / "ck", model=net2, optimizer=opt2, scheduler=sched2).resume() == 2


def test_misuse_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="init_process_group first"):
        ElasticState(tmp_path, model=torch.nn.Linear(1, 1))
