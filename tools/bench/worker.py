"""One rank of a benchmark run: ``python -m tools.bench.worker '<json plan>'``.

Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment like any
torch.distributed program. For each (op, size) it first checks the result of one op on
known data (a wrong answer fails the run: no number is reported for a backend that
corrupts data), then warms up, picks an iteration count all ranks agree on, and times
``repeats`` loops of ``iters`` ops, recording wall time per op and this process's
user+sys CPU time (all its threads, so engine and Gloo threads count) around each loop.
With ``latency_iters`` it first times that many small all_reduces one by one (the
small-op latency); with ``workload: ddp`` it times DDP training steps instead (ddp.py). Writes its measurements as JSON to ``<out_dir>/<series>-rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import statistics
import sys
import time
from typing import Callable

from mccl_common.errors import ConfigError, MCCLError
from .metrics import OPS, op_elements

# Exit code of a rank whose measurements completed but whose shutdown failed.
TEARDOWN_FAILED = 3


def _cpu_seconds(also_pid: int | None = None) -> float:
    # CLOCK_PROCESS_CPUTIME_ID: user+sys of every thread, at ns resolution (os.times()
    # ticks in 10 ms steps, too coarse for a loop of small ops).
    own = time.process_time()
    return own if also_pid is None else own + _other_cpu_seconds(also_pid)


def _other_cpu_seconds(pid: int) -> float:
    """user+sys of all threads of another process (this host's mccld), in clock ticks: the
    work a rank hands to its daemon is part of what the collective costs."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


def _collective(dist, name: str):
    """The tensor-in/tensor-out API, whichever spelling this torch has (2.11 lacks *_single)."""
    return getattr(dist, name + "_single", None) or getattr(dist, {"all_gather": "all_gather_into_tensor",
                                                                    "reduce_scatter": "reduce_scatter_tensor"}[name])


class _Op:
    """Buffers and a zero-argument callable for one (op, element count)."""

    def __init__(self, torch, dist, op: str, count: int, rank: int, world: int, shared: bool = False):
        self.torch, self.dist, self.op, self.count, self.rank, self.world = torch, dist, op, count, rank, world
        z = lambda n: torch.zeros(n, dtype=torch.float32)  # noqa: E731
        if op == "all_reduce":
            if shared:  # --mode daemon-shared: in a buffer mccld maps too, so nothing is copied
                import libmccl
                self.buf = libmccl.shared_empty(count).zero_()
            else:
                self.buf = z(count)
            self.run: Callable[[], None] = lambda: dist.all_reduce(self.buf)
            if os.environ.get("MCCL_BENCH_TICKETS") == "1":
                self.run = _ticketed_all_reduce(torch, dist, self.buf)
        elif op == "broadcast":
            self.buf = z(count)
            self.run = lambda: dist.broadcast(self.buf, src=0)
        elif op == "all_gather":
            self.inp, self.out = z(count // world), z(count)
            fn = _collective(dist, "all_gather")
            self.run = lambda: fn(self.out, self.inp)
        elif op == "reduce_scatter":
            self.inp, self.out = z(count), z(count // world)
            fn = _collective(dist, "reduce_scatter")
            self.run = lambda: fn(self.out, self.inp)
        else:
            raise ConfigError(f"[bench] unknown op {op!r}; choose --ops from {', '.join(OPS)}")

    def check(self) -> None:
        """Run once on data whose answer is known; raise naming the first wrong element."""
        torch, r, n = self.torch, self.rank, self.world
        pattern = lambda k: (torch.arange(k) % 7).to(torch.float32)  # noqa: E731
        if self.op == "all_reduce":
            self.buf.copy_(pattern(self.count) + (r + 1))
            self.run()
            got, want = self.buf, pattern(self.count) * n + n * (n + 1) / 2
        elif self.op == "broadcast":
            self.buf.copy_(pattern(self.count) + 3 if r == 0 else torch.zeros(self.count))
            self.run()
            got, want = self.buf, pattern(self.count) + 3
        elif self.op == "all_gather":
            blk = self.count // n
            self.inp.copy_(pattern(blk) + (r + 1))
            self.run()
            got, want = self.out, torch.cat([pattern(blk) + (q + 1) for q in range(n)])
        else:  # reduce_scatter: block b of rank q's input holds (q+1)*(b+1)
            blk = self.count // n
            self.inp.copy_(torch.cat([torch.full((blk,), float(b + 1)) for b in range(n)]))
            self.inp.mul_(r + 1)
            self.run()
            got, want = self.out, torch.full((blk,), (r + 1) * n * (n + 1) / 2)
        if self.op in ("all_reduce", "reduce_scatter") and os.environ.get("MCCL_COMPRESSION", "off") != "off":
            # Compressed (--compression): within the codec's error, not bit-exact (docs/compression.md).
            err = float((got - want).norm() / want.norm())
            if not err <= 0.02:
                raise MCCLError(f"[bench] {self.op} of {self.count} float32 under MCCL_COMPRESSION="
                                f"{os.environ['MCCL_COMPRESSION']} is {err:.2%} off the exact sum on rank {r} "
                                "(more than 2 %); do not trust its timings")
            bad = []
        else:
            bad = (got != want).nonzero()
        if len(bad):
            i = int(bad[0])
            raise MCCLError(f"[bench] {self.op} of {self.count} float32 returned a wrong result on rank "
                            f"{r}: element {i} is {float(got[i])}, expected {float(want[i])} "
                            f"({len(bad)} elements wrong); the backend corrupts data, do not trust its timings")
        # Timed loops run on zeros: sums stay finite however many iterations run.
        for t in (getattr(self, a) for a in ("buf", "inp", "out") if hasattr(self, a)):
            t.zero_()


def _ticketed_all_reduce(torch, dist, buf) -> Callable[[], None]:
    """MCCL_BENCH_TICKETS=1, in-process mccl only: the engine's gated (ticketed) all-reduce,
    its whole input ready at the start, as mccld's client makes it when it copies in faster
    than the links. Set apart from the daemon's copies, it tells whether the gated ring alone
    loses against the plain one (an experiment of issue 9, not a mode users have)."""
    from libmccl import _core

    comm = getattr(dist.distributed_c10d._get_default_group(), "_comm", None)
    if not isinstance(comm, _core.Communicator):
        raise ConfigError("[bench] MCCL_BENCH_TICKETS=1 needs the in-process mccl engine (--mode in-process)")
    nbytes, count = buf.numel() * buf.element_size(), buf.numel()
    dtype = int(_core.DType.float32)

    def run() -> None:
        ready, done = _core.Ticket(), _core.Ticket()
        ready.signal(nbytes)
        comm.wait(comm.allreduce(buf.data_ptr(), count, dtype, int(_core.ReduceOp.SUM), ready=ready, done=done),
                  600.0)
    return run


def _agree_iters(torch, dist, seconds_per_op: float, target_s: float, max_iters: int) -> int:
    """Every rank must run the same number of ops: take the slowest rank's estimate."""
    t = torch.tensor([seconds_per_op], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(1, min(max_iters, math.ceil(target_s / max(float(t[0]), 1e-7))))


def _engine_build(backend: str) -> dict | None:
    """Which engine binary ran: the commit alone does not say when a checkout is rebuilt often."""
    if backend != "mccl":
        return None
    import libmccl._core as core

    st = os.stat(core.__file__)
    built = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")
    return {"file": core.__file__, "built": built, "bytes": st.st_size}


def run(plan: dict) -> dict:
    import torch
    import torch.distributed as dist

    if plan["backend"] == "mccl":
        import libmccl

        libmccl.register()
    torch.set_num_threads(1)  # ranks share the host's cores; give both backends the same budget
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t_init = time.perf_counter()
    dist.init_process_group(plan["backend"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=plan["timeout_s"]))
    out = {"rank": rank, "pid": os.getpid(), "world": world, "backend": plan["backend"], "mode": plan.get("mode"),
           "torch": torch.__version__, "init_s": time.perf_counter() - t_init,
           "engine": _engine_build(plan["backend"]), "results": [],
           # Loaded only when the group went through mccld: proof that a daemon row is one.
           "via_daemon": "libmccl.daemon.client" in sys.modules}
    if plan.get("latency_iters"):
        out["latency"] = _latency(torch, dist, plan["latency_bytes"], plan["latency_iters"], rank, world)
    if plan.get("workload") in ("ddp", "lightning"):
        if plan["workload"] == "ddp":
            from . import ddp as steps
        else:
            from . import lightning_step as steps

        out["ddp"] = steps.run(torch, dist, plan.get("ddp") or {}, rank)
        if rank == 0:
            print(f"[bench] {plan['series']} DDP step: median {statistics.median(out['ddp']['step_s']) * 1e3:.1f} ms "
                  f"(rank 0)", file=sys.stderr, flush=True)
    for op in plan["ops"]:
        for size in plan["sizes"]:
            count = op_elements(op, size, world)
            if count == 0:
                continue
            out["results"].append(_measure(torch, dist, plan, op, count, rank, world))
    return out


def _latency(torch, dist, nbytes: int, iters: int, rank: int, world: int) -> dict:
    """Small-op latency: ``iters`` all_reduces of ``nbytes``, each timed on its own (a loop's
    mean would hide the tail); the harness takes, per op, the slowest rank's time."""
    o = _Op(torch, dist, "all_reduce", op_elements("all_reduce", nbytes, world), rank, world)
    o.check()
    for _ in range(20):
        o.run()
    dist.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        o.run()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"[bench] all_reduce {nbytes} B latency: median {statistics.median(times) * 1e6:.1f} us "
              f"over {iters} ops", file=sys.stderr, flush=True)
    return {"bytes": nbytes, "times_s": times}


def _measure(torch, dist, plan: dict, op: str, count: int, rank: int, world: int) -> dict:
    o = _Op(torch, dist, op, count, rank, world, shared=plan.get("mode") == "daemon-shared")
    o.check()
    for _ in range(plan["warmup"]):
        o.run()
    iters = plan["iters"]
    if iters <= 0:
        dist.barrier()
        t0 = time.perf_counter()
        o.run()
        iters = _agree_iters(torch, dist, time.perf_counter() - t0, plan["target_s"], plan["max_iters"])
    times, cpu = [], 0.0
    # Through mccld, one rank per host also counts its daemon's CPU (the others' is in its).
    daemon_pid = (plan.get("daemon_pids") or {}).get(str(rank))
    phases0 = _client_phases(dist)
    for _ in range(plan["repeats"]):
        dist.barrier()
        c0, t0 = _cpu_seconds(daemon_pid), time.perf_counter()
        for _ in range(iters):
            o.run()
        t1, c1 = time.perf_counter(), _cpu_seconds(daemon_pid)
        times.append((t1 - t0) / iters)
        cpu += c1 - c0
    phases = _phase_means_ms(phases0, _client_phases(dist))
    if rank == 0:
        print(f"[bench] {plan['series']} {op} {count * 4} B: {statistics.median(times) * 1e6:.1f} us/op "
              f"x{iters}" + (f"; through mccld, ms per op: {phases}" if phases else ""), file=sys.stderr, flush=True)
    out = {"op": op, "bytes": count * 4, "count": count, "iters": iters, "times_s": times, "cpu_s": cpu}
    if phases:
        out["daemon_phases_ms"] = phases
    return out


def _client_phases(dist) -> dict | None:
    """The mccld client's pipelined-op phase sums (libmccl/daemon/client.py's stats()), or None
    in-process: where the time of an op through mccld goes, per rank."""
    comm = getattr(dist.distributed_c10d._get_default_group(), "_comm", None)
    stats = comm.stats() if comm is not None and hasattr(comm, "stats") else {}
    return {k: v for k, v in stats.items() if k.startswith("pipelined_")} or None


def _phase_means_ms(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after or after["pipelined_ops"] == before["pipelined_ops"]:
        return None
    n = after["pipelined_ops"] - before["pipelined_ops"]
    return {k.removeprefix("pipelined_").removesuffix("_s"): round((after[k] - before[k]) / n * 1e3, 2)
            for k in after if k.endswith("_s")}


def _teardown(dist) -> None:
    dist.barrier()
    dist.destroy_process_group()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ranks and daemons must not outlive the harness (killed, timed out): ask Linux to send
    us ``sig`` then."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    die_with_parent()
    plan = json.loads(sys.argv[1])
    import torch.distributed as dist

    result = run(plan)
    path = os.path.join(plan["out_dir"], f"{plan['series']}-rank{result['rank']}.json")
    # Every op has completed and been checked: the numbers stand whatever shutdown does,
    # but a failing shutdown is still reported (exit code TEARDOWN_FAILED, error in the JSON).
    _write(path, result)
    try:
        _teardown(dist)
    except Exception as e:  # noqa: BLE001 - any failure here is reported, not hidden
        result["teardown_error"] = f"{type(e).__name__}: {e}"
        _write(path, result)
        print(f"[bench] rank {result['rank']}: shutdown failed after all measurements: {e}",
              file=sys.stderr, flush=True)
        return TEARDOWN_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
