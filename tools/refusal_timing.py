"""How long the hosts of a misconfigured job take to fail (issue 36, "fail together").

Two (or three) hosts emulated on loopback, each a process with its own MCCL_HOST_ID and (with
``--daemon``) its own mccld and MCCL_RUNTIME_DIR; every host calls init_process_group("mccl")
through env:// and one all_reduce. ``--case key``: host 1 holds another key; ``--case size``:
host 0 says WORLD_SIZE=2 and host 1 says 3 (``size-rev``: 3 and 2). Prints, for every host, its exit code, its
first error line, and the time its process exited after the first refusal a host posted (its log line
``posted its refusal``), or after the start when nobody posted one.

    .venv/bin/python -m tools.refusal_timing --case key [--daemon] [--timeout 60]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import datetime, logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(created).3f %(levelname)s %(name)s %(message)s")
import torch, torch.distributed as dist
try:
    dist.init_process_group("mccl", timeout=datetime.timedelta(seconds=float(os.environ["T_TIMEOUT"])))
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()
    print(f"EXIT {time.time():.3f} ok", flush=True)
except BaseException as exc:
    print(f"EXIT {time.time():.3f} {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
    sys.exit(1)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _key(root: str, name: str) -> str:
    from mccl_common.daemon_settings import write_key_file
    return str(write_key_file(os.path.join(root, name)))


def _start_mccld(root: str, host: str, key_file: str) -> tuple[subprocess.Popen, str]:
    rdir = os.path.join(root, f"rt-{host}")
    env = {**os.environ, "MCCL_RUNTIME_DIR": rdir, "MCCL_KEY_FILE": key_file, "MCCL_FLEET": f"rt{os.getpid()}",
           "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0",
           "MCCL_HOST_ID": host}
    env.pop("MCCL_JOB_KEY_FILE", None)
    log = open(os.path.join(root, f"mccld-{host}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "mccld"], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(rdir, "token")):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log.name) as f:
                raise SystemExit(f"mccld of {host} did not start:\n{f.read()[-2000:]}")
        time.sleep(0.1)
    return proc, rdir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["key", "size", "size-rev", "fleet-key"], required=True)
    ap.add_argument("--daemon", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0, help="init_process_group's timeout (s)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mccl-refusal-")
    daemons: list[subprocess.Popen] = []
    procs: list[subprocess.Popen] = []
    try:
        good, other = _key(root, "good.key"), _key(root, "other.key")
        keys = [good, other if args.case == "key" else good]
        # fleet-key: the ranks share the job key (MCCL_JOB_KEY_FILE), the two mccld hold different fleet keys.
        fleet = [good, other] if args.case == "fleet-key" else keys
        sizes = {"size": [2, 3], "size-rev": [3, 2]}.get(args.case, [2, 2])
        port = _port()
        started = time.time()
        for rank in range(2):
            host = f"h{rank}-{os.getpid()}"
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(sizes[rank]), "LOCAL_RANK": "0", "MCCL_HOST_ID": host,
                   "T_TIMEOUT": str(args.timeout), "MCCL_BIND_ADDR": "127.0.0.1"}
            env.pop("MCCL_JOB_KEY_FILE", None)
            env["MCCL_KEY_FILE"] = keys[rank]
            if args.case == "fleet-key":
                env["MCCL_JOB_KEY_FILE"] = good
            if args.daemon:
                d, rdir = _start_mccld(root, host, fleet[rank])
                daemons.append(d)
                env.update({"MCCL_DAEMON": "1", "MCCL_RUNTIME_DIR": rdir})
            procs.append(subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        exits: dict[int, float] = {}
        deadline = time.monotonic() + args.timeout + 60
        while len(exits) < len(procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in exits and p.poll() is not None:
                    exits[i] = time.time()
            time.sleep(0.05)
        outs = []
        for p in procs:
            if p.poll() is None:
                p.kill()
            outs.append(p.communicate()[0])
        posted = [float(m.group(1)) for o in outs for m in re.finditer(r"^(\d+\.\d+) .*posted its refusal", o, re.M)]
        t0 = min(posted) if posted else started
        print(f"case={args.case} daemon={args.daemon} timeout={args.timeout:.0f}s; times after "
              f"{'the first refusal' if posted else 'the start (no refusal was posted)'}")
        for rank, (p, o) in enumerate(zip(procs, outs)):
            m = re.search(r"^EXIT (\d+\.\d+) (.*)$", o, re.M)
            when = f"{exits[rank] - t0:6.1f}s" if rank in exits else "   n/a"
            print(f"host {rank}: rc={p.returncode} exit at {when}: {(m.group(2) if m else o[-400:])[:600]}")
    finally:
        for p in procs + daemons:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
