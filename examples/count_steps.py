"""An ordinary DDP-style script that knows nothing of libmccl.elastic: one all-reduce per step,
STEPS steps (environment, default 150), STEP_TIME seconds apart (default 0.2).

What it does to survive a host being handed back to its user is what any plain script can do:
rank 0 saves its step to CKPT (a file on storage every host reaches) every CKPT_EVERY steps, and
a (re)started run resumes from it. When mccld removes this job from a host whose user came
back (MCCL_RECLAIM_GRACE), the other hosts' ranks see PeerLostError, torchrun restarts them in
the smaller world, and they resume from the last save: the steps since are done again.

    mcclctl run --min 2 --max 3 --env STEPS=150 --env CKPT=/shared/run1.step -- python count_steps.py
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def load(ckpt: Path | None) -> int:
    if ckpt is None:
        return 0
    try:
        return int(json.loads(ckpt.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def save(ckpt: Path, step: int) -> None:
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, ckpt)       # a rank killed mid-write leaves the previous save whole


def main() -> None:
    steps = int(os.environ.get("STEPS", "150"))
    step_time = float(os.environ.get("STEP_TIME", "0.2"))
    every = int(os.environ.get("CKPT_EVERY", "10"))
    ckpt = Path(os.environ["CKPT"]) if os.environ.get("CKPT") else None
    dist.init_process_group("mccl", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    start = load(ckpt)
    if rank == 0:
        print(f"starting at step {start} world {world} on {os.environ.get('MCCL_HOST_ID', '?')}", flush=True)
    for step in range(start, steps):
        t = torch.ones(1024)
        dist.all_reduce(t)
        if t[0].item() != world:
            raise SystemExit(f"all-reduce gave {t[0].item()}, expected {world}")
        if rank == 0:
            print(f"count step {step} world {world}", flush=True)
            if ckpt is not None and (step + 1) % every == 0:
                save(ckpt, step + 1)
        time.sleep(step_time)
    dist.barrier()
    if rank == 0:
        print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
