"""The script torchrun runs in tests/e2e/test_torchrun_rdzv.py: no MASTER_ADDR of its own,
only what `--rdzv-backend mccl` hands it. One all-reduce; with ``--loop``, the first
incarnation (before torchrun restarts it) goes on with one every ``--interval`` seconds until a
peer is lost, so that a test can kill a host mid-job and see the survivors re-form."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", action="store_true")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("mccl", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print("RESULT " + json.dumps({"rank": rank, "world": world, "sum": t[0].item(), "pid": os.getpid(),
                                  "master": os.environ.get("MASTER_ADDR"), "restart": restart,
                                  "t": time.time()}), flush=True)
    while args.loop and restart == 0:
        time.sleep(args.interval)
        dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
