"""A training script that survives hosts leaving: run it with ``mcclctl run --min 1 --max 4 --
python examples/elastic_train.py --ckpt /shared/ckpt/run1``.

The global batch stays the same whatever the number of hosts (each rank takes its slice), and
step s always trains on the same data (drawn from a generator seeded with s: the data position
is the step), so a run whose hosts come and go follows the loss curve of one that never
changes, step for step. ``libmccl.elastic.ElasticState`` does the rest: see its docstring.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from libmccl.elastic import ElasticState

FEATURES, CLASSES = 32, 4
GLOBAL_BATCH = 240      # splits evenly over 1-6, 8, 10, 12, 15, 16, 20 or 24 hosts


def batch(step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, FEATURES, generator=g)
    y = (x[:, :CLASSES].argmax(dim=1) + (x[:, -1] > 1.5).long()) % CLASSES
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                    help="samples per step over all ranks; must split evenly over every world size the job takes")
    ap.add_argument("--ckpt", required=True, help="checkpoint folder every host reaches (shared)")
    ap.add_argument("--every", type=int, default=20, help="checkpoint period, for hosts that die")
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower model)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds a collective may wait for a stalled host before the job re-forms without it")
    ap.add_argument("--restart-workers", action="store_true",
                    help="re-form by restarting every worker, also when a host leaves (slower)")
    args = ap.parse_args()
    # torch's default is 30 minutes: a hung Mac would hold the others that long.
    dist.init_process_group("mccl", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"global batch {args.global_batch} does not split over {world} ranks")
    net = DDP(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    # keep_workers: when a host leaves, the ranks that stay re-form without restarting (this
    # loop reads the rank and world again whenever step_done says the world changed).
    state = ElasticState(args.ckpt, model=net, optimizer=opt, scheduler=sched, every=args.every,
                         keep_workers=not args.restart_workers)
    start = state.resume()
    if rank == 0:
        how = f"resumed after step {state.resumed_from}" if state.resumed_from is not None else "fresh start"
        print(f"world {world} on {os.environ.get('MCCL_HOST_ID', '?')}: {how}, from step {start}", flush=True)
    for step in range(start, args.steps):
        x, y = batch(step, args.global_batch, rank, world)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        sched.step()
        # The global batch's mean loss, whatever the world: what an unchanged run would print.
        report = loss.detach().clone()
        dist.all_reduce(report)
        if rank == 0:
            print(f"step {step} loss {report.item() / world:.6f} world {world}", flush=True)
        time.sleep(args.step_time)
        if state.step_done(step):
            rank, world = dist.get_rank(), dist.get_world_size()
            if args.global_batch % world:
                raise SystemExit(f"global batch {args.global_batch} does not split over {world} ranks")
            if rank == 0:
                print(f"world {world} on {os.environ.get('MCCL_HOST_ID', '?')}: resumed after step {step}, "
                      f"from step {step + 1} (in place)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
