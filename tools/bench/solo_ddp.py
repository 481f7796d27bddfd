"""A world-size-1 DDP step, Gloo against MCCL in the same run: what a single-process job
pays for its backend when there is no network at all.

    python -m tools.bench.solo_ddp [--steps 30] [--repeats 3] [--model mlp,lightning]

Each repeat builds a fresh group per backend (alternating, so both see the same machine
load) and takes the median step; the report is the median over repeats of wall and
process-CPU milliseconds per step. ``mlp``: a 24-layer MLP (6.3M parameters, DDP buckets of
4 MB) under plain DDP on a HashStore group. ``lightning``: Lightning's own
LightningTransformer (58.5 MB of gradients) under a Lightning Trainer with
``DDPStrategy(process_group_backend=...)`` on one device, Lightning creating the group as
a one-process job does (needs ``pip install lightning``; skipped with a note where it is absent).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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


def lightning_step_ms(backend: str, steps: int, batch: int = 16) -> tuple[float, float]:
    import torch
    import torch.distributed as dist
    import lightning.pytorch as L
    from lightning.pytorch.demos import LightningTransformer
    from lightning.pytorch.strategies import DDPStrategy

    from .lightning_step import DEFAULTS, _batches, _offline, _step_timer
    from .init_scale import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # a fresh store each group
    # Else Lightning's launcher sets torch's threads to the machine's cores: keep main()'s one.
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    data = _batches(torch, {**DEFAULTS, "batch": batch}, 0, steps + 3)
    torch.manual_seed(0)
    model = _offline(LightningTransformer)()
    timer = _step_timer(L, cpu=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + 3, callbacks=[timer],
                        strategy=DDPStrategy(process_group_backend=backend), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0)
    try:
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    wall, cpu = timer.steps[3:], timer.cpu[3:]
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="mlp,lightning", help="comma list of mlp, lightning")
    args = ap.parse_args()
    import torch

    import libmccl

    libmccl.register()
    torch.set_num_threads(1)
    for model in args.model.split(","):
        if model == "lightning" and importlib.util.find_spec("lightning") is None:
            print("lightning: not installed here (pip install lightning); not measured")
            continue
        measure = {"mlp": step_ms, "lightning": lightning_step_ms}[model]
        runs: dict[str, list[tuple[float, float]]] = {"gloo": [], "mccl": []}
        for _ in range(args.repeats):
            for backend in runs:
                runs[backend].append(measure(backend, args.steps))
        for k, what in ((0, "wall"), (1, "cpu")):
            g = statistics.median(r[k] for r in runs["gloo"])
            m = statistics.median(r[k] for r in runs["mccl"])
            print(f"{model}: world-size-1 DDP step, {what} ms: gloo {g:.2f}, mccl {m:.2f}, mccl - gloo {m - g:+.2f} "
                  f"({m / g:.3f}x), medians of {args.repeats}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
