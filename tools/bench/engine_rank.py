"""One engine-only rank of the scale benchmark: ``python -m tools.bench.engine_rank '<json plan>'``.

It never imports torch: the C++ engine (``libmccl._core``) and numpy only, so a few hundred
ranks fit on a 16-core machine (a torch rank costs ~1.5 s of CPU and ~300 MB to start).
``torch_imported`` in its result says whether that held.

Rendezvous: each rank listens on its host's address and publishes it as a file in the
plan's directory, sealed with a MAC under a key derived from the job key for this
communicator (mccl_common/store_auth.py), and reads every peer's back through the same
check: the ranks act on no address that someone without the job key could have written.
The engine's links then prove the job key themselves (``secret=``).

For each algorithm of the plan (``auto`` = the engine's choice; another name is pinned with
``MCCL_ALGO`` where the engine has it) it builds one communicator and, per (op, size),
checks one op's result on known data, warms up, agrees with the other ranks on an
iteration count (the slowest rank's estimate, through the engine's own MAX all-reduce)
and on whether the size still fits the plan's deadline, then times ``repeats`` loops.
Its measurements are rewritten to ``<out_dir>/<series>-rank<r>.json`` after every size, so
a run cut short still returns what it measured.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from libmccl import _core
from mccl_common import jobkey, store_auth
from mccl_common.errors import ConfigError, MCCLError
from mccl_common.settings import EngineConfig, load
from .metrics import op_elements
from .worker import die_with_parent

F32 = int(_core.DType.float32)
F64 = int(_core.DType.float64)
SUM = int(_core.ReduceOp.SUM)
MAX = int(_core.ReduceOp.MAX)
_POLL_S = 0.005


def _write_sealed(d: Path, name: str, key: bytes | None, value: str) -> None:
    tmp = d / f".{name}.tmp"
    tmp.write_bytes(store_auth.seal(key, name, value.encode()))
    os.replace(tmp, d / name)


def rendezvous(plan: dict, scope: str, rank: int, world: int, wire: str) -> tuple["_core.Listener", list[str]]:
    """Listen on the host's address, publish it sealed, read every rank's through the MAC check."""
    d = Path(plan["rdzv_dir"]) / scope
    d.mkdir(parents=True, exist_ok=True)
    key = store_auth.job_store_key(wire, "bench-scale", plan["run_id"], scope)
    lst = _core.Listener(plan["addr"], 0)
    _write_sealed(d, f"addr.{rank}", key, lst.address)
    deadline = time.monotonic() + plan["rdzv_timeout_s"]
    addrs: list[str | None] = [None] * world
    while True:
        for r in range(world):
            if addrs[r] is None and (d / f"addr.{r}").exists():
                blob = (d / f"addr.{r}").read_bytes()
                addrs[r] = store_auth.open(key, f"addr.{r}", blob, peer=str(d), component="bench").decode()
        if all(a is not None for a in addrs):
            return lst, addrs  # type: ignore[return-value]
        if time.monotonic() > deadline:
            missing = [r for r, a in enumerate(addrs) if a is None]
            raise MCCLError(f"[bench] rendezvous in {d}: ranks {missing[:8]} never published their address within "
                            f"{plan['rdzv_timeout_s']:.0f}s; likely cause: they failed to start (see their logs)")
        time.sleep(_POLL_S * 4)


def _options(cfg: EngineConfig, plan: dict, algo: str) -> "_core.Options":
    opts = cfg.engine_options(_core.Options(), plan["timeout_s"], plan["connect_timeout_s"])
    if algo == "ring":  # also on an engine without MCCL_ALGO: no one-round path under the small-op threshold
        opts.small_allreduce_bytes = 0
    # Pinning an algorithm: MCCL_ALGO (read by engines that have it), and the option where it exists.
    if algo != "auto":
        os.environ["MCCL_ALGO"] = algo
        for field in ("algo", "algorithm"):
            if hasattr(opts, field):
                setattr(opts, field, algo)
    else:
        os.environ.pop("MCCL_ALGO", None)
    return opts


class _Op:
    """numpy buffers and a run() for one (op, count); check() verifies one op on known data."""

    def __init__(self, comm, op: str, count: int, rank: int, world: int, timeout_s: float):  # noqa: ANN001
        self.comm, self.op, self.count, self.rank, self.world, self.timeout_s = comm, op, count, rank, world, timeout_s
        blk = count // world
        if op in ("all_reduce", "broadcast"):
            self.buf = np.zeros(count, np.float32)
        elif op == "all_gather":
            self.inp, self.out = np.zeros(blk, np.float32), np.zeros(count, np.float32)
        elif op == "reduce_scatter":
            self.inp, self.out = np.zeros(count, np.float32), np.zeros(blk, np.float32)
        else:
            raise ConfigError(f"[bench] unknown op {op!r}")

    def submit(self) -> int:
        c, op = self.comm, self.op
        if op == "all_reduce":
            return c.allreduce(self.buf.ctypes.data, self.count, F32, SUM)
        if op == "broadcast":
            return c.broadcast(self.buf.ctypes.data, self.buf.nbytes, 0)
        if op == "all_gather":
            return c.allgather(self.inp.ctypes.data, self.out.ctypes.data, self.inp.nbytes)
        return c.reduce_scatter(self.inp.ctypes.data, self.out.ctypes.data, self.out.size, F32, SUM)

    def run(self) -> None:
        self.comm.wait(self.submit(), self.timeout_s)

    def check(self) -> None:
        r, n, count = self.rank, self.world, self.count
        pattern = (np.arange(count) % 7).astype(np.float32)
        blk = count // n
        if self.op == "all_reduce":
            self.buf[:] = pattern + (r + 1)
            self.run()
            got, want = self.buf, pattern * n + n * (n + 1) / 2
        elif self.op == "broadcast":
            self.buf[:] = pattern + 3 if r == 0 else 0
            self.run()
            got, want = self.buf, pattern + 3
        elif self.op == "all_gather":
            self.inp[:] = pattern[:blk] + (r + 1)
            self.run()
            got, want = self.out, np.concatenate([pattern[:blk] + (q + 1) for q in range(n)])
        else:  # block b of rank q's input holds (q+1)(b+1)
            self.inp[:] = np.repeat(np.arange(1, n + 1, dtype=np.float32), blk) * (r + 1)
            self.run()
            got, want = self.out, np.full(blk, (r + 1) * n * (n + 1) / 2, np.float32)
        bad = np.flatnonzero(got != want)
        if len(bad):
            i = int(bad[0])
            raise MCCLError(f"[bench] {self.op} of {count} float32 returned a wrong result on rank {r}: element "
                            f"{i} is {got[i]}, expected {want[i]} ({len(bad)} wrong); do not trust its timings")
        for a in (getattr(self, x) for x in ("buf", "inp", "out") if hasattr(self, x)):
            a[:] = 0


def _agree_max(comm, value: float, timeout_s: float) -> float:  # noqa: ANN001
    """The largest ``value`` over all ranks (the engine's all-reduce, MAX)."""
    v = np.array([value], np.float64)
    comm.wait(comm.allreduce(v.ctypes.data, 1, F64, MAX), timeout_s)
    return float(v[0])


def _pingpong_alpha(comm, rank: int, rounds: int, timeout_s: float) -> float:  # noqa: ANN001
    """alpha of the emulation as it stands (its delay and the CPUs' own latency): half the median
    round trip of 8 bytes between ranks 0 and 1, agreed by every rank (the others send nothing)."""
    buf = np.zeros(1, np.float64)
    rtts = []
    if rank in (0, 1):
        peer = 1 - rank
        for _ in range(rounds):
            t0 = time.perf_counter()
            if rank == 0:
                comm.wait(comm.send(buf.ctypes.data, 8, peer, 1), timeout_s)
                comm.wait(comm.recv(buf.ctypes.data, 8, peer, 1), timeout_s)
            else:
                comm.wait(comm.recv(buf.ctypes.data, 8, peer, 1), timeout_s)
                comm.wait(comm.send(buf.ctypes.data, 8, peer, 1), timeout_s)
            rtts.append(time.perf_counter() - t0)
    return _agree_max(comm, statistics.median(rtts) / 2 if rank == 0 else 0.0, timeout_s)


def _measure(comm, plan: dict, op: str, nbytes: int, rank: int, world: int, deadline: float) -> dict | None:  # noqa: ANN001
    count = op_elements(op, nbytes, world)
    if count == 0:
        return None
    t_start = time.monotonic()
    o = _Op(comm, op, count, rank, world, plan["timeout_s"])
    o.check()
    t_check = time.monotonic() - t_start
    # Stop before a size that would overrun the deadline: at least warm-up + 2 ops more, on every rank alike.
    if _agree_max(comm, float(time.monotonic() + t_check * (plan["warmup"] + 2) > deadline), plan["timeout_s"]):
        return {"op": op, "bytes": count * 4, "skipped": f"out of time (one op took {t_check:.2f}s)"}
    for _ in range(plan["warmup"]):
        o.run()
    comm.wait(comm.barrier(), plan["timeout_s"])
    t0 = time.perf_counter()
    o.run()
    one = _agree_max(comm, time.perf_counter() - t0, plan["timeout_s"])
    left = max(deadline - time.monotonic(), 0.0)
    budget = min(plan["target_s"], left / (plan["repeats"] + 1))
    iters = max(1, min(plan["max_iters"], math.floor(budget / max(one, 1e-7))))
    times = []
    for _ in range(plan["repeats"]):
        comm.wait(comm.barrier(), plan["timeout_s"])
        t0 = time.perf_counter()
        for _ in range(iters):
            o.run()
        times.append((time.perf_counter() - t0) / iters)
    if rank == 0:
        print(f"[bench] {plan['series']} {op} {count * 4} B: {statistics.median(times) * 1e6:.1f} us/op x{iters}",
              file=sys.stderr, flush=True)
    return {"op": op, "bytes": count * 4, "count": count, "iters": iters, "times_s": times}


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def run(plan: dict) -> dict:
    rank, world = plan["rank"], plan["world"]
    cfg = load(EngineConfig)
    secret = jobkey.engine_secret(cfg.wire_security)
    deadline = time.monotonic() + plan["deadline_s"]
    out = {"rank": rank, "world": world, "pid": os.getpid(), "wire_security": cfg.wire_security,
           "small_allreduce_bytes": cfg.small_allreduce_bytes, "series": {}}
    path = os.path.join(plan["out_dir"], f"rank{rank}.json")
    for algo in plan["algos"]:
        rows: list[dict] = []
        series = {"algo": algo, "results": rows}
        out["series"][algo] = series
        plan = {**plan, "series": algo}
        opts = _options(cfg, plan, algo)
        t0 = time.monotonic()
        lst, addrs = rendezvous(plan, algo, rank, world, cfg.wire_security)
        comm = _core.Communicator(rank, world, plan["comm_ids"][algo], lst, addrs, opts, None, secret=secret)
        series["init_s"] = time.monotonic() - t0
        try:
            if hasattr(comm, "alpha_beta"):
                series["alpha_beta"] = list(comm.alpha_beta())
            elif world > 1:
                series["pingpong_alpha_s"] = _pingpong_alpha(comm, rank, plan.get("pingpong_rounds", 30),
                                                             plan["timeout_s"])
            # This algorithm's share of the time left, so a slow one cannot starve the next.
            algos_left = len(plan["algos"]) - plan["algos"].index(algo)
            share = time.monotonic() + (deadline - time.monotonic()) / algos_left
            for op in plan["ops"]:
                skipped = None
                for nbytes in plan["sizes"]:
                    row = ({"op": op, "bytes": nbytes, "skipped": skipped} if skipped else
                           _measure(comm, plan, op, nbytes, rank, world, share))
                    if row is None:
                        continue
                    skipped = row.get("skipped")   # the sizes after one out of time are larger still
                    rows.append(row)
                    out["torch_imported"] = "torch" in sys.modules
                    _write(path, out)
        finally:
            comm.shutdown(10.0)     # raises on a failed shutdown: this rank then has no shutdown_ok
            series["shutdown_ok"] = True
    out["torch_imported"] = "torch" in sys.modules
    _write(path, out)
    return out


def main() -> int:
    die_with_parent()
    run(json.loads(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
