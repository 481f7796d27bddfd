"""What a staged device collective refuses, and that a refused call leaves nothing behind:
its StagedOp is abandoned (every ticket poisoned, so its blocks and words are reclaimed)."""

from __future__ import annotations

import ctypes
import datetime

import pytest
import torch
import torch.distributed as dist

from libmccl.devices import device_tensors
from libmccl.torch.backend import ProcessGroupMCCL
from mccl_common.errors import ConfigError
from libmccl.devices.fake_device import FakeDevice


@pytest.fixture
def solo():
    fakes = [FakeDevice(seed=1, unified=False), FakeDevice(seed=2, unified=False)]
    for f in fakes:
        device_tensors.install(f)
    pg = ProcessGroupMCCL(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    yield pg, fakes
    pg.shutdown()
    for f in fakes:
        device_tensors.uninstall(f)
        f.close()


def _tensor(fake: FakeDevice, numel: int) -> torch.Tensor:
    addr = fake.alloc(numel * 4)
    return torch.frombuffer((ctypes.c_char * (numel * 4)).from_address(addr), dtype=torch.float32)


def _last_op(fake: FakeDevice):
    return device_tensors._ledger(fake)._ops[-1]


def test_a_non_contiguous_device_output_is_refused(solo) -> None:
    pg, (fake, _) = solo
    with pytest.raises(ConfigError, match="not contiguous"):
        pg.all_gather_single(_tensor(fake, 16)[::2], _tensor(fake, 8))
    assert _last_op(fake).reusable()


def test_tensors_of_two_devices_in_one_call_are_refused(solo) -> None:
    pg, (a, b) = solo
    with pytest.raises(ConfigError, match="one device per process"):
        pg.all_gather_single(_tensor(a, 8), _tensor(b, 8))
    assert _last_op(a).reusable()
