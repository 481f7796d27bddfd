"""Compressed gradients through torch (docs/compression.md): an unchanged DDP script under
MCCL_COMPRESSION=int8, the explicit comm hook (libmccl.compressed_allreduce_hook), per-group
Options, and the refusal under MCCL_DAEMON=1. Forked ranks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(180)

_STEPS = 6


def _train(rank: int, hook: str | None) -> list:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import libmccl

    torch.manual_seed(0)
    # 64x1024 + 1024x256 float32 weights: buckets well above MCCL_COMPRESSION_MIN_BYTES.
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
    model = DDP(net, bucket_cap_mb=0.5)
    if hook:
        model.register_comm_hook(libmccl.CompressionState(hook), libmccl.compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(11 + rank)
    for _ in range(_STEPS):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 256, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_rank(rank: int, world: int, hook: str | None) -> list:
    import torch.distributed as dist

    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        return [p.numpy().tobytes() for p in _train(rank, hook)]
    finally:
        dist.destroy_process_group()


def _close(a: list, b: list) -> float:
    import numpy as np

    num = sum(float(np.sum((np.frombuffer(x, np.float32) - np.frombuffer(y, np.float32)) ** 2.0)) for x, y in zip(a, b))
    den = sum(float(np.sum(np.frombuffer(y, np.float32) ** 2.0)) for y in b)
    return (num / den) ** 0.5


def test_unchanged_ddp_script_and_the_hook_train_compressed(ranks) -> None:
    world = 3   # not a power of two; the engine's tests cover 2-9 ranks
    exact = ranks(_ddp_rank, world, None, timeout_s=150, env={"MCCL_COMPRESSION": "off"})
    by_env = ranks(_ddp_rank, world, None, timeout_s=150, env={"MCCL_COMPRESSION": "int8"})
    by_hook = ranks(_ddp_rank, world, "int8", timeout_s=150, env={"MCCL_COMPRESSION": "off"})
    for run in (exact, by_env, by_hook):
        for r in range(1, world):
            assert run[r] == run[0], "ranks' parameters differ"   # every rank decodes the same bits
    for run in (by_env, by_hook):
        assert run[0] != exact[0], "the gradients were not compressed"
        assert _close(run[0], exact[0]) < 1e-3   # int8 gradients, fed back: parameters stay close
    # The hook and the environment run the same engine path: the same AVG of the same buckets
    # (DDP's default divides, then sums; so the last bits may differ, nothing more).
    assert _close(by_env[0], by_hook[0]) < 1e-4


def _daemon_refused(rank: int, world: int) -> str:
    from mccl_common.errors import ConfigError
    from support.ranks import init_pg

    try:
        init_pg(rank, world, timeout_s=20)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_compression_under_the_daemon_is_refused_not_ignored(ranks) -> None:
    out = ranks(_daemon_refused, 2, timeout_s=60, env={"MCCL_DAEMON": "1", "MCCL_COMPRESSION": "int8"})
    for msg in out:
        assert "MCCL_COMPRESSION=int8 is not supported with MCCL_DAEMON=1" in msg


def test_group_options_take_and_check_compression() -> None:
    import libmccl
    from mccl_common.errors import ConfigError
    from mccl_common.settings import EngineConfig, load

    cfg = libmccl.Options(compression="bf16", compression_min_bytes=1 << 20).apply(load(EngineConfig, env={}))
    assert (cfg.compression, cfg.compression_min_bytes, cfg.compression_error_feedback) == ("bf16", 1 << 20, True)
    with pytest.raises(ConfigError, match="MCCL_COMPRESSION"):
        libmccl.Options(compression="zip").apply(load(EngineConfig, env={}))
    with pytest.raises(ConfigError, match="MCCL_COMPRESSION"):
        load(EngineConfig, env={"MCCL_COMPRESSION": "int4"}).validate()
