"""Every private or experimental torch API MCCL relies on, in one place.

torch.distributed's extension surface for out-of-tree backends moves between
releases (method renames, constructor overloads, group-name plumbing). Nothing else
in libmccl touches ``torch._C`` or underscore attributes; tests/torch/test_compat.py pins
each assumption below against the installed torch so an upgrade fails loudly there
instead of deep inside a collective.

Verified against torch 2.13 (distributed_c10d.py, _C/_distributed_c10d.pyi,
include/torch/csrc/distributed/c10d/PyProcessGroup.hpp).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

# A Python subclass of ProcessGroup is driven by torch's PyProcessGroup trampoline:
# C++ callers (DDP's reducer, functional collectives, FSDP) reach our Python methods
# for the collectives it forwards. Only the (rank, size) constructor builds the
# trampoline ("alias") instance; the (store, rank, size) overload fails with
# "returned holder-wrapped instance is not an alias instance".
ProcessGroupBase = _c10d.ProcessGroup

# Subclassing Work gives PyWork: C++ wait() and getFuture() dispatch to Python, so a
# typed Python exception raised in wait() reaches the caller unchanged.
WorkBase = dist.Work

ReduceOp = dist.ReduceOp


class _Outcome:
    __slots__ = ("value", "error")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error


def _deliver(settled: Any) -> Any:
    outcome = settled.value()
    if outcome.error is not None:
        raise outcome.error
    return outcome.value


class ResultFuture:
    """The future a Work hands out, failed so that C++ consumers see an error.

    ``torch.futures.Future.set_exception`` only stores the exception as the future's
    *value* plus a Python unwrap function: C++ readers of the underlying c10 future
    (DDP's reducer, TorchScript's wait) see a success holding a non-tensor, and DDP's
    ``parseCppCommHookResult`` crashes on it. An exception raised in a ``then``
    callback is the one public way to put an error on a c10 future, so ``future`` is
    chained off ``settled`` through a callback that raises the failure. Python waiters
    of ``future`` get it as RuntimeError carrying the typed error's name and message
    (torch rewraps it); ``MCCLWork.wait`` raises the typed error itself.
    """

    def __init__(self) -> None:
        # Completed (always successfully) once the outcome is known.
        self.settled: torch.futures.Future = torch.futures.Future()
        self.future: torch.futures.Future = self.settled.then(_deliver)

    def set_result(self, value: Any) -> None:
        self.settled.set_result(_Outcome(value, None))

    def set_exception(self, error: BaseException) -> None:
        self.settled.set_result(_Outcome(None, error))

    def on_failure(self, fn: Callable[[BaseException], None]) -> None:
        """Calls ``fn`` with the typed error (not torch's RuntimeError rewrap) if it fails."""
        def check(settled: Any) -> None:
            error = settled.value().error
            if error is not None:
                fn(error)
        self.settled.add_done_callback(check)


# Methods torch renamed: the trampoline (and distributed_c10d.py) look for either
# spelling, so the backend defines both. new name -> old name.
RENAMED_METHODS: dict[str, str] = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}

# Sentinel torch passes for "no per-call timeout" (c10d kUnsetTimeout is -1 ms and
# Work::wait's kNoTimeout is 0 ms).
_UNSET_MS = (-1, 0)


def register_backend(name: str, creator: Callable[..., Any], devices: list[str]) -> None:
    """Register ``creator(dist_backend_opts, backend_options)`` under ``name``.

    extended_api=True hands us c10d's DistributedBackendOptions, which carries the
    group id (used in log messages and store keys) besides store/rank/size/timeout.
    """
    dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)


def is_backend_registered(name: str) -> bool:
    return name.upper() in getattr(dist.Backend, "_plugins", {})


def declare_devices(pg: Any, devices: list[str]) -> None:
    """Make ``pg._device_types`` list our devices (DCP, state-dict broadcast and
    DeviceMesh read it) without a C++ Backend object behind them."""
    custom = ProcessGroupBase.BackendType.CUSTOM
    for device in devices:
        pg._register_backend(torch.device(device), custom, None)


def device_types(pg: Any) -> list[torch.device]:
    return list(pg._device_types)


def coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
    """torch's context manager that batches collectives (FSDP1 and some user code use it)."""
    return dist._coalescing_manager(group=group, device=device, async_ops=async_ops)


def premul_sum(factor: float) -> Any:
    """The PREMUL_SUM reduce op (which mccl refuses), for tests of that refusal."""
    return dist._make_nccl_premul_sum(factor)


def reduce_op_kind(op: Any) -> Any:
    """The RedOpType of ``op``, which may be a ReduceOp instance, a RedOpType or an
    options object's ``reduceOp`` field."""
    if isinstance(op, ReduceOp.RedOpType):
        return op
    if isinstance(op, ReduceOp):
        # A ReduceOp instance compares equal to its RedOpType; recover the latter.
        for kind in ReduceOp.RedOpType.__members__.values():
            if op == kind:
                return kind
    raise TypeError(f"not a torch.distributed.ReduceOp: {op!r}")


def timedelta_seconds(value: Any) -> float | None:
    """Seconds in a c10d timeout argument, or None when it means "unset"."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        ms = round(value.total_seconds() * 1000)
    else:  # some bindings hand over an int of milliseconds
        ms = int(value)
    if ms in _UNSET_MS or ms < 0:
        return None
    return ms / 1000.0


def options_timeout(opts: Any) -> float | None:
    """Per-call timeout in a collective's options object, if the caller set one."""
    return timedelta_seconds(getattr(opts, "timeout", None))


def options_or_default(opts: Any, cls: Any) -> Any:
    """A collective's options object, or ``cls()`` when the caller passed none."""
    return cls() if opts is None else opts
