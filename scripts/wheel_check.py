"""What an installed wheel must do, run with the interpreter it was installed into and outside
the checkout (tests/project/test_wheel.py in `make test`; cibuildwheel's test-command):

    python scripts/wheel_check.py

1. the packages come from that interpreter's site-packages, not from a checkout;
2. `mccld --help` and `mcclctl --help` (the console scripts) run, and `mccld keygen` writes
   the job key the ranks share;
3. two processes on loopback all-reduce through the backend "mccl", found through torch's
   entry points (nothing imports libmccl), and the values are checked;
4. mccld, started from the wheel's console script (loopback, a private runtime dir), serves a
   two-rank job of MCCL_DAEMON=1 ranks: its dependencies are all declared (numpy, once
   needed by mccld and installed only by the dev setup, was not; issue 36).
Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 1 << 16
WORLD = 2
TIMEOUT_S = 60
RANKS_S = 150               # bounds a hang only: the ranks' results, mccld's start (see _two_ranks)


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


def _two_ranks(port: int, env: dict[str, str]) -> dict[int, tuple[bool, str]]:
    """Runs _rank in two spawned processes with ``env`` added; their (ok, backend) by rank."""
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got: dict[int, tuple[bool, str]] = {}
        # Until each rank reported or one exited without doing so (the events); RANKS_S only
        # bounds a hang. A fixed 60 s once ran out while two ranks of a fresh venv (no .pyc)
        # were still importing torch on a loaded 2-core machine.
        deadline = time.monotonic() + RANKS_S
        while len(got) < len(procs):
            try:
                r, ok, backend = out.get(timeout=1.0)
                got[r] = (ok, backend)
                continue
            except queue.Empty:
                pass
            gone = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if gone or time.monotonic() > deadline:
                codes = [p.exitcode for p in procs]
                for p in procs:
                    p.kill()
                why = f"rank(s) {gone} exited without a result" if gone else f"no result within {RANKS_S} s"
                _fail(f"the two-rank all-reduce failed: {why} (exit codes {codes})")
        return got
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
        out.close()
        for k in env:
            os.environ.pop(k, None)


def _through_mccld(tmp: str, key: str) -> None:
    """mccld from the console script, then a two-rank job attached to it (``key``: the job key)."""
    rdir = Path(tmp) / "mccld-run"
    env = {"MCCL_RUNTIME_DIR": str(rdir), "MCCL_FLEET_KEY": "wheel-check-" + "k" * 32,
           "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0",
           "MCCL_HOST_ID": f"wheelcheck{os.getpid()}"}
    log = Path(tmp) / "mccld.log"
    with open(log, "w") as fh:
        daemon = subprocess.Popen([_script("mccld")], env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT)
    try:
        token = rdir / "token"      # mccld writes it once it serves (mccl_common/attach_protocol.py)
        deadline = time.monotonic() + RANKS_S
        while not token.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                _fail(f"mccld from the wheel did not start (exit {daemon.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        print("PASS mccld starts from the wheel")
        results = _two_ranks(_free_port(), {"MCCL_DAEMON": "1", "MCCL_RUNTIME_DIR": str(rdir), "MCCL_JOB_KEY_FILE": key})
        if not all(ok and backend == "mccl" for ok, backend in results.values()):
            _fail(f"the two-rank all-reduce through mccld gave wrong values: {results}\n{log.read_text()[-3000:]}")
        if daemon.poll() is not None:
            _fail(f"mccld exited during the job (exit {daemon.returncode}):\n{log.read_text()[-3000:]}")
        print("PASS a two-rank all-reduce through mccld (MCCL_DAEMON=1)")
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)      # its clean stop
            try:
                daemon.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(TIMEOUT_S)


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
        results = _two_ranks(_free_port(), {"MCCL_JOB_KEY_FILE": key})
        if not all(ok and backend == "mccl" for ok, backend in results.values()):
            _fail(f"the two-rank all-reduce through the mccl backend gave wrong values: {results}")
        print(f"PASS a two-rank all-reduce through the backend 'mccl' (float32 SUM of {N}, int32 MAX)")
        _through_mccld(tmp, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
