"""Pins every private torch API libmccl relies on (libmccl/torch/compat.py) against
the installed torch, and the registration paths (entry point, import, explicit)."""

from __future__ import annotations

import datetime
import importlib.metadata
import inspect
import logging
import re
import sys

import pytest
import torch
import torch.distributed as dist

import libmccl
from libmccl.torch import compat
from libmccl.torch.backend import ProcessGroupMCCL

from support.ranks import run_command


@pytest.mark.timeout(30)
def test_subclass_constructor_and_device_declaration() -> None:
    class Probe(compat.ProcessGroupBase):
        pass

    pg = Probe(0, 1)  # the (rank, size) overload builds the trampoline instance
    compat.declare_devices(pg, ["cpu", "mps"])
    assert sorted(d.type for d in compat.device_types(pg)) == ["cpu", "mps"]
    with pytest.raises(TypeError, match="alias"):
        Probe(dist.HashStore(), 0, 1)


def _methods_called_by_c10d() -> set[str]:
    """Every ``group.<method>(`` that distributed_c10d.py calls on a process group."""
    src = inspect.getsource(dist.distributed_c10d)
    names = set(re.findall(r"\bgroup\.([a-z][a-z_]*)\(", src))
    return names - {"rank", "size", "bound_device_id"}


@pytest.mark.timeout(30)
def test_every_collective_c10d_calls_is_overridden() -> None:
    called = _methods_called_by_c10d()
    assert {"allreduce", "broadcast", "all_gather_single", "reduce_scatter_single"} <= called, called
    own = {n for klass in ProcessGroupMCCL.__mro__ if klass.__module__.startswith("libmccl")
           for n in vars(klass)}
    missing = sorted(called - own)
    assert not missing, f"torch calls these on process groups but ProcessGroupMCCL does not define them: {missing}"


@pytest.mark.timeout(30)
def test_both_spellings_of_renamed_methods() -> None:
    for new, old in compat.RENAMED_METHODS.items():
        assert getattr(ProcessGroupMCCL, new) is getattr(ProcessGroupMCCL, old), (new, old)
        # torch still knows one of the two spellings (else the rename table is stale).
        assert hasattr(compat.ProcessGroupBase, new) or hasattr(compat.ProcessGroupBase, old), (new, old)


@pytest.mark.timeout(30)
def test_reduce_op_kind_and_timeouts() -> None:
    R = dist.ReduceOp
    assert compat.reduce_op_kind(R.SUM) == R.RedOpType.SUM
    assert compat.reduce_op_kind(R(R.MAX)) == R.RedOpType.MAX
    assert compat.reduce_op_kind(dist.AllreduceOptions().reduceOp) == R.RedOpType.SUM
    assert compat.reduce_op_kind(compat.premul_sum(2.0)) == R.RedOpType.PREMUL_SUM
    with pytest.raises(TypeError):
        compat.reduce_op_kind("sum")
    assert compat.timedelta_seconds(datetime.timedelta(seconds=2.5)) == 2.5
    assert compat.timedelta_seconds(datetime.timedelta(0)) is None
    assert compat.timedelta_seconds(None) is None
    assert compat.options_timeout(dist.AllreduceOptions()) is None  # c10d's "unset"


@pytest.mark.timeout(30)
def test_work_subclass_keeps_typed_errors() -> None:
    from mccl_common.errors import PeerLostError
    from libmccl.torch.work import MCCLWork

    w = MCCLWork("allreduce", 0, [torch.ones(1)], (), None, 5.0)
    assert isinstance(w, dist.Work)
    chained = w.get_future().then(lambda f: f.value())
    w._complete(PeerLostError("[engine] link lost", peer_rank=1), -1)
    with pytest.raises(PeerLostError):
        w.wait()
    # The future carries the error as torch's C++ futures do: a RuntimeError naming ours.
    with pytest.raises(RuntimeError, match="PeerLostError: \\[engine\\] link lost"):
        w.get_future().value()
    with pytest.raises(RuntimeError, match="PeerLostError"):
        chained.wait()
    assert w.is_completed() and not w.is_success()


@pytest.mark.timeout(30)
def test_result_future_fails_for_cxx_readers() -> None:
    from support.futures import cxx_wait

    # Why ResultFuture exists: set_exception reads as a success in C++ (DDP's reducer).
    plain = torch.futures.Future()
    plain.set_exception(ValueError("lost"))
    cxx_wait(plain)
    failed = compat.ResultFuture()
    assert not failed.future.done()
    failed.set_exception(ValueError("lost"))
    assert failed.settled.done() and failed.future.done()
    with pytest.raises(RuntimeError, match="TorchScript"):
        cxx_wait(failed.future)
    with pytest.raises(RuntimeError, match="ValueError: lost"):
        failed.future.wait()
    ok = compat.ResultFuture()
    ok.set_result([torch.ones(2)])
    cxx_wait(ok.future)
    assert torch.equal(ok.future.wait()[0], torch.ones(2))


@pytest.mark.timeout(30)
def test_registration_signature_and_capabilities() -> None:
    params = inspect.signature(dist.Backend.register_backend).parameters
    assert {"extended_api", "devices"} <= set(params), params
    libmccl.register()  # idempotent
    assert dist.is_backend_available("mccl")
    assert dist.Backend.backend_capability["mccl"] == ["cpu", "mps", "cuda"]
    assert dist.Backend._plugins["MCCL"].extended_api is True


@pytest.mark.timeout(30)
def test_entry_point_is_declared() -> None:
    eps = importlib.metadata.entry_points(group="torch.backends")
    assert any(ep.name == "mccl" and ep.value == "libmccl:_autoload" for ep in eps), list(eps)


@pytest.mark.timeout(60)
def test_plain_import_torch_registers_mccl() -> None:
    """An unchanged script: nothing of ours imported explicitly."""
    code = "import torch.distributed as dist; print(dist.is_backend_available('mccl'))"
    out = run_command([sys.executable, "-c", code], 50)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.timeout(30)
def test_autoload_never_raises(monkeypatch, caplog) -> None:
    def broken(*args, **kwargs) -> None:
        raise RuntimeError("simulated registration failure")

    monkeypatch.setattr(libmccl, "_registered", False)
    monkeypatch.setattr(compat, "is_backend_registered", lambda name: False)
    monkeypatch.setattr(compat, "register_backend", broken)
    with caplog.at_level(logging.WARNING, logger="libmccl"):
        libmccl._autoload()
    assert "simulated registration failure" in caplog.text
    with pytest.raises(RuntimeError):
        libmccl.register()
