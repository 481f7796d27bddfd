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

With mccl each series also reports the copies a DDP step makes, per direction (device ->
host staging, host -> mccld's segment, segment -> host, host -> device: libmccl/devices/copy_stats.py),
their megabytes and the time in them, from the backend's ``copy_stats()`` (none for Gloo).

The rank side (``run``) imports torch; the harness side (``summarize``) does not.
"""

from __future__ import annotations

import statistics
import time

from mccl_common.errors import MCCLError

DEFAULTS = {"width": 2048, "depth": 3, "batch": 32, "warmup": 3, "steps": 10, "device": "cpu",
            "variants": ["ddp"], "bucket_mb": None}
# What a series may time besides plain DDP (``variants``), each from the same initial weights:
#   nocomm  DDP with a comm hook that returns the bucket untouched: the step with its
#           communication removed, which a fully hidden all-reduce would match;
#   staged  a comm hook that copies the bucket to the CPU, all-reduces it there and copies it
#           back, blocking: what staging through copies costs (with Gloo: "Gloo with manual
#           copies", the baseline for accelerator tensors);
#   shared  gradient_as_bucket_view=True with libmccl.ddp_shared_buckets: through mccld the
#           buckets are reduced in shared memory, not copied (on Gloo the hook reduces in place);
#   sharedcopy  the same hook with DDP's default gradient_as_bucket_view=False: each bucket
#           scaled into shared memory by the hook (3 passes over it instead of 4).
VARIANTS = ("ddp", "nocomm", "staged", "shared", "sharedcopy")
# Parameters compared across series (the first ones of the flattened model, and the sum).
_FINGERPRINT = 4096


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


def _timed(torch, model, opt, data, n: int, sync) -> list[float]:
    out = []
    for i in range(n):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        _step(torch, model, opt, x, y)
        sync()  # on an accelerator the step is over when its queued work is
        out.append(time.perf_counter() - t0)
    return out


def _staged_hook(torch, dist):
    def hook(state, bucket):
        buf = bucket.buffer()
        cpu = buf.cpu()
        dist.all_reduce(cpu)
        buf.copy_(cpu.div_(dist.get_world_size()))
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut
    return hook


def _noop_hook(torch):
    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    return hook


def _comm_alone(torch, dist, nbytes: int, device, sync) -> float:
    """Median seconds of one all-reduce of the whole gradient, alone: what overlap hides."""
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(4):
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(torch, dist, cfg: dict, rank: int) -> dict:
    """This rank's compute-alone and DDP step times (seconds) per variant; raises if the replicas diverged."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = {**DEFAULTS, **cfg}
    unknown = set(cfg["variants"]) - set(VARIANTS)
    if unknown:
        raise ValueError(f"[bench] unknown DDP variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    width, batch = cfg["width"], cfg["batch"]
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # ranks sharing a GPU: all on the one device
        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    # Each rank its own shard of data, drawn where it is used (large batches would take seconds
    # of CPU to draw and copy), the same in every series.
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    data = [(torch.randn(batch, width, generator=gen, device=device),
             torch.randn(batch, width, generator=gen, device=device)) for _ in range(4)]

    alone = _model(torch, width, cfg["depth"]).to(device)
    opt = torch.optim.SGD(alone.parameters(), lr=1e-3)
    compute = _timed(torch, alone, opt, data, cfg["warmup"] + 3, sync)[cfg["warmup"]:]
    grad_bytes = sum(p.numel() * p.element_size() for p in alone.parameters())
    del alone, opt

    out = {"config": cfg, "grad_bytes": grad_bytes, "compute_s": compute}
    for variant in cfg["variants"]:
        model = _model(torch, width, cfg["depth"]).to(device)
        # Small buckets leave only the last (the first layer's) exposed after backward.
        kwargs = {} if cfg["bucket_mb"] is None else {"bucket_cap_mb": cfg["bucket_mb"]}
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=variant == "shared", **kwargs)
        if variant in ("shared", "sharedcopy"):
            import libmccl
            ddp.register_comm_hook(None, libmccl.ddp_shared_buckets)
        elif variant == "nocomm":
            ddp.register_comm_hook(None, _noop_hook(torch))
        elif variant == "staged":
            ddp.register_comm_hook(None, _staged_hook(torch, dist))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        _timed(torch, ddp, opt, data, cfg["warmup"], sync)
        dist.barrier()
        before = _copy_stats(dist)
        out["step_s" if variant == "ddp" else f"{variant}_s"] = _timed(torch, ddp, opt, data, cfg["steps"], sync)
        if before is not None:
            from libmccl.devices.copy_stats import per_step

            out.setdefault("copies", {})[variant] = per_step(before, _copy_stats(dist), cfg["steps"])
        if variant != "nocomm":
            _check_replicas(torch, dist, model, cfg, variant)
        if variant == "ddp":
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().cpu()
            out["fingerprint"] = {"sum": float(flat.sum()), "head": flat[:_FINGERPRINT].tolist()}
        del ddp, model, opt
    if device.type != "cpu":
        out["comm_alone_s"] = _comm_alone(torch, dist, grad_bytes, device, sync)
    return out


def _copy_stats(dist) -> dict | None:
    """The backend's copy counters (mccl's ``copy_stats()``), or None for a backend without them."""
    pg = dist.distributed_c10d._get_default_group()
    fn = getattr(pg, "copy_stats", None)
    return fn() if fn is not None else None


def _check_replicas(torch, dist, model, cfg: dict, variant: str) -> None:
    # Identical replicas have identical sums: min and max over ranks must agree to the bit.
    total = torch.tensor([sum(float(p.double().sum()) for p in model.parameters())], dtype=torch.float64)
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if float(lo[0]) != float(hi[0]):
        raise MCCLError(f"[bench] DDP replicas diverged ({variant}) after {cfg['warmup'] + cfg['steps']} steps "
                        f"(parameter sums {float(lo[0])!r} .. {float(hi[0])!r}); the backend corrupts gradients, "
                        "do not trust its step times")


def summarize(docs: list[dict], ceiling: dict | None) -> dict | None:
    """One series' DDP figures from its ranks' documents: medians over steps of the slowest rank."""
    if not docs[0].get("ddp"):
        return None
    n = len(docs)

    def slowest(key: str) -> list[float]:
        return [max(ts) for ts in zip(*(d["ddp"][key] for d in docs))]

    steps = slowest("step_s") if "step_s" in docs[0]["ddp"] else []
    compute = slowest("compute_s")
    grad = docs[0]["ddp"]["grad_bytes"]
    wire_s = grad * 2 * (n - 1) / n * 8 / ceiling["mean_bps"] if ceiling else None
    out = {"grad_bytes": grad, "steps": len(steps), "step_ms": statistics.median(steps) * 1e3 if steps else None,
           "step_ms_all": [s * 1e3 for s in steps], "compute_ms": statistics.median(compute) * 1e3,
           "wire_floor_ms": wire_s * 1e3 if wire_s is not None else None, "config": docs[0]["ddp"]["config"]}
    for variant in ("nocomm", "staged", "shared", "sharedcopy"):
        if f"{variant}_s" in docs[0]["ddp"]:
            out[f"{variant}_ms"] = statistics.median(slowest(f"{variant}_s")) * 1e3
    if "comm_alone_s" in docs[0]["ddp"]:
        out["comm_alone_ms"] = max(d["ddp"]["comm_alone_s"] for d in docs) * 1e3
    if steps and "nocomm_ms" in out:
        out["step_over_nocomm"] = out["step_ms"] / out["nocomm_ms"]
        if out.get("comm_alone_ms"):
            exposed = max(0.0, out["step_ms"] - out["nocomm_ms"])
            out["overlap_ratio"] = max(0.0, 1.0 - exposed / out["comm_alone_ms"])
    if "fingerprint" in docs[0]["ddp"]:
        out["fingerprint"] = docs[0]["ddp"]["fingerprint"]
    if "copies" in docs[0]["ddp"]:
        # Copies and bytes are the same on every rank; the time is the slowest rank's.
        out["copies_per_step"] = {
            variant: {d: {**c, "ms": max(doc["ddp"]["copies"][variant][d]["ms"] for doc in docs)}
                      for d, c in per_dir.items()}
            for variant, per_dir in docs[0]["ddp"]["copies"].items()}
    return out


_SHORT = {"device_to_host": "dev->host", "host_to_segment": "host->seg", "segment_to_host": "seg->host",
          "host_to_device": "host->dev"}


def copies_text(series: dict, variant: str = "ddp") -> str | None:
    """One series' copies a step, for the printed table: count, MB and ms per direction."""
    per_dir = (series.get("copies_per_step") or {}).get(variant)
    if not per_dir:
        return None
    return ", ".join(f"{_SHORT[d]} {c['copies']:.0f}x {c['mb']:.1f} MB {c['ms']:.1f} ms"
                     + (f" ({c['untimed']:.0f} untimed)" if c["untimed"] else "") for d, c in per_dir.items())


def params_close(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> bool:
    """Whether two series' final parameters agree (DDP on the same data from the same weights)."""
    fa, fb = a.get("fingerprint"), b.get("fingerprint")
    if not fa or not fb or len(fa["head"]) != len(fb["head"]):
        return False
    close = all(abs(x - y) <= atol + rtol * abs(y) for x, y in zip(fa["head"], fb["head"]))
    return close and abs(fa["sum"] - fb["sum"]) <= atol * len(fa["head"]) + rtol * max(1.0, abs(fb["sum"]))
