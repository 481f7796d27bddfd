"""DDP driven through the fake device: every gradient bucket reaches the engine by the
ordering protocol (device_order), and the trained parameters equal Gloo's.

The fake device cannot run DDP's autograd kernels (they are torch's CPU kernels), so a
comm hook stands in for the GPU's last writes: it takes the bucket DDP filled, blanks it
with NaN and queues a jittered fake kernel that writes the gradients back, then issues
the all-reduce right behind it, as DDP does on an accelerator. Without O1 the engine
would reduce NaNs; without O2 the fake device would raise DeviceRace.
"""

from __future__ import annotations

import pytest

from support.ranks import init_pg
from support.training import make_batches, make_model, reference, train


def _hook(fake):
    import torch.distributed as dist

    def hook(state, bucket):
        buf = bucket.buffer()
        span = (buf.data_ptr(), buf.numel() * buf.element_size())
        fake.adopt(*span)  # DDP's bucket lives in the fake device's memory
        grads = buf.clone()
        buf.fill_(float("nan"))  # what the device memory holds until the kernel ran
        fake.launch(None, lambda: buf.copy_(grads), [span], "backward writes the bucket")
        fut = dist.all_reduce(buf, op=dist.ReduceOp.AVG, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])  # DDP wants the tensor; nothing here touches it
    return hook


def _ddp_fake_rank(rank: int, world: int, broken: str = "") -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from libmccl.devices import device_tensors
    from libmccl.devices.fake_device import FakeDevice

    if broken:
        from support import device_order_mutants

        getattr(device_order_mutants, broken)(pytest.MonkeyPatch())  # this process only
    init_pg(rank, world)
    fake = FakeDevice(seed=rank, max_jitter_s=0.003)
    device_tensors.install(fake)
    try:
        gloo = dist.new_group(backend="gloo")
        model = DDP(make_model(), bucket_cap_mb=0.001)  # ~1 KB buckets: several per step
        model.register_comm_hook(None, _hook(fake))
        steps = []

        def synced(*_):
            fake.synchronize()  # the device ran everything queued during the step
            steps.append(1)
        model.register_forward_pre_hook(synced)
        mccl_model = train(model, make_batches(world), rank, world).module
        fake.synchronize()
        gloo_model = train(DDP(make_model(), process_group=gloo), make_batches(world), rank, world).module
        for pm, pg, pr in zip(mccl_model.parameters(), gloo_model.parameters(), reference(world)):
            assert torch.allclose(pm, pg, atol=1e-6), (pm - pg).abs().max()
            assert torch.allclose(pm, pr, atol=1e-5), (pm - pr).abs().max()
        assert not torch.allclose(next(mccl_model.parameters()), next(make_model().parameters()))
        return len(steps)
    finally:
        device_tensors.uninstall(fake)
        fake.close()
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_ddp_through_the_fake_device_matches_gloo(ranks) -> None:
    assert ranks(_ddp_fake_rank, 2, timeout_s=150) == [5, 5]


def _ddp_broken_rank(rank: int, world: int) -> str:
    from mccl_common.errors import MCCLError

    try:
        _ddp_fake_rank(rank, world, "drop_o1")
    except MCCLError as exc:  # the racing rank's DeviceRace; its peer may see the echo of it
        return type(exc).__name__
    return "trained"


@pytest.mark.timeout(180)
def test_ddp_without_o1_fails_with_a_race(ranks) -> None:
    assert "DeviceRace" in ranks(_ddp_broken_rank, 2, timeout_s=150)
