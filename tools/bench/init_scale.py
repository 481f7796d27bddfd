"""How long ``init_process_group("mccl")`` takes at scale: N torch ranks as processes on
loopback (MASTER_ADDR=127.0.0.1), each timing its init and a first all-reduce.

    python -m tools.bench.init_scale --ranks 64 [--ranks 16 ...] [--json out.json]

Prints, per world size, the max and median over ranks of init_process_group, of the first
all-reduce (a small one: it opens no link beyond set-up's for the ring/tree algorithms) and
of both, and the link sockets and open files per rank after them. Each rank is a fresh
interpreter (importing torch dominates start-up, so the clock starts once every rank has
imported it),
with the engine's own links (no mccld) and a throwaway job key. Memory: ~150-250 MB per rank
(torch on CPU); 64 ranks need ~12 GB.

Runs with only torch and the built engine. The engine's settings come from the
environment as for any job (MCCL_SOCKETS_PER_PEER ...).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_WORKER = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
import libmccl
import libmccl.rendezvous as rdzv
libmccl.register()
phase = {"rendezvous_s": 0.0, "links_s": 0.0}
from libmccl import _core
class TimedCommunicator(_core.Communicator):  # building the engine: its links at set-up
    def __init__(self, *a, **kw):
        t = time.perf_counter()
        try:
            super().__init__(*a, **kw)
        finally:
            phase["links_s"] += time.perf_counter() - t
_core.Communicator = TimedCommunicator
_exchange = rdzv.exchange
def timed_exchange(*a, **kw):  # the store part of init, apart from building the links
    t = time.perf_counter()
    try:
        return _exchange(*a, **kw)
    finally:
        phase["rendezvous_s"] += time.perf_counter() - t
rdzv.exchange = timed_exchange
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
sync = os.environ["INIT_SCALE_DIR"]
open(os.path.join(sync, f"ready.{rank}"), "w").close()
go_file = os.path.join(sync, "go")
while not os.path.exists(go_file):  # every rank has imported torch: start together
    time.sleep(0.01)
go = float(open(go_file).read() or 0)
while time.time() < go:
    time.sleep(0.001)
t0 = time.perf_counter()
dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
t1 = time.perf_counter()
x = torch.ones(1024)
dist.all_reduce(x)
t2 = time.perf_counter()
assert float(x[0]) == world, float(x[0])
def sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n
links = None
try:  # the engine's own count (builds with links on demand)
    links = dist.group.WORLD.communicator.link_count()
except Exception as e:  # an engine without it (a baseline build)
    print(f"no link count: {e!r}", file=sys.stderr)
fds = len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
print(json.dumps({"rank": rank, "init_s": t1 - t0, "first_allreduce_s": t2 - t1, "links": links, **phase,
                  "sockets": sockets(), "fds": fds}), flush=True)
dist.barrier() if os.environ.get("INIT_SCALE_BARRIER") else None
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(n: int, key_file: str, sync: str, timeout_s: float) -> list[dict]:
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
               MCCL_JOB_KEY_FILE=key_file, INIT_SCALE_DIR=sync, OMP_NUM_THREADS="1")
    env.pop("MCCL_DAEMON", None)  # the engine's own links
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    deadline = time.monotonic() + timeout_s
    while sum(f.startswith("ready.") for f in os.listdir(sync)) < n:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    with open(os.path.join(sync, "go.tmp"), "w") as f:
        f.write(str(time.time() + 0.5))
    os.rename(os.path.join(sync, "go.tmp"), os.path.join(sync, "go"))
    rows, errors = [], []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            errors.append(f"rank {r}: timed out")
            continue
        line = next((ln for ln in out.splitlines() if ln.startswith("{")), None)
        if p.returncode != 0 or line is None:
            errors.append(f"rank {r}: exit {p.returncode}: {err.strip().splitlines()[-1:] or ''}")
            continue
        rows.append(json.loads(line))
    if errors:
        raise SystemExit(f"[init_scale] {n} ranks: {len(errors)} rank(s) failed: " + "; ".join(errors[:5]))
    return rows


def summary(n: int, rows: list[dict]) -> dict:
    def stat(k):
        v = [r[k] for r in rows]
        return {"max": max(v), "median": statistics.median(v)}

    for r in rows:
        r["total_s"] = r["init_s"] + r["first_allreduce_s"]
    out = {"ranks": n, "init_s": stat("init_s"), "rendezvous_s": stat("rendezvous_s"), "links_s": stat("links_s"),
           "first_allreduce_s": stat("first_allreduce_s"),
           "total_s": stat("total_s"), "sockets": stat("sockets"), "fds": stat("fds")}
    if all(r["links"] is not None for r in rows):
        out["link_sockets"] = stat("links")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, action="append", required=True, help="world size (repeatable)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", help="write the summaries here too")
    args = ap.parse_args(argv)
    from mccl_common.daemon_settings import write_key_file

    results = []
    with tempfile.TemporaryDirectory(prefix="mccl-init-scale-") as d:
        key_file = str(write_key_file(os.path.join(d, "job.key")))
        for n in args.ranks:
            sync = tempfile.mkdtemp(dir=d)
            s = summary(n, run_world(n, key_file, sync, args.timeout_s))
            results.append(s)
            links = f", link sockets max {s['link_sockets']['max']}" if "link_sockets" in s else ""
            print(f"[init_scale] {n:4d} ranks: init_process_group max {s['init_s']['max']:.3f} s "
                  f"median {s['init_s']['median']:.3f} s (rendezvous max {s['rendezvous_s']['max']:.3f} s, links max {s['links_s']['max']:.3f} s); first all-reduce max {s['first_allreduce_s']['max']:.3f} s; "
                  f"both max {s['total_s']['max']:.3f} s; sockets per rank max {s['sockets']['max']} "
                  f"median {s['sockets']['median']}{links}; open files max {s['fds']['max']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
