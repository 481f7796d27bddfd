"""What attaching through mccld costs: kept as a short name for ``mccl-bench``'s daemon mode.

    sudo .venv/bin/python -m tools.bench_attach                  # 2 emulated hosts x 1 rank
    sudo .venv/bin/python -m tools.bench_attach --ranks-per-host 2
    .venv/bin/python -m tools.bench_attach --local --ranks-per-host 2   # one host, no root

runs ``python -m tools.bench --backends mccl --mode in-process,daemon --ops all_reduce --sizes BYTES
--ceiling-tool none`` on the same hosts: the 8-byte all_reduce latency and the all_reduce
bus bandwidth at --bytes, in-process and through one mccld per host (which mccl-bench
starts and stops). Everything else mccl-bench does (Gloo, the ring ceiling, sweeps, JSON)
is there: ``python -m tools.bench --help``.
"""

from __future__ import annotations

import argparse
import sys

from tools.bench.__main__ import main as bench_main


def bench_argv(args: argparse.Namespace) -> list[str]:
    where = (["--ranks", str(args.ranks_per_host)] if args.local
             else ["--hosts", str(args.hosts), "--rate", args.rate])
    return [*where, "--ranks-per-host", str(args.ranks_per_host), "--backends", "mccl", "--mode", args.modes,
            "--ops", "all_reduce", "--sizes", str(args.bytes), "--latency-iters", str(args.iters),
            "--ceiling-tool", "none"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_attach", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces; needs root)")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--local", action="store_true", help="one host on loopback, no namespaces")
    ap.add_argument("--rate", default="none", help="tc rate of each emulated link, e.g. 10gbit; none: unshaped")
    ap.add_argument("--iters", type=int, default=300, help="8-byte all_reduces timed for the latency")
    ap.add_argument("--modes", default="in-process,daemon", help="comma-separated: in-process, daemon")
    ap.add_argument("--bytes", type=int, default=64 << 20)
    args, rest = ap.parse_known_args(argv)
    return bench_main(bench_argv(args) + rest)


if __name__ == "__main__":
    sys.exit(main())
