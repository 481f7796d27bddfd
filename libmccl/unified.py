"""MPS tensors and Apple unified memory: the staging path that exists, the fast path that does not.

On Apple silicon the CPU and GPU share one memory. Two ways to run a collective on an
``mps`` tensor follow from that; ``MCCL_UNIFIED_COLLECTIVE`` picks between them:

``=0``, staging (implemented, used today)
    ``staging_copy_to_cpu`` waits for the work queued on the tensor (a blocking
    ``.to("cpu")`` synchronises the MPS stream) and copies it into an ordinary CPU
    buffer the engine works on; ``copy_back`` copies the result into the ``mps`` tensor
    when the operation completes. Costs two memory copies per collective.

``=1``, unified collective (NOT implemented in this build)
    The engine would reduce in the shared-storage ``MTLBuffer`` behind the tensor, with
    no copies: an ``MTLSharedEvent`` signalled by the MPS command queue tells the
    engine the producer kernels are done, the engine signals back when the result is
    in place, and received segments are combined by the Metal kernels in
    ``metal/reduce.metal``. That needs an Objective-C++ bridge to Metal, which this
    repository does not contain (it can be neither built nor tested on the Linux CI);
    it would implement ``device_order.DeviceOps``, whose protocol already runs for the
    fake device and CUDA (metal/README.md says how).
    ``UnifiedCollective`` is its entry point and raises ``ConfigError`` saying so.

Both helpers also accept CPU tensors, which is how the staging path is tested on Linux.
"""

from __future__ import annotations

import platform

import torch

from .errors import ConfigError

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
    """Whether the unified-memory collective can run here, and if not, why.

    Always False in this build; the reason tells macOS users the missing piece.
    """
    if platform.system() != "Darwin":
        return False, f"the unified-memory collective needs macOS with MPS, this is {platform.system()}"
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        return False, "the unified-memory collective needs macOS with MPS, and torch reports MPS unavailable"
    return False, ("the unified-memory collective needs the Objective-C++ Metal bridge, "
                   "which this build of MCCL does not include")


class UnifiedCollective:
    """Entry point of the zero-copy MPS path (``MCCL_UNIFIED_COLLECTIVE=1``).

    Not implemented in this build (see the module docstring): constructing it raises
    ``ConfigError`` naming what is missing and how to fall back to staging.
    """

    def __init__(self, comm: object = None) -> None:
        _, why = unified_available()
        raise ConfigError(f"[metal] {why}; set MCCL_UNIFIED_COLLECTIVE=0 to stage mps tensors "
                          "through CPU copies")
