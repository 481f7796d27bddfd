"""One campaign rank: a forked child that loops random collectives until a fault stops it.

The campaign's parent process imports numpy and the engine once, then forks each rank
(``run_rank``), which moves into its emulated host's network namespace and builds the
communicator a user's process would build under ``init_process_group("mccl")``:

- ``inproc``: ``libmccl._core.Communicator`` over TCP between the hosts' addresses
  (the engine the torch glue drives with MCCL_DAEMON unset);
- ``daemon``: ``libmccl.daemon.client.DaemonCommunicator`` attached to its host's mccld
  (shared memory + ZeroMQ, the daemons' links between hosts: what MCCL_DAEMON=1 drives).

Only the torch glue (tensor -> pointer) and torch's TCPStore are left out: a file store
in the trial's directory carries the same keys. Every rank draws the same sequence of
collectives, sizes and dtypes from the trial's seed; its inputs are a function of (seed,
op, rank), so each rank computes every peer's inputs and checks each result exactly.
The child writes ``result.<rank>`` (JSON) and leaves with ``os._exit``.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from libmccl import _core
from mccl_common.errors import MCCLError

_CLONE_NEWNET = 0x40000000
_CONNECT_TIMEOUT_S = 30.0
_WAIT_SLACK_S = 30.0          # wait() bound past the group's timeout: the engine's verdict comes first
_MAX_ELEMS_LOG2 = 17          # up to 128 Ki elements per rank and op
_SHUTDOWN_S = 2.0

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int32": np.int32,
          "int64": np.int64, "int8": np.int8, "uint8": np.uint8}
# Inputs are small integers (0..3), so every op below is exact in every dtype for <= 4 ranks
# (AVG is left out: its rounding is the engine's choice, not a fault's).
REDUCE_OPS = {"SUM": np.add, "MIN": np.minimum, "MAX": np.maximum, "PRODUCT": np.multiply}


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world: int
    mode: str                 # "inproc" | "daemon"
    seed: int                 # the trial's: the op sequence
    comm_id: int
    netns: str                # the emulated host's namespace
    host_addr: str
    timeout_s: float
    workdir: Path
    env: dict[str, str]       # MCCL_RUNTIME_DIR and friends of the host's mccld (daemon mode)
    max_ops: int = 0          # stop cleanly after this many (a warm-up job); 0: until a fault


class FileStore:
    """The subset of torch's Store that the daemon client's join uses, on files."""

    def __init__(self, root: Path):
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / ("store-" + key.replace("/", "%"))

    def set(self, key: str, value: str | bytes) -> None:
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(value.encode() if isinstance(value, str) else value)
        os.rename(tmp, self._path(key))

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def check(self, keys: list[str]) -> bool:
        return all(self._path(k).exists() for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"[campaign] Timed out after {timeout.total_seconds():.0f}s waiting for {keys}")
            time.sleep(0.01)


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def _inproc_comm(spec: RankSpec):
    lst = _core.Listener(spec.host_addr, 0)
    store = FileStore(spec.workdir)
    store.set(f"addr/{spec.rank}", lst.address)
    keys = [f"addr/{r}" for r in range(spec.world)]
    store.wait(keys, datetime.timedelta(seconds=_CONNECT_TIMEOUT_S))
    from mccl_common import jobkey
    from mccl_common.settings import EngineConfig, load
    cfg = load(EngineConfig)
    # As the backend builds it: MCCL_WIRE_SECURITY and the job key from the environment.
    opts = cfg.engine_options(_core.Options(), spec.timeout_s, _CONNECT_TIMEOUT_S)
    addrs = [store.get(k).decode() for k in keys]
    return _core.Communicator(spec.rank, spec.world, spec.comm_id, lst, addrs, opts, None,
                              secret=jobkey.engine_secret(cfg.wire_security))


def _daemon_comm(spec: RankSpec):
    os.environ.update(spec.env)
    from libmccl.daemon.client import DaemonCommunicator
    return DaemonCommunicator(spec.rank, spec.world, spec.comm_id, FileStore(spec.workdir), None, None,
                              spec.timeout_s)


def _inputs(seed: int, op_index: int, world: int, n: int, dtype) -> list[np.ndarray]:
    return [np.random.default_rng((seed, op_index, r)).integers(0, 4, n).astype(dtype) for r in range(world)]


class Looper:
    """Draws and runs the trial's collectives, checking each result."""

    def __init__(self, comm, spec: RankSpec):
        self.comm, self.spec = comm, spec
        self.rng = random.Random(spec.seed)
        self.ops = 0
        self.wrong: list[str] = []

    def _wait(self, op_id: int) -> None:
        self.comm.wait(op_id, self.spec.timeout_s + _WAIT_SLACK_S)

    def _check(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        if not np.array_equal(got, want):
            bad = int(np.count_nonzero(got != want))
            self.wrong.append(f"op {self.ops} {what}: {bad}/{want.size} elements wrong")

    def step(self) -> None:
        rng, w, r = self.rng, self.spec.world, self.spec.rank
        kind = rng.choice(("allreduce", "allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
                           "barrier", "batch"))
        dname = rng.choice(sorted(DTYPES))
        dtype = DTYPES[dname]
        n = max(1, int(2 ** rng.uniform(0, _MAX_ELEMS_LOG2)))
        opname = rng.choice(sorted(REDUCE_OPS))
        dt, op = int(getattr(_core.DType, dname)), int(getattr(_core.ReduceOp, opname))
        what = f"{kind} {dname} n={n}"
        if kind == "barrier":
            self._wait(self.comm.barrier())
        elif kind in ("allreduce", "batch"):
            parts = [max(1, n // 4)] * rng.randint(2, 5) if kind == "batch" else [n]
            ins = [_inputs(self.spec.seed, self.ops * 8 + i, w, m, dtype) for i, m in enumerate(parts)]
            bufs = [x[r].copy() for x in ins]
            ids = [self.comm.allreduce(b.ctypes.data, b.size, dt, op) for b in bufs]
            for i in ids:
                self._wait(i)
            for b, x in zip(bufs, ins):
                self._check(f"{what} {opname}", b, REDUCE_OPS[opname].reduce(np.stack(x)).astype(dtype))
        elif kind == "broadcast":
            root = rng.randrange(w)
            ins = _inputs(self.spec.seed, self.ops * 8, w, n, dtype)
            buf = ins[r].copy()
            self._wait(self.comm.broadcast(buf.ctypes.data, buf.nbytes, root))
            self._check(f"{what} root={root}", buf, ins[root])
        elif kind == "allgather":
            ins = _inputs(self.spec.seed, self.ops * 8, w, n, dtype)
            out = np.zeros(n * w, dtype)
            self._wait(self.comm.allgather(ins[r].ctypes.data, out.ctypes.data, ins[r].nbytes))
            self._check(what, out, np.concatenate(ins))
        elif kind == "reduce_scatter":
            ins = _inputs(self.spec.seed, self.ops * 8, w, n * w, dtype)
            out = np.zeros(n, dtype)
            self._wait(self.comm.reduce_scatter(ins[r].ctypes.data, out.ctypes.data, n, dt, op))
            want = REDUCE_OPS[opname].reduce(np.stack([x[r * n:(r + 1) * n] for x in ins])).astype(dtype)
            self._check(f"{what} {opname}", out, want)
        else:  # alltoall: block q of rank p's input lands as block p of rank q's output
            ins = _inputs(self.spec.seed, self.ops * 8, w, n * w, dtype)
            out = np.zeros(n * w, dtype)
            self._wait(self.comm.alltoall(ins[r].ctypes.data, out.ctypes.data, n * ins[r].itemsize))
            self._check(what, out, np.concatenate([x[r * n:(r + 1) * n] for x in ins]))
        self.ops += 1


def _loop(spec: RankSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": spec.rank, "ops": 0, "cls": None}
    try:
        comm = _inproc_comm(spec) if spec.mode == "inproc" else _daemon_comm(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.update(cls=type(e).__name__, msg=f"setup: {e}"[:400], t=time.monotonic(), setup=True)
        return out
    looper = Looper(comm, spec)
    try:
        while not spec.max_ops or looper.ops < spec.max_ops:
            looper.step()
            if looper.ops == 1:
                (spec.workdir / f"ready.{spec.rank}").write_text("1")
    except Exception as e:  # noqa: BLE001 - the fault is expected to land here, typed
        out.update(cls=type(e).__name__, t=time.monotonic(), msg=str(e)[:400],
                   peer_rank=getattr(e, "peer_rank", None), peer_addr=getattr(e, "peer_addr", None),
                   mccl=isinstance(e, MCCLError))
    out.update(ops=looper.ops, wrong=looper.wrong)
    try:
        comm.shutdown(_SHUTDOWN_S)
    except Exception as e:  # noqa: BLE001
        out["shutdown_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def run_rank(spec: RankSpec) -> None:
    """The forked child's whole life; never returns."""
    code = 0
    try:
        log = os.open(spec.workdir / f"rank{spec.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        _enter_netns(spec.netns)
        res = _loop(spec)
        tmp = spec.workdir / f"result.{spec.rank}.tmp"
        tmp.write_text(json.dumps(res))
        os.rename(tmp, spec.workdir / f"result.{spec.rank}")
    except BaseException:  # noqa: BLE001 - a forked child must never return into the parent's code
        import traceback
        traceback.print_exc()
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
