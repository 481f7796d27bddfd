"""MPS tensors staged through CPU copies: the path for mps tensors the Metal bridge does not serve.

On Apple silicon the CPU and GPU share one memory. An mps all-reduce normally goes through
the Metal bridge (``libmccl.devices.metal_tensors``, ``MCCL_UNIFIED_COLLECTIVE=auto|1``): the engine
reduces in the tensor's shared-storage MTLBuffer, ordered by Metal shared events, without
blocking the caller. What it does not serve comes here (``MCCL_UNIFIED_COLLECTIVE=0``,
collectives other than all-reduce, a Mac where the bridge does not load):
``staging_copy_to_cpu`` waits for the work queued on the tensor (a blocking ``.to("cpu")``
synchronises the MPS stream) and copies it into an ordinary CPU buffer the engine works on;
``copy_back`` copies the result into the ``mps`` tensor when the operation completes.
Two memory copies per collective, and the caller waits for the GPU.

Both helpers also accept CPU tensors, which is how the staging path is tested on Linux.
"""

from __future__ import annotations

import platform

import torch

from mccl_common.errors import ConfigError

_STAGEABLE = ("mps", "cpu")


def _check(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"[metal] {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in _STAGEABLE:
        raise ConfigError(f"[metal] {what} is on {t.device}; staging handles mps (and cpu) tensors only, "
                          "move the tensor to mps or cpu first")
    return t


def staging_copy_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor``, taken after its queued GPU work has finished.

    Always a new buffer, never a view of ``tensor`` (also for CPU input), so the engine
    may overwrite it while the caller's tensor stays untouched until ``copy_back``.
    """
    src = _check(tensor, "staging_copy_to_cpu(tensor)").detach()
    # For mps this is a blocking device-to-host copy: it waits for the MPS stream.
    return src.to("cpu", copy=True, memory_format=torch.contiguous_format)


def copy_back(tensor: torch.Tensor, cpu: torch.Tensor) -> None:
    """Copy a collective's result from CPU buffer ``cpu`` into ``tensor`` (mps or cpu).

    Blocking: when it returns, ``cpu`` may be freed or reused.
    """
    dst = _check(tensor, "copy_back(tensor)")
    if not isinstance(cpu, torch.Tensor) or cpu.device.type != "cpu":
        where = cpu.device if isinstance(cpu, torch.Tensor) else type(cpu).__name__
        raise ConfigError(f"[metal] copy_back(cpu) must be a CPU tensor, got {where}")
    if cpu.dtype != dst.dtype or cpu.shape != dst.shape:
        raise ConfigError(f"[metal] copy_back: result is {cpu.dtype}{tuple(cpu.shape)} but the tensor is "
                          f"{dst.dtype}{tuple(dst.shape)}; the staging buffer must mirror the tensor")
    with torch.no_grad():
        dst.copy_(cpu)


def unified_available() -> tuple[bool, str]:
    """Whether the Metal bridge serves mps all-reduces here, and if not, why."""
    if platform.system() != "Darwin":
        return False, f"the unified-memory collective needs macOS with MPS, this is {platform.system()}"
    from . import metal_tensors

    try:
        metal_tensors.device()
    except ConfigError as exc:
        return False, str(exc)
    return True, ""
