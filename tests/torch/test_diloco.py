"""libmccl.DiLoCo: the published algorithm and its streaming form give the numbers of a plain
reference on Gloo (support/diloco_ref.py), on mccl in-process, through mccld and on Gloo
itself; checkpoints change no numbers; a joining rank takes the state at the next sync and
the average is weighted by the inner steps each rank made; misuse is refused by name."""

from __future__ import annotations

import io

import pytest

from support.collective_suite import MODES
from support.ranks import free_port, init_pg

# 4 outer rounds of H = 3 inner steps (the exactness target).
H, ROUNDS = 3, 4


def _close(a, b, rtol=1e-5, atol=1e-7) -> None:
    import torch

    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=rtol, atol=atol), (x - y).abs().max()


def _train(rank: int, steps: int, backend_group, **kw) -> tuple[list, object]:
    """libmccl.DiLoCo around the unchanged inner loop; theta_global and the model."""
    import libmccl
    from support.diloco_ref import inner_step, make_model, optimizers

    model = make_model()
    inner, outer = optimizers(model)
    with libmccl.DiLoCo(model, inner, outer, group=backend_group, **kw) as d:
        for t in range(1, steps + 1):
            inner_step(model, inner, rank, t)
    state = d.state_dict()
    return [g for f in state["fragment_state"] for g in f["global"].values()], model


def _reference(rank: int, steps: int, gloo, sync_every: int, delay: int = 0, alpha: float = 0.0,
               split: bool = False) -> list:
    from support.diloco_ref import make_model, optimizers, reference

    model = make_model()
    inner, outer = optimizers(model)
    frags = [list(model[0].parameters()), list(model[2].parameters())] if split else [list(model.parameters())]
    return reference(model, inner, outer, rank, steps, sync_every, frags, delay, alpha, gloo)


