"""DiLoCo under ElasticState(keep_workers=True): a host that leaves mid-round re-forms the
world in place, DiLoCo (group=None) continues on the new default group at its next sync, and
that round's average is over the ranks that finished it (the leaving rank's inner steps are
not counted). Ranks are spawned processes, each its own "host" with its own drain file, as in
test_elastic_reform.py."""

from __future__ import annotations

import os
import sys

import pytest

from support.ranks import init_pg, run_ranks

pytestmark = pytest.mark.timeout(200)

H = 4
STEPS = 12
LEAVES_AT = 6       # the inner step (1-based) after which rank 2's host leaves: mid-round 2


def _train(rank: int, world: int, ckpt: str, split: bool, delay: int, alpha: float) -> dict:
    import torch.distributed as dist
    import libmccl
    from libmccl.elastic.state import DRAIN_ENV, ElasticState
    from support.diloco_ref import inner_step, make_model, optimizers

    os.environ[DRAIN_ENV] = os.path.join(ckpt, f"drain-{rank}")
    os.environ["GROUP_RANK"] = str(rank)
    init_pg(rank, world)
    model = make_model()
    inner, outer = optimizers(model)
    state = ElasticState(ckpt, model=model, optimizer=inner, every=100, keep_workers=True)
    frags = [model[0], model[2]] if split else 1
    worlds = []
    try:
        with libmccl.DiLoCo(model, inner, outer, sync_every=H, fragments=frags, delay=delay, alpha=alpha) as d:
            for step in range(state.resume(), STEPS):
                inner_step(model, inner, rank, step + 1)    # data by the original rank: the "host"
                if step + 1 == LEAVES_AT and rank == 2:
                    open(os.environ[DRAIN_ENV], "w").close()
                if state.step_done(step):
                    worlds.append((step + 1, dist.get_world_size()))
    except SystemExit as exc:
        return {"exit": exc.code}
    glob = [g.tolist() for f in d.state_dict()["fragment_state"] for g in f["global"].values()]
    dist.destroy_process_group()
    return {"exit": None, "worlds": worlds, "global": glob, "syncs": d.syncs,
            "via_daemon": "libmccl.daemon.client" in sys.modules}


@pytest.mark.parametrize(("split", "delay", "alpha"), [(False, 0, 0.0), (True, 1, 0.5)],
                         ids=["diloco", "streaming-in-flight"])
def test_a_host_leaving_mid_round_leaves_the_average_to_the_ranks_that_finish(tmp_path, split, delay,
                                                                            alpha) -> None:
    """Streaming: fragment 1 is sent at step 6 by all three ranks, the host leaves after that
    step and the all-reduce, started on the old group, completes at step 7 in the new world."""
    _leave_and_check(run_ranks(_train, 3, str(tmp_path), split, delay, alpha, timeout_s=170), split, delay, alpha)


def test_through_mccld_a_host_leaving_mid_round_re_forms_in_place_too(tmp_path, daemon) -> None:
    """The same leave with every rank attached to mccld (MCCL_DAEMON=1): the in-place re-form
    makes the new group through the daemon, and the numbers are the in-process run's."""
    _, env = daemon
    out = run_ranks(_train, 3, str(tmp_path), True, 1, 0.5, timeout_s=170, env=dict(env, MCCL_DAEMON="1"))
    assert out[0]["via_daemon"] and out[1]["via_daemon"]
    _leave_and_check(out, True, 1, 0.5)


def _leave_and_check(out: list, split: bool, delay: int, alpha: float) -> None:
    import torch
    from support.diloco_ref import simulate

    assert out[2] == {"exit": 0}
    want = simulate(3, STEPS, H, split, delay, alpha, lambda t: [0, 1, 2] if t <= LEAVES_AT else [0, 1])
    for r in (0, 1):
        assert out[r]["exit"] is None
        assert out[r]["worlds"] == [(LEAVES_AT, 2)]      # one re-form in place, into a world of 2
        assert out[r]["syncs"] == (STEPS // H) * (2 if split else 1)
        for got, ref in zip(out[r]["global"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-6)


def _restart(rank: int, world: int, ckpt: str) -> list:
    """A run that stops after step 6 and resumes in new objects (as torchrun's restart after a
    host joins) through ElasticState(replicated={"diloco": ...}) ends on the theta_global of a
    run that never stopped: theta_global, the outer momentum and the counters came back."""
    import torch
    import torch.distributed as dist
    import libmccl
    from libmccl.elastic.state import ElasticState
    from support.diloco_ref import batch, make_model

    init_pg(rank, world)

    def run(start_seed: int, stop: int, directory: str) -> tuple[list, int]:
        model = make_model(start_seed)
        # Plain SGD inside: ElasticState keeps one copy of the model and optimizer (rank 0's), which
        # is exact only for state every rank shares; theta_local equals theta_global right after a sync.
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        d = libmccl.DiLoCo(model, inner, outer, sync_every=3)
        state = ElasticState(directory, model=model, optimizer=inner, every=3, replicated={"diloco": d})
        first = state.resume()
        with d:
            for step in range(first, stop):
                x, y = batch(rank, step + 1)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
                state.step_done(step)
        return [g.clone() for f in d.state_dict()["fragment_state"] for g in f["global"].values()], first

    try:
        straight, _ = run(0, 12, os.path.join(ckpt, "straight"))
        run(0, 6, os.path.join(ckpt, "stopped"))
        dist.barrier()      # rank 0 marks the last checkpoint complete after the save's own barrier
        resumed, first = run(9, 12, os.path.join(ckpt, "stopped"))   # other start values, all replaced
        assert first == 6
        return [float((a - b).abs().max()) for a, b in zip(resumed, straight)]
    finally:
        dist.destroy_process_group()


def test_elastic_checkpoint_carries_diloco_state(tmp_path) -> None:
    out = run_ranks(_restart, 2, str(tmp_path), timeout_s=170)
    assert out == [[0.0] * 4, [0.0] * 4]
