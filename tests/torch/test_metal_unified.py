"""libmccl.devices.unified on Linux: the staging helpers work on CPU tensors, the unified path refuses."""

from __future__ import annotations

import platform

import pytest
import torch

from libmccl.devices import unified
from mccl_common.errors import ConfigError


@pytest.mark.timeout(30)
def test_staging_copy_is_a_contiguous_private_copy() -> None:
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # non-contiguous view
    cpu = unified.staging_copy_to_cpu(src)
    assert cpu.device.type == "cpu" and cpu.is_contiguous()
    assert cpu.dtype == src.dtype and cpu.shape == src.shape and torch.equal(cpu, src)
    cpu.add_(100)  # the engine overwrites the staging buffer; the caller's tensor must not move
    assert torch.equal(src, torch.arange(24, dtype=torch.float32).reshape(4, 6).t())
    flat = torch.ones(5, dtype=torch.bfloat16)
    assert unified.staging_copy_to_cpu(flat).data_ptr() != flat.data_ptr()


@pytest.mark.timeout(30)
def test_copy_back_writes_into_the_tensor_even_when_strided() -> None:
    base = torch.zeros(4, 6, dtype=torch.int64)
    dst = base.t()
    result = torch.arange(24, dtype=torch.int64).reshape(6, 4)
    unified.copy_back(dst, result)
    assert torch.equal(dst, result) and torch.equal(base, result.t())


@pytest.mark.timeout(30)
def test_round_trip_through_staging() -> None:
    t = torch.randn(1000, dtype=torch.float16)
    cpu = unified.staging_copy_to_cpu(t)
    cpu.mul_(2)
    unified.copy_back(t, cpu)
    assert torch.equal(t, cpu)


@pytest.mark.timeout(30)
def test_bad_arguments_raise_config_error() -> None:
    t = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"\[metal\] copy_back: result is torch.float64\(3,\)"):
        unified.copy_back(t, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ConfigError, match="staging buffer must mirror"):
        unified.copy_back(t, torch.zeros(4))
    with pytest.raises(ConfigError, match="must be a CPU tensor"):
        unified.copy_back(t, torch.zeros(3, device="meta"))
    with pytest.raises(ConfigError, match="is on meta"):
        unified.staging_copy_to_cpu(torch.zeros(3, device="meta"))
    with pytest.raises(ConfigError, match="must be a torch.Tensor"):
        unified.staging_copy_to_cpu([1.0, 2.0])


@pytest.mark.timeout(30)
def test_unified_collective_says_why_it_is_unavailable_off_macos() -> None:
    ok, why = unified.unified_available()
    if platform.system() != "Darwin":
        assert not ok and "needs macOS with MPS" in why