def _exact_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from support.diloco_ref import make_model

    init_pg(rank, world)
    try:
        gloo = dist.new_group(backend="gloo")
        mine, model = _train(rank, H * ROUNDS, None, sync_every=H)
        ref = _reference(rank, H * ROUNDS, gloo, H)
        _close(mine, ref)
        # Every rank ends on the same theta_global, and it moved away from the start.
        _close(mine, list(model.parameters()))
        gathered = [torch.empty_like(mine[0]) for _ in range(world)]
        dist.all_gather(gathered, mine[0].contiguous(), group=gloo)
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        assert not torch.allclose(mine[0], next(make_model().parameters()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mode", "world"), [("inprocess", 2), ("inprocess", 3), ("daemon", 2)])
def test_diloco_equals_reference_on_gloo(mode: str, world: int, ranks) -> None:
    """F=1, tau=0, no compression: 4 outer rounds equal the plain Gloo reference (rtol 1e-5)."""
    with MODES[mode].setup() as env:
        ranks(_exact_rank, world, timeout_s=170, env=env)


def _streaming_rank(rank: int, world: int, backend: str) -> None:
    import torch.distributed as dist
    from support.diloco_ref import make_model

    init_pg(rank, world, backend=backend)
    try:
        gloo = dist.new_group(backend="gloo")
        for sync_every, delay, alpha in ((4, 1, 0.5), (4, 0, 0.0), (6, 2, 0.3)):
            model = make_model()
            frags = [model[0], model[2]]
            from support.diloco_ref import inner_step, optimizers
            import libmccl
            inner, outer = optimizers(model)
            with libmccl.DiLoCo(model, inner, outer, sync_every=sync_every, fragments=frags, delay=delay,
                                alpha=alpha) as d:
                for t in range(1, 17):
                    inner_step(model, inner, rank, t)
            mine = [g for f in d.state_dict()["fragment_state"] for g in f["global"].values()]
            ref = _reference(rank, 16, gloo, sync_every, delay, alpha, split=True)
            _close(mine, ref)
            assert d.fragments == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mode", "backend"), [("inprocess", "mccl"), ("inprocess", "gloo"), ("daemon", "mccl")])
def test_streaming_equals_reference(mode: str, backend: str, ranks) -> None:
    """F=2 fragments at staggered steps, all-reduces waited tau steps later, merged with alpha."""
    with MODES[mode].setup() as env:
        ranks(_streaming_rank, 2, backend, timeout_s=170, env=env)


def _checkpoint_rank(rank: int, world: int) -> None:
    """Stopping mid-round with an all-reduce in flight, saving, and resuming in fresh objects
    gives the numbers of the run that never stopped."""
    import torch
    import torch.distributed as dist
    import libmccl
    from support.diloco_ref import inner_step, make_model, optimizers

    init_pg(rank, world)
    try:
        kw = dict(sync_every=4, fragments=2, delay=1, alpha=0.25)
        straight, _ = _train(rank, 14, None, **kw)

        model = make_model()
        inner, outer = optimizers(model)
        with libmccl.DiLoCo(model, inner, outer, **kw) as d:
            for t in range(1, 7):          # fragment 1 was sent at step 6; its result is due at 7
                inner_step(model, inner, rank, t)
            blob = io.BytesIO()
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": d.state_dict()}, blob)
            d._hook.remove()          # this run stops here; the resumed one goes on
            d._hook = None
            for f in d._fragments:
                f.pending = None
        saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
        model = make_model(seed=5)         # other numbers, all replaced by the checkpoint
        inner, outer = optimizers(model)
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        d = libmccl.DiLoCo(model, inner, outer, **kw)
        d.load_state_dict(saved["diloco"])
        assert d.step == 6 and d._fragments[1].pending is not None
        with d:
            for t in range(7, 15):
                inner_step(model, inner, rank, t)
        resumed = [g for f in d.state_dict()["fragment_state"] for g in f["global"].values()]
        _close(resumed, straight, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_checkpoint_resumes_exactly(ranks) -> None:
    ranks(_checkpoint_rank, 2, timeout_s=170)


def _join_rank(rank: int, world: int, port_a: int, port_b: int) -> list:
    """Ranks 0 and 1 train 6 inner steps as a world of 2; then a world of 3 forms (as after an
    elastic re-form) and rank 2 joins with its own, different model: it takes theta_global and
    the outer optimizer's state at the next sync (step 8) with weight 0, and its first round
    counts for the share of the round it made (2 of 4 steps at step 10)."""
    import datetime
    import torch
    import torch.distributed as dist
    import libmccl
    from support.diloco_ref import inner_step, make_model, optimizers

    timeout = datetime.timedelta(seconds=120)
    kw = dict(sync_every=4)
    if rank < 2:
        dist.init_process_group("mccl", init_method=f"tcp://127.0.0.1:{port_a}", rank=rank, world_size=2,
                                timeout=timeout)
        model = make_model()
        inner, outer = optimizers(model)
        d = libmccl.DiLoCo(model, inner, outer, fragments=[model[0], model[2]], **kw)
        with d:
            for t in range(1, 7):
                inner_step(model, inner, rank, t)
        dist.destroy_process_group()
    dist.init_process_group("mccl", init_method=f"tcp://127.0.0.1:{port_b}", rank=rank, world_size=3,
                            timeout=timeout)
    try:
        if rank == 2:
            model = make_model(seed=7)
            inner, outer = optimizers(model)
            d = libmccl.DiLoCo(model, inner, outer, fragments=[model[0], model[2]], join=True, **kw)
        with d:
            if rank == 2:
                assert d.step == 8 and d._fragments[0].pending is None      # met the sync of step 8
            while d.step < 16:
                inner_step(model, inner, rank, d.step + 1)
        sd = d.state_dict()
        # Plain lists: tensors through the result queue would be shared memory the exiting rank owns.
        return [[g.tolist() for g in f["global"].values()] for f in sd["fragment_state"]]
    finally:
        dist.destroy_process_group()


def _join_reference() -> list:
    """The same run in one process: three models, the schedule and the weights written out."""
    import torch
    from support.diloco_ref import inner_step, make_model, optimizers

    models = [make_model(), make_model(), make_model(seed=7)]
    opts = [optimizers(m) for m in models]
    frags = [[list(m[0].parameters()), list(m[2].parameters())] for m in models]
    glob = [[p.detach().clone() for p in frags[0][f]] for f in range(2)]
    outer_opt = opts[0][1]          # rank 0's outer optimizer stands for theta_global's

    def sync(f: int, members: list[int], weights: list[float]) -> None:
        with torch.no_grad():
            total = sum(weights)
            avg = [sum(w * (g - frags[r][f][i].detach()) for r, w in zip(members, weights)) / total
                   for i, g in enumerate(glob[f])]
            for p in frags[0][0] + frags[0][1]:
                p.grad = None
            for p, g, a in zip(frags[0][f], glob[f], avg):
                p.copy_(g)
                p.grad = a
            outer_opt.step()
            for i, p in enumerate(frags[0][f]):
                glob[f][i].copy_(p)
            for r in members:
                for p, g in zip(frags[r][f], glob[f]):
                    p.copy_(g)

    for t in range(1, 17):
        members = [0, 1] if t <= 8 else [0, 1, 2]
        for r in members:
            inner_step(models[r], opts[r][0], r, t)
        if t == 8:
            # rank 2 arrives: it takes theta_global before fragment 0's outer step, weight 0.
            members = [0, 1, 2]
            with torch.no_grad():
                for f in range(2):
                    for p, g in zip(frags[2][f], glob[f]):
                        p.copy_(g)
        if t % 4 == 0:
            sync(0, members, [1.0, 1.0, 0.0] if t == 8 else [1.0] * len(members))
        elif t % 4 == 2:
            sync(1, members, [1.0, 1.0, 0.5] if t == 10 else [1.0] * len(members))
    return glob


@pytest.mark.timeout(200)
def test_join_takes_state_and_weights_by_inner_steps(ranks) -> None:
    import torch

    results = [[[torch.tensor(g) for g in f] for f in r] for r in
               ranks(_join_rank, 3, free_port(), free_port(), timeout_s=170)]
    expected = _join_reference()
    for got in results:
        for gf, ef in zip(got, expected):
            _close(gf, ef)
    for r in (1, 2):
        for gf, ff in zip(results[r], results[0]):
            assert all(torch.equal(a, b) for a, b in zip(gf, ff))


def _misuse_rank(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    import libmccl
    from mccl_common.errors import ConfigError
    from libmccl.torch.backend import ProcessGroupMCCL
    from support.diloco_ref import inner_step, make_model, optimizers

    init_pg(rank, world)
    try:
        model = make_model()
        inner, outer = optimizers(model)

        def refused(match: str, *args, **kw) -> None:
            with pytest.raises(ConfigError, match=match):
                libmccl.DiLoCo(*args, **kw)

        refused("H must be an integer >= 1", model, inner, outer, sync_every=0)
        refused("not a multiple of the 3 fragments", model, inner, outer, sync_every=4, fragments=3)
        refused(r"0 <= tau < H/F = 2", model, inner, outer, sync_every=4, fragments=2, delay=2)
        refused("mixing factor", model, inner, outer, sync_every=4, alpha=1.5)
        refused("is the inner optimizer", model, inner, inner, sync_every=4)
        refused("does not cover", model, inner, torch.optim.SGD(model[0].parameters(), lr=0.7), sync_every=4)
        refused("not one of off, bf16", model, inner, outer, sync_every=4, compression="int4")
        # mccl without compression in its settings: asking for int8 must not send fp32.
        refused("sends its all-reduces uncompressed", model, inner, outer, sync_every=4, compression="int8")
        gloo = dist.new_group(backend="gloo")
        refused("gloo backend cannot compress", model, inner, outer, sync_every=4, compression="bf16", group=gloo)
        meta = make_model().to("meta")
        refused("has no backend for that device", meta, *optimizers(meta), sync_every=4)

        # A group whose backend reports the mode is taken, and its all-reduce carries the round.
        real = ProcessGroupMCCL.__dict__["compression"]
        ProcessGroupMCCL.compression = property(lambda self: "bf16")
        try:
            with libmccl.DiLoCo(model, inner, outer, sync_every=2, compression="bf16") as d:
                for t in range(1, 3):
                    inner_step(model, inner, rank, t)
            assert d._fragments[0].rounds == 1
            refused("compresses its all-reduces", model, inner, outer, sync_every=4, compression="off")
        finally:
            ProcessGroupMCCL.compression = real

        # Each fragment's outer gradient goes out in the same buffer every round, and no other
        # fragment's: the engine's error feedback for compressed all-reduces is kept per buffer.
        sent: list = []
        real_all_reduce = dist.all_reduce

        def recording(tensor, *args, **kw):
            sent.append((tensor.numel(), tensor.data_ptr()))
            return real_all_reduce(tensor, *args, **kw)

        dist.all_reduce = recording
        try:
            twins = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))   # fragments of one size
            inner, outer = optimizers(twins)
            with libmccl.DiLoCo(twins, inner, outer, sync_every=2, fragments=[twins[0], twins[1]]):
                for t in range(1, 9):
                    inner.zero_grad()
                    twins(torch.randn(3, 4)).square().mean().backward()
                    inner.step()
        finally:
            dist.all_reduce = real_all_reduce
        frag0, frag1 = sent[1::2], sent[0::2]          # fragment 1 syncs first (steps 1, 3, ...)
        assert len(sent) == 8 and len(set(frag0)) == 1 and len(set(frag1)) == 1 and set(frag0) != set(frag1)

        # A parameter replaced by one of another shape is refused at the next sync.
        model = make_model()
        inner, outer = optimizers(model)
        with pytest.raises(ConfigError, match="changed from"):
            with libmccl.DiLoCo(model, inner, outer, sync_every=2):
                inner_step(model, inner, rank, 1)
                model[2].bias.data = torch.zeros(5)
                model[2].bias.grad = None      # AdamW skips it; the hook after its step does not
                inner.step()
        # Ranks at different steps of the schedule are told so, not left to mismatch.
        model = make_model()
        inner, outer = optimizers(model)
        with pytest.raises(ConfigError, match="different points of the schedule"):
            with libmccl.DiLoCo(model, inner, outer, sync_every=2) as d:
                d.step = 2 * rank              # as if rank 1 had run a round more
                inner_step(model, inner, rank, 1)
                inner_step(model, inner, rank, 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_misuse_is_refused_by_name(ranks) -> None:
    ranks(_misuse_rank, 2, timeout_s=170)


def _compressed_rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import libmccl
    from mccl_common.errors import ConfigError
    from support.diloco_ref import batch

    init_pg(rank, world)

    def run(mode, group) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3))
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with libmccl.DiLoCo(model, inner, outer, sync_every=4, compression=mode, group=group):
            for t in range(1, 17):
                x, y = batch(rank, t)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    try:
        exact = run("off", None)
        with pytest.raises(ConfigError, match="sends its all-reduces uncompressed"):
            run("int8", None)
        out = {}
        for mode in ("bf16", "int8"):
            group = dist.new_group(backend="mccl", pg_options=libmccl.Options(compression=mode,
                                                                               compression_min_bytes=0))
            got = run(mode, group)
            with pytest.raises(ConfigError, match="compresses its all-reduces"):
                run("off", group)
            out[mode] = (float((got - exact).abs().max()), float(exact.abs().max()), got.tolist()[:64])
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_compressed_outer_gradients_go_through_the_compressing_group(ranks) -> None:
    """compression='int8'/'bf16' runs over a group whose engine compresses: the result moves off the
    exact one by about the codec's error, and every rank ends on the same bits."""
    import dataclasses
    from mccl_common.settings import EngineConfig

    if "compression" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        pytest.skip("this build's engine has no MCCL_COMPRESSION (the compressed all-reduce, issue 38)")
    results = ranks(_compressed_rank, 2, timeout_s=170)
    for mode, bound in (("bf16", 1e-2), ("int8", 2e-2)):
        diff, scale, head = results[0][mode]
        assert 0 < diff < bound * scale, (mode, diff, scale)
        assert head == results[1][mode][2]
