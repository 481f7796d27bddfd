"""Compressed gradients through torch (docs/compression.md): an unchanged DDP script under
MCCL_COMPRESSION=int8, the explicit comm hook (libmccl.compressed_allreduce_hook), per-group
Options, and the setting under MCCL_DAEMON=1 on one host. Forked ranks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(180)

_STEPS = 6


def _train(rank: int, group, hook: str | None) -> list:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import libmccl

    torch.manual_seed(0)
    # 64x1024 + 1024x256 float32 weights: buckets well above MCCL_COMPRESSION_MIN_BYTES.
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
    model = DDP(net, process_group=group, bucket_cap_mb=0.5)
    if hook:
        model.register_comm_hook(libmccl.CompressionState(hook, group), libmccl.compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(11 + rank)
    for _ in range(_STEPS):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 256, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def _ddp_rank(rank: int, world: int) -> dict:
    """Under MCCL_COMPRESSION=int8 the default group compresses (the unchanged script); a group
    with Options(compression="off") is exact, and the hook compresses over it."""
    import torch.distributed as dist

    import libmccl
    from support.ranks import init_pg

    init_pg(rank, world)
    try:
        exact_group = dist.new_group(list(range(world)), pg_options=libmccl.Options(compression="off"))
        return {"by_env": _train(rank, None, None), "exact": _train(rank, exact_group, None),
                "by_hook": _train(rank, exact_group, "int8")}
    finally:
        dist.destroy_process_group()


def _close(a: list, b: list) -> float:
    import numpy as np

    num = sum(float(np.sum((np.frombuffer(x, np.float32) - np.frombuffer(y, np.float32)) ** 2.0)) for x, y in zip(a, b))
    den = sum(float(np.sum(np.frombuffer(y, np.float32) ** 2.0)) for y in b)
    return (num / den) ** 0.5


def test_unchanged_ddp_script_and_the_hook_train_compressed(ranks) -> None:
    world = 3   # not a power of two; the engine's tests cover 2-9 ranks
    out = ranks(_ddp_rank, world, timeout_s=150, env={"MCCL_COMPRESSION": "int8"})
    for key in ("exact", "by_env", "by_hook"):
        for r in range(1, world):
            assert out[r][key] == out[0][key], f"{key}: ranks' parameters differ"   # the same decoded bits
    exact = out[0]["exact"]
    for key in ("by_env", "by_hook"):
        assert out[0][key] != exact, f"{key}: the gradients were not compressed"
        assert _close(out[0][key], exact) < 1e-3, key   # int8 gradients, fed back: parameters stay close
    # The hook and the environment run the same engine path (DDP's default divides, then sums;
    # the hook averages in the engine: the last bits may differ, nothing more).
    assert _close(out[0]["by_env"], out[0]["by_hook"]) < 1e-4


def _daemon_one_host(rank: int, world: int) -> dict:
    import os

    import torch
    import torch.distributed as dist

    from support.ranks import init_pg

    init_pg(rank, world, timeout_s=30)
    try:
        t = torch.full((1 << 16,), float(rank + 1))      # 256 KB: past MCCL_COMPRESSION_MIN_BYTES
        dist.all_reduce(t)
        from pathlib import Path

        from mccld.attach import local_request
        jobs = local_request(Path(os.environ["MCCL_RUNTIME_DIR"]), {"type": "status"})["status"]["jobs"]
        return {"exact": bool((t == world * (world + 1) / 2).all()), "compression": [j["compression"] for j in jobs]}
    finally:
        dist.destroy_process_group()


def test_compression_under_the_daemon_runs_and_one_host_stays_exact(ranks) -> None:
    """Under MCCL_DAEMON=1 the setting reaches mccld (it refused it before); the ranks of one host
    are summed in shared memory, exactly: only what crosses hosts is compressed
    (tests/daemon/test_daemon_compression.py has the multi-host results)."""
    from support.daemon import running_daemon

    with running_daemon() as (_d, env):
        out = ranks(_daemon_one_host, 2, timeout_s=60,
                    env={"MCCL_DAEMON": "1", "MCCL_COMPRESSION": "int8", "MCCL_RUNTIME_DIR": env["MCCL_RUNTIME_DIR"]})
        assert out == [{"exact": True, "compression": ["int8"]}] * 2   # mccld holds the job as int8


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
