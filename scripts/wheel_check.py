"""What an installed wheel must do, run with the interpreter it was installed into and outside
the checkout (tests/project/test_wheel.py in `make test`; cibuildwheel's test-command):

    python scripts/wheel_check.py

1. the packages come from that interpreter's site-packages, not from a checkout;
2. `mccld --help` and `mcclctl --help` (the console scripts) run, and `mccld keygen` writes
   the job key the ranks share;
3. two processes on loopback all-reduce through the backend "mccl", found through torch's
   entry points (nothing imports libmccl), and the values are checked.
Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 1 << 16
WORLD = 2
TIMEOUT_S = 60


def _rank(rank: int, port: int, out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("mccl", rank=rank, world_size=WORLD)
    try:
        x = torch.arange(N, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(x)
        want = torch.arange(N, dtype=torch.float32) * sum(r + 1 for r in range(WORLD))
        y = torch.full((1000,), rank + 1, dtype=torch.int32)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        out.put((rank, torch.equal(x, want) and bool((y == WORLD).all()), dist.get_backend()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(name: str) -> str:
    return str(Path(sysconfig.get_path("scripts")) / name)


def _fail(what: str) -> None:
    print(f"FAIL {what}")
    sys.exit(1)


def main() -> int:
    import libmccl

    site = {Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib")}
    where = Path(libmccl.__file__).resolve()
    if not any(s in where.parents for s in site):
        _fail(f"libmccl was imported from {where}, not from this interpreter's site-packages {sorted(site)}")
    print(f"PASS the packages are the installed ones ({where.parent})")
    for cmd in ("mccld", "mcclctl"):
        res = subprocess.run([_script(cmd), "--help"], capture_output=True, text=True, timeout=TIMEOUT_S)
        if res.returncode != 0 or "usage" not in res.stdout.lower():
            _fail(f"{cmd} --help: exit {res.returncode}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
        print(f"PASS {cmd} --help")
    with tempfile.TemporaryDirectory(prefix="mccl-wheel-check-") as tmp:
        key = os.path.join(tmp, "job.key")
        res = subprocess.run([_script("mccld"), "keygen", key], capture_output=True, text=True, timeout=TIMEOUT_S)
        if res.returncode != 0 or not os.path.exists(key):
            _fail(f"mccld keygen: exit {res.returncode}\n{res.stderr[-2000:]}")
        print("PASS mccld keygen")
        os.environ["MCCL_JOB_KEY_FILE"] = key
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        try:
            results = {r: (ok, backend) for r, ok, backend in (out.get(timeout=TIMEOUT_S) for _ in procs)}
        except Exception as exc:  # queue.Empty: a rank died or hung; the exit codes say which
            codes = [p.exitcode for p in procs]
            for p in procs:
                p.kill()
            _fail(f"the two-rank all-reduce gave no result within {TIMEOUT_S} s ({exc!r}; exit codes {codes})")
        finally:
            for p in procs:
                p.join(TIMEOUT_S)
            out.close()
        if not all(ok and backend == "mccl" for ok, backend in results.values()):
            _fail(f"the two-rank all-reduce through the mccl backend gave wrong values: {results}")
        print(f"PASS a two-rank all-reduce through the backend 'mccl' (float32 SUM of {N}, int32 MAX)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
