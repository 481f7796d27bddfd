"""libmccl.lightning_diloco_callback under a real Lightning Trainer (2 forked ranks, CPU,
DDPStrategy): an unchanged LightningModule trained with DiLoCo gives the numbers of the plain
reference (support/diloco_ref.py, one all_reduce per parameter on Gloo): F=1 after 4 outer
rounds, and streaming (2 fragments, a delay, a mixing factor), on mccl and on Gloo."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.timeout(120)

H, ROUNDS = 3, 4


def _close(a, b) -> None:
    import torch

    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), (x - y).abs().max()


def _fit(rank: int, world: int, backend: str, steps: int, **kw) -> tuple[list, object]:
    import torch

    import libmccl
    from support.diloco_ref import batch, make_model
    from support.lightning_fit import fit, module

    net = make_model()
    frags = kw.pop("split", False)
    cb = libmccl.lightning_diloco_callback(fragments=[net[0], net[2]] if frags else 1, **kw)
    loader = torch.utils.data.DataLoader([batch(rank, t) for t in range(1, steps + 1)], batch_size=None)
    fit(rank, world, module(net, 0.01, "adamw"), loader, [cb], steps, backend)
    return [p.detach().clone() for p in net.parameters()], cb.diloco


def _rank(rank: int, world: int, backend: str) -> dict:
    import torch.distributed as dist

    from support.diloco_ref import make_model, optimizers, reference
    from support.ranks import init_pg

    init_pg(rank, world, backend=backend)
    try:
        gloo = dist.new_group(backend="gloo")
        mine, d = _fit(rank, world, backend, H * ROUNDS, sync_every=H)
        model = make_model()
        inner, outer = optimizers(model)
        ref = reference(model, inner, outer, rank, H * ROUNDS, H, [list(model.parameters())], 0, 0.0, gloo)
        # After the last sync every rank holds theta_global: the reference's.
        _close(mine, ref)
        syncs = d.syncs
        streaming = None
        if backend == "mccl":
            steps, sync_every, delay, alpha = 16, 4, 1, 0.5
            _, d = _fit(rank, world, backend, steps, sync_every=sync_every, delay=delay, alpha=alpha, split=True)
            mine = [g for f in d.state_dict()["fragment_state"] for g in f["global"].values()]
            model = make_model()
            inner, outer = optimizers(model)
            ref = reference(model, inner, outer, rank, steps, sync_every,
                            [list(model[0].parameters()), list(model[2].parameters())], delay, alpha, gloo)
            _close(mine, ref)
            streaming = d.syncs
        return {"syncs": syncs, "streaming": streaming, "params": [p.tolist() for p in mine],
                "via_daemon": "libmccl.daemon.client" in sys.modules}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["mccl", "gloo"])
def test_lightning_diloco_equals_reference(backend: str, ranks) -> None:
    out = ranks(_rank, 2, backend, timeout_s=100)
    # Under DDP's gradient all-reduce (the callback not turning it off) or with no DiLoCo at all
    # the parameters would not be the reference's (asserted in the ranks); the rounds ran:
    assert [o["syncs"] for o in out] == [ROUNDS, ROUNDS]
    if backend == "mccl":
        assert [o["streaming"] for o in out] == [8, 8]   # 2 fragments, each every 4 of 16 steps
    assert out[0]["params"] == out[1]["params"]


def test_lightning_diloco_through_mccld_equals_reference(daemon, ranks) -> None:
    _, env = daemon
    out = ranks(_rank, 2, "mccl", timeout_s=100, env=dict(env, MCCL_DAEMON="1"))
    assert [o["syncs"] for o in out] == [ROUNDS, ROUNDS] and [o["streaming"] for o in out] == [8, 8]
    assert out[0]["params"] == out[1]["params"] and all(o["via_daemon"] for o in out)


def _compressed_rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from support.diloco_ref import make_model, optimizers, reference
    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        gloo = dist.new_group(backend="gloo")
        mine, d = _fit(rank, world, "mccl", H * ROUNDS, sync_every=H, compression="bf16")
        model = make_model()
        inner, outer = optimizers(model)
        ref = reference(model, inner, outer, rank, H * ROUNDS, H, [list(model.parameters())], 0, 0.0, gloo)
        # bf16 outer gradients (8 bits of mantissa): near the fp32 reference, not equal to it
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(mine, ref))
        return {"syncs": d.syncs, "compression": d.compression, "err": err,
                "exact": all(torch.equal(a, b) for a, b in zip(mine, ref)), "params": [p.tolist() for p in mine]}
    finally:
        dist.destroy_process_group()


def test_lightning_diloco_passes_compression_through(ranks) -> None:
    # the group compresses (DiLoCo refuses bf16 over a group that would send fp32); the tiny model
    # is below the default threshold, so every size is compressed here
    out = ranks(_compressed_rank, 2, timeout_s=100,
                env={"MCCL_COMPRESSION": "bf16", "MCCL_COMPRESSION_MIN_BYTES": "0"})
    assert [o["syncs"] for o in out] == [ROUNDS, ROUNDS] and out[0]["params"] == out[1]["params"]
    assert {o["compression"] for o in out} == {"bf16"}
    assert all(0 < o["err"] < 0.02 for o in out) and not any(o["exact"] for o in out), out[0]["err"]


def _misuse(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    import libmccl
    from mccl_common.errors import ConfigError
    from support.diloco_ref import make_model
    from support.lightning_fit import fit, module
    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        net = make_model()
        tiny = module(net, 0.01)
        tiny.configure_optimizers = lambda: [torch.optim.SGD(net[0].parameters(), lr=0.1),
                                             torch.optim.SGD(net[2].parameters(), lr=0.1)]
        tiny.automatic_optimization = False
        tiny.training_step = lambda b, i: None
        loader = torch.utils.data.DataLoader([(torch.zeros(2, 8), torch.zeros(2, 3))] * 2, batch_size=None)
        with pytest.raises(ConfigError, match="2 optimizers: DiLoCo needs exactly one") as err:
            fit(rank, world, tiny, loader, [libmccl.lightning_diloco_callback(sync_every=2)], 2, "mccl")
        return str(err.value)
    finally:
        dist.destroy_process_group()


def test_lightning_diloco_refuses_two_optimizers(ranks) -> None:
    ranks(_misuse, 2, timeout_s=100)
    with pytest.raises(Exception, match="H must be an integer"):
        import libmccl

        libmccl.lightning_diloco_callback(sync_every=0)
    # adaptive ranks would end the fit at different rounds: refused when the callback is made
    with pytest.raises(Exception, match="adaptive=True is not available under Lightning"):
        libmccl.lightning_diloco_callback(sync_every=4, adaptive=True)


def _resume_rank(rank: int, world: int, ckpt: str) -> dict:
    """Six inner steps, Lightning's checkpoint, a fresh Trainer resuming from it for six more:
    the twelve steps of the reference (theta_global and the outer momentum came back). The
    inner optimizer is SGD: Lightning's checkpoint is rank 0's, so with AdamW every rank would
    resume with rank 0's moments (docs/diloco.md)."""
    import torch
    import torch.distributed as dist

    import libmccl
    from support.diloco_ref import batch, make_model, reference
    from support.lightning_fit import fit, module
    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        gloo = dist.new_group(backend="gloo")
        half = H * ROUNDS // 2

        def loader(first: int):
            return torch.utils.data.DataLoader([batch(rank, t) for t in range(first, first + half)], batch_size=None)

        # Each fit ends at its epoch's end: resumed mid-epoch, Lightning replays a loader that
        # keeps no state from its start (its behaviour, not DiLoCo's).
        cb = libmccl.lightning_diloco_callback(sync_every=H)
        trainer = fit(rank, world, module(make_model(), 0.05), loader(1), [cb], -1, "mccl", max_epochs=1)
        trainer.save_checkpoint(ckpt)      # every rank takes part; rank 0 writes
        dist.barrier(group=gloo)
        net = make_model(seed=1)           # other weights: the checkpoint must bring them back
        cb2 = libmccl.lightning_diloco_callback(sync_every=H)
        fit(rank, world, module(net, 0.05), loader(half + 1), [cb2], -1, "mccl", ckpt_path=ckpt, max_epochs=2)
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        ref = reference(model, inner, outer, rank, 2 * half, H, [list(model.parameters())], 0, 0.0, gloo)
        _close([p.detach() for p in net.parameters()], ref)
        return {"steps": cb2.diloco.step, "syncs": cb2.diloco.syncs}
    finally:
        dist.destroy_process_group()


def test_lightning_diloco_resumes_from_a_checkpoint(ranks, tmp_path) -> None:
    out = ranks(_resume_rank, 2, str(tmp_path / "diloco.ckpt"), timeout_s=100)
    assert out == [{"steps": H * ROUNDS, "syncs": ROUNDS // 2}] * 2
