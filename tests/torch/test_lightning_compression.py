"""libmccl.lightning_compression_callback under a real Lightning Trainer (2 forked ranks, CPU):
the hook is installed on the DDP model Lightning wraps, and the parameters after training are
those of a plain DDP loop with the same hook, bit for bit; on Gloo it is refused by name."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

STEPS = 4
MIN_BYTES = 1024    # the net's buckets (~33 KB) are under the 64 KiB default: compress them anyway


def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 16))


def _batches(rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]


def _plain(rank: int, hook: bool) -> list:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import libmccl

    net = _net()
    model = DDP(net)
    if hook:
        model.register_comm_hook(libmccl.CompressionState("int8", min_bytes=MIN_BYTES),
                                 libmccl.compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(rank):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().numpy().tobytes() for p in net.parameters()]


def _HooksSeen():  # noqa: N802 - a Callback class, made where lightning is imported
    import lightning.pytorch as pl

    class HooksSeen(pl.Callback):
        """The comm hooks on Lightning's DDP model while it trains (the fit's end unwraps it)."""

        hooks: list = []

        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.hooks = [(h.__name__, type(s).__name__) for h, s in trainer.strategy.model._comm_hooks]

    return HooksSeen()


def _rank(rank: int, world: int, backend: str) -> dict:
    import torch
    import torch.distributed as dist

    import libmccl
    from mccl_common.errors import ConfigError
    from support.lightning_fit import fit, module
    from support.ranks import init_pg

    init_pg(rank, world, backend=backend)
    try:
        net = _net()
        cb = libmccl.lightning_compression_callback("int8", min_bytes=MIN_BYTES)
        loader = torch.utils.data.DataLoader(_batches(rank), batch_size=None)
        if backend != "mccl":
            with pytest.raises(ConfigError, match="backend is 'gloo', not mccl") as err:
                fit(rank, world, module(net, 0.1), loader, [cb], STEPS, backend)
            return {"refused": str(err.value)}
        seen = _HooksSeen()
        trainer = fit(rank, world, module(net, 0.1), loader, [cb, seen], STEPS, backend)
        hooks = seen.hooks
        return {"hooks": hooks, "steps": trainer.global_step, "codec": cb.state.codec,
                "lightning": [p.detach().numpy().tobytes() for p in net.parameters()],
                "plain_hook": _plain(rank, True), "plain_exact": _plain(rank, False)}
    finally:
        dist.destroy_process_group()


def test_lightning_compression_callback_trains_as_the_plain_hook(ranks) -> None:
    out = ranks(_rank, 2, "mccl", timeout_s=100)
    for o in out:
        assert o["hooks"] == [("compressed_allreduce_hook", "CompressionState")] and o["codec"] == "int8", o["hooks"]
        assert o["steps"] == STEPS
        assert o["lightning"] == o["plain_hook"], "Lightning with the callback differs from the plain hooked loop"
        # The callback doing nothing would train DDP's exact average: int8 moved the bits.
        assert o["lightning"] != o["plain_exact"], "the gradients were not compressed"
    assert out[0]["lightning"] == out[1]["lightning"]


def test_lightning_compression_callback_refused_on_gloo(ranks) -> None:
    out = ranks(_rank, 2, "gloo", timeout_s=100)
    assert all("compression runs in mccl's engine" in o["refused"] for o in out)


def test_missing_lightning_names_the_install(monkeypatch) -> None:
    import sys

    import libmccl

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)   # None in sys.modules: import raises ImportError
    makers = (libmccl.lightning_compression_callback, libmccl.lightning_callback,
              lambda: libmccl.lightning_diloco_callback(sync_every=2),
              lambda: libmccl.lightning_speed_balancer_callback(8))
    for make in makers:
        with pytest.raises(ImportError, match="Lightning is not installed: pip install lightning"):
            make()


def test_a_strategy_without_ddp_is_refused_by_name() -> None:
    """The callbacks need the DDP model to put their hook on: any other strategy's model is a
    ConfigError naming strategy='ddp', never a fit that silently runs without the hook."""
    from types import SimpleNamespace

    import torch

    from libmccl.torch.lightning import ddp_model
    from mccl_common.errors import ConfigError

    trainer = SimpleNamespace(strategy=SimpleNamespace(model=torch.nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="needs Trainer\\(strategy='ddp'\\).*Linear, not a DistributedDataParallel"):
        ddp_model(trainer, "lightning_compression_callback")
