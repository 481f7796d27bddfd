"""The in-process engine, the solo (world size 1) and the daemon communicators implement
``libmccl.communicator.Communicator``: each operation with the protocol's parameters, in
its order, under its names, with its defaults (extra parameters only optional ones),
returning what it says; and one all_reduce runs through each."""

from __future__ import annotations

import datetime
import inspect
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from libmccl import _core
from libmccl.communicator import Communicator
from libmccl.daemon.client import DaemonCommunicator
from libmccl.torch.solo_comm import SoloCommunicator

pytestmark = pytest.mark.timeout(120)

METHODS = [name for name, v in vars(Communicator).items() if inspect.isfunction(v) and not name.startswith("_")]


def _pybind_params(fn: Any) -> tuple[list[inspect.Parameter], str]:
    """A pybind11 method's parameters and return type, from the signature line of its docstring."""
    line = fn.__doc__.splitlines()[0]
    m = re.match(r"\w+\((.*)\) -> (.+)$", line)
    assert m, line
    params, depth, cur, kind = [], 0, "", inspect.Parameter.POSITIONAL_OR_KEYWORD
    parts: list[str] = []
    for ch in m.group(1) + ",":
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    for part in parts[1:]:           # parts[0] is self
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name, _, rest = part.partition(":")
        default = rest.partition("=")[2].strip() if "=" in rest else inspect.Parameter.empty
        params.append(inspect.Parameter(name.strip(), kind, default=default))
    return params, m.group(2).strip()


def _params(impl: type, name: str) -> tuple[list[inspect.Parameter], str]:
    fn = getattr(impl, name)
    if impl is _core.Communicator:
        return _pybind_params(fn)
    sig = inspect.signature(fn)
    return list(sig.parameters.values())[1:], str(sig.return_annotation)


def _default_text(v: Any) -> str:
    return repr(v).strip("'\"")


def _base_type(annotation: str) -> str:
    """``dict[str, Any]`` and pybind11's ``dict`` are the same type here."""
    return annotation.partition("[")[0]


def conformance_problems(impl: type) -> list[str]:
    problems = []
    for name in METHODS:
        if not callable(getattr(impl, name, None)):
            problems.append(f"{impl.__name__} has no method {name}")
            continue
        want = list(inspect.signature(getattr(Communicator, name)).parameters.values())[1:]
        want_ret = str(inspect.signature(getattr(Communicator, name)).return_annotation)
        got, got_ret = _params(impl, name)
        where = f"{impl.__name__}.{name}"
        for i, w in enumerate(want):
            if i >= len(got) or got[i].name != w.name or got[i].kind != w.kind:
                problems.append(f"{where}: parameter {i + 1} should be {w.name} ({w.kind.description}), got "
                                f"{got[i].name + ' (' + got[i].kind.description + ')' if i < len(got) else 'none'}")
            elif (w.default is inspect.Parameter.empty) != (got[i].default is inspect.Parameter.empty) or (
                    w.default is not inspect.Parameter.empty
                    and _default_text(w.default) != _default_text(got[i].default)):
                problems.append(f"{where}: {w.name} should default to {w.default}, defaults to {got[i].default}")
        for extra in got[len(want):]:
            if extra.default is inspect.Parameter.empty and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
                problems.append(f"{where}: extra parameter {extra.name} must be optional")
        if want_ret not in ("Any", "None") and _base_type(got_ret) != _base_type(want_ret):
            problems.append(f"{where} returns {got_ret}, the protocol says {want_ret}")
        if want_ret == "None" and got_ret not in ("None", "NoneType"):
            problems.append(f"{where} returns {got_ret}, the protocol says None")
    return problems


def test_the_protocol_lists_what_the_backend_calls():
    """Every ``self._comm.<name>`` the torch glue calls is in the protocol."""
    root = Path(__file__).resolve().parents[2] / "libmccl"
    called = set()
    for f in ("torch/backend.py", "torch/exchange.py"):
        called |= set(re.findall(r"self\._comm\.(\w+)", (root / f).read_text()))
    assert called and called <= set(METHODS), sorted(called - set(METHODS))


@pytest.mark.parametrize("impl", [_core.Communicator, SoloCommunicator, DaemonCommunicator],
                         ids=lambda c: c.__name__)
def test_implementation_matches_the_protocol(impl):
    assert conformance_problems(impl) == []


def test_the_check_catches_a_divergent_signature():
    class Renamed(SoloCommunicator):
        def broadcast(self, buf: int, nbytes: int, root: int) -> int:  # buf, not ptr
            return super().broadcast(buf, nbytes, root)

        def send(self, ptr: int, nbytes: int, dst: int, tag: int) -> int:  # tag lost its default
            raise NotImplementedError

    problems = conformance_problems(Renamed)
    assert any("broadcast: parameter 1 should be ptr" in p for p in problems), problems
    assert any("send: tag should default to 0" in p for p in problems), problems


# -- one all_reduce through each ------------------------------------------------------------------
def _allreduce(comm: Communicator, rank: int, world: int, wait) -> None:
    assert isinstance(comm, Communicator)   # every member, the rank/size/comm_id attributes too
    assert (comm.rank, comm.size) == (rank, world)
    a = np.full(33, rank + 1, dtype=np.float32)
    wait(comm.allreduce(a.ctypes.data, a.size, 0, 0))
    assert (a == world * (world + 1) / 2).all(), a


def test_one_allreduce_through_the_engine():
    from support.engine import ranks, run_ranks
    with ranks(2) as comms:
        run_ranks(comms, lambda r, c: _allreduce(c, r, 2, lambda op: c.wait(op, 30.0)))


def test_one_allreduce_through_the_solo_communicator():
    done = []

    def completed(op_id: int) -> None:
        assert op_id in done, "the solo communicator completes each op before returning its id"

    comm = SoloCommunicator(lambda batch: done.extend(op for op, _err, _info in batch))
    _allreduce(comm, 0, 1, completed)
    assert comm.shutdown(10.0) is False


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.cv = threading.Condition()

    def set(self, k: str, v: str) -> None:
        with self.cv:
            self.data[k] = v
            self.cv.notify_all()

    def get(self, k: str) -> str:
        return self.data[k]

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds())


def test_one_allreduce_through_the_daemon(monkeypatch):
    from support.daemon import daemon_env
    from mccl_common.daemon_settings import load_config
    from mccld.daemon import Daemon
    rdir = Path(tempfile.mkdtemp(prefix="mccl-comm-"))
    env = daemon_env(rdir)
    d = Daemon(load_config(env=env)).start()
    monkeypatch.setenv("MCCL_RUNTIME_DIR", str(rdir))
    store, errors = _Store(), []

    def rank(r: int) -> None:
        try:
            comm = DaemonCommunicator(r, 2, 0xC0FFEE + os.getpid(), store, None, None, 30.0)
            comm.set_timeout(20.0)
            _allreduce(comm, r, 2, lambda op: comm.wait(op, 30.0))
            comm.shutdown(10.0)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
    finally:
        d.stop()
        time.sleep(0.1)
        for p in rdir.iterdir():
            p.unlink()
        rdir.rmdir()
