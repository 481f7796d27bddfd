"""What attaching through mccld costs: the same job, in-process engine vs MCCL_DAEMON=1.

    sudo .venv/bin/python -m mccld.bench_attach                  # 2 emulated hosts x 1 rank
    sudo .venv/bin/python -m mccld.bench_attach --ranks-per-host 2
    .venv/bin/python -m mccld.bench_attach --local --ranks-per-host 2   # one host, no root

Runs ``torch.distributed`` (backend "mccl") both ways in one run, on the same hosts:
8-byte all-reduce latency (median of --iters) and all-reduce bus bandwidth at --bytes
(nccl-tests' busbw = algbw * 2(n-1)/n). With one rank per host the two modes run the
same engine over the same links, so the difference is the attach path alone (ZeroMQ
round trip, shared-memory copies, the daemon's job thread).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from libmccl.errors import DaemonUnavailableError, MCCLError

KEY = "bench-attach-key-" + "b" * 20


def worker(iters: int, nbytes: int) -> None:
    import torch
    import torch.distributed as dist
    import libmccl
    libmccl.register()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    small = torch.ones(2, dtype=torch.float32)          # 8 bytes
    for _ in range(20):
        dist.all_reduce(small)
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(small)
        lat.append(time.perf_counter() - t0)
    big = torch.ones(nbytes // 4, dtype=torch.float32)
    dist.all_reduce(big)
    reps = 5
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(big)
    per_op = (time.perf_counter() - t0) / reps
    dist.barrier()  # nobody tears down while a peer may still be draining the last all-reduce
    dist.destroy_process_group()
    if rank == 0:
        busbw = nbytes / per_op * 2 * (world - 1) / world
        print(json.dumps({"lat_us": statistics.median(lat) * 1e6, "p90_us": sorted(lat)[int(0.9 * len(lat))] * 1e6,
                          "busbw_gbps": busbw * 8 / 1e9, "big_ms": per_op * 1e3}), flush=True)


class _Local:
    """Stand-in for a Fleet on this host only (loopback)."""
    hosts = [type("H", (), {"addr": "127.0.0.1", "ifname": "lo"})()]

    def popen(self, _i, argv, env=None, **kw):
        return subprocess.Popen(argv, env={**os.environ, **(env or {})}, **kw)

    def start(self):
        return self

    def stop(self):
        pass


def run(args: argparse.Namespace) -> list[dict]:
    if args.local:
        fleet, n_hosts = _Local(), 1
    else:
        from libmccl.fleet import Fleet
        fleet, n_hosts = Fleet(args.hosts, rate=None if args.rate == "none" else args.rate), args.hosts
    tmp = Path(tempfile.mkdtemp(prefix="mccl-bench-attach-"))
    daemons: list[subprocess.Popen] = []
    fleet.start()
    try:
        def env(h: int) -> dict[str, str]:
            e = {"MCCL_RUNTIME_DIR": str(tmp / f"h{h}"), "MCCL_HOST_ID": f"bench{h}", "MCCL_FLEET_KEY": KEY,
                 "MCCL_FLEET": "bench", "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0"}
            if args.local:
                e.update(MCCL_LISTEN_ADDR="127.0.0.1", MCCL_PORT="0")
            else:
                e["MCCL_IFACE"] = fleet.hosts[h].ifname
            return e
        for h in range(n_hosts):
            daemons.append(fleet.popen(h, [sys.executable, "-m", "mccld", "--log-level", "WARNING"], env=env(h)))
        deadline = time.monotonic() + 30
        while not all((tmp / f"h{h}" / "token").exists() for h in range(n_hosts)):
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                raise DaemonUnavailableError(
                    f"[bench-attach] mccld did not start within 30 s on {n_hosts} fleet host(s) (exit codes "
                    f"{[d.poll() for d in daemons]}); run `python -m mccld` in one by hand to see why")
            time.sleep(0.1)
        world = n_hosts * args.ranks_per_host
        rows = []
        for mode in args.modes.split(","):
            procs = []
            for r in range(world):
                h = r // args.ranks_per_host
                e = {**env(h), "MASTER_ADDR": fleet.hosts[0].addr, "MASTER_PORT": "29710", "RANK": str(r),
                     "WORLD_SIZE": str(world), "MCCL_DAEMON": "1" if mode == "daemon" else "0"}
                procs.append(fleet.popen(h, [sys.executable, "-m", "mccld.bench_attach", "--worker",
                                             "--iters", str(args.iters), "--bytes", str(args.bytes)],
                                         env=e, stdout=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=300)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise MCCLError(f"[bench-attach] {mode} workers failed: exit codes "
                                f"{[p.returncode for p in procs]}; their stderr above says why")
            rows.append({"mode": mode, **json.loads(outs[0].strip().splitlines()[-1])})
        return rows
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()
        fleet.stop()
        for p in sorted(tmp.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        tmp.rmdir()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mccld.bench_attach", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces; needs root)")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--local", action="store_true", help="one host on loopback, no namespaces")
    ap.add_argument("--rate", default="none", help="tc rate of each emulated link, e.g. 10gbit; none: unshaped")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--modes", default="in-process,daemon", help="comma-separated: in-process, daemon")
    ap.add_argument("--bytes", type=int, default=64 << 20)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.iters, args.bytes)
        return 0
    rows = run(args)
    where = "1 host (loopback)" if args.local else f"{args.hosts} hosts (netns, rate {args.rate})"
    print(f"all-reduce, {where} x {args.ranks_per_host} rank(s)/host")
    print(f"{'mode':<11} {'8 B median':>11} {'8 B p90':>9} {args.bytes >> 20:>5} MB busbw {'time':>9}")
    for r in rows:
        print(f"{r['mode']:<11} {r['lat_us']:>8.0f} us {r['p90_us']:>6.0f} us {r['busbw_gbps']:>8.2f} Gbit/s "
              f"{r['big_ms']:>6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
