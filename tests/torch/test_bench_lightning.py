"""tools.bench's Lightning workload (tools/bench/lightning_step.py): its plumbing without
lightning, and two ranks through mccld training Lightning's own model with DDP's defaults and
with libmccl.ddp_shared_buckets (lightning is a test dependency, scripts/setup.sh installs it;
the skip is for a checkout set up without it)."""

from __future__ import annotations

import pytest

from support.collective_suite import MODES


def test_lightning_workload_plumbing():
    import libmccl
    from tools.bench import lightning_step
    from tools.bench.report import _ddp_lines
    from tools.bench.sweep import WORKLOADS

    assert "lightning" in WORKLOADS
    assert lightning_step.strategy_kwargs("ddp", "gloo") == {"process_group_backend": "gloo"}
    shared = lightning_step.strategy_kwargs("shared", "mccl")
    assert shared == {"gradient_as_bucket_view": True, "process_group_backend": "mccl"}
    assert callable(libmccl.lightning_callback)
    with pytest.raises(ValueError, match="unknown Lightning variant"):
        lightning_step.strategy_kwargs("nocomm", "mccl")
    assert lightning_step.node_env(3) == {"NODE_RANK": "3", "LOCAL_RANK": "0"}
    row = {"grad_bytes": 58.5e6, "steps": 10, "step_ms": 250.0, "compute_ms": 200.0, "wire_floor_ms": None,
           "shared_ms": 230.0, "config": {"model": "LightningTransformer"}}
    lines = _ddp_lines({"ddp": {"mccl-daemon": row}})
    assert "LightningTransformer" in lines[0] and "buckets in shared memory 230.0 ms" in lines[1], lines


def _rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from support.ranks import init_pg
    from tools.bench import lightning_step

    init_pg(rank, world)
    try:
        out = lightning_step.run(torch, dist, {"warmup": 1, "steps": 2, "batch": 2, "seq": 8, "vocab": 500,
                                               "variants": ["ddp", "shared"]}, rank)
        return {"steps": len(out["step_s"]), "shared": len(out["shared_s"]),
                "zero_copy": dist.group.WORLD.communicator.stats()["zero_copy_ops"]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_lightning_trainer_steps_through_mccld(ranks):
    pytest.importorskip("lightning")
    with MODES["daemon"].setup() as env:
        out = ranks(_rank, 2, timeout_s=200, env=dict(env, MCCL_DAEMON_FAST_BYTES="4096"))
    for r in out:
        assert r["steps"] == 2 and r["shared"] == 2, out
        assert r["zero_copy"] >= 3, out   # the shared variant's buckets ran in place
