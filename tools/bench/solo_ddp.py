"""A world-size-1 DDP step, Gloo against MCCL in the same run: what a single-process job
pays for its backend when there is no network at all.

    python -m tools.bench.solo_ddp [--steps 30] [--repeats 3]

Each repeat builds a fresh group per backend (alternating, so both see the same machine
load), trains a 24-layer MLP (6.3M parameters, DDP buckets of 4 MB) and takes the median
step; the report is the median over repeats of wall and process-CPU milliseconds per step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time


def step_ms(backend: str, steps: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(24)])
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x = torch.randn(32, 512)
        wall, cpu = [], []
        for i in range(steps + 3):  # 3 warm-up steps
            t, c = time.perf_counter(), time.process_time()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            if i >= 3:
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
    finally:
        dist.destroy_process_group()
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    import libmccl

    libmccl.register()
    torch.set_num_threads(1)
    runs: dict[str, list[tuple[float, float]]] = {"gloo": [], "mccl": []}
    for _ in range(args.repeats):
        for backend in runs:
            runs[backend].append(step_ms(backend, args.steps))
    for k, what in ((0, "wall"), (1, "cpu")):
        g = statistics.median(r[k] for r in runs["gloo"])
        m = statistics.median(r[k] for r in runs["mccl"])
        print(f"world-size-1 DDP step, {what} ms: gloo {g:.2f}, mccl {m:.2f}, mccl - gloo {m - g:+.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
