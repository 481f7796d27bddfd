"""``mccl-bench --workload ddp``: the training step a backend gives DDP, not one collective.

Every rank trains the same MLP (fixed seed; ``width`` x ``width`` layers, about 50 MB of
float32 gradients at the defaults) under ``DistributedDataParallel`` with its default
25 MB buckets, so gradient all-reduces overlap backward as in real training. Each rank
first times the same steps without DDP (its compute alone), then ``warmup`` + ``steps``
DDP steps, each step timed on its own (forward, backward with the bucket all-reduces,
optimizer step). A step takes as long as its slowest rank; the median over steps is
reported, beside the compute alone and the wire floor (the gradient bytes each rank's
link must carry, at the ring ceiling). After the steps every rank's parameters must be
bit-identical (checked through the backend itself): a backend that corrupts gradients
reports no step time.

The rank side (``run``) imports torch; the harness side (``summarize``) does not.
"""

from __future__ import annotations

import statistics
import time

from ..errors import MCCLError

DEFAULTS = {"width": 2048, "depth": 3, "batch": 32, "warmup": 3, "steps": 10}


def _model(torch, width: int, depth: int):
    torch.manual_seed(0)  # the same initial weights on every rank and in every series
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _step(torch, model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _timed(torch, model, opt, data, n: int) -> list[float]:
    out = []
    for i in range(n):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        _step(torch, model, opt, x, y)
        out.append(time.perf_counter() - t0)
    return out


def run(torch, dist, cfg: dict, rank: int) -> dict:
    """This rank's compute-alone and DDP step times (seconds); raises if the replicas diverged."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = {**DEFAULTS, **cfg}
    width, batch = cfg["width"], cfg["batch"]
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
    data = [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)) for _ in range(4)]

    alone = _model(torch, width, cfg["depth"])
    opt = torch.optim.SGD(alone.parameters(), lr=1e-3)
    compute = _timed(torch, alone, opt, data, cfg["warmup"] + 3)[cfg["warmup"]:]
    del alone, opt

    model = _model(torch, width, cfg["depth"])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    _timed(torch, ddp, opt, data, cfg["warmup"])
    dist.barrier()
    steps = _timed(torch, ddp, opt, data, cfg["steps"])

    # Identical replicas have identical sums: min and max over ranks must agree to the bit.
    total = torch.tensor([sum(float(p.double().sum()) for p in model.parameters())], dtype=torch.float64)
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if float(lo[0]) != float(hi[0]):
        raise MCCLError(f"[bench] DDP replicas diverged after {cfg['warmup'] + cfg['steps']} steps (parameter "
                        f"sums {float(lo[0])!r} .. {float(hi[0])!r}); the backend corrupts gradients, do not "
                        "trust its step times")
    return {"config": cfg, "grad_bytes": grad_bytes, "compute_s": compute, "step_s": steps}


def summarize(docs: list[dict], ceiling: dict | None) -> dict | None:
    """One series' DDP figures from its ranks' documents: medians over steps of the slowest rank."""
    if not docs[0].get("ddp"):
        return None
    n = len(docs)
    steps = [max(ts) for ts in zip(*(d["ddp"]["step_s"] for d in docs))]
    compute = [max(ts) for ts in zip(*(d["ddp"]["compute_s"] for d in docs))]
    grad = docs[0]["ddp"]["grad_bytes"]
    wire_s = grad * 2 * (n - 1) / n * 8 / ceiling["mean_bps"] if ceiling else None
    return {"grad_bytes": grad, "steps": len(steps), "step_ms": statistics.median(steps) * 1e3,
            "step_ms_all": [s * 1e3 for s in steps], "compute_ms": statistics.median(compute) * 1e3,
            "wire_floor_ms": wire_s * 1e3 if wire_s is not None else None, "config": docs[0]["ddp"]["config"]}
