"""The Metal bridge on a Mac, end to end: what CI (Linux) cannot run. NOT run by this repository.

    pip install --no-build-isolation -e .      # builds metal/bridge on macOS
    python scripts/metal_check.py [--ranks 2] [--json out.json]

Ranks are processes on one Mac (loopback). Each check prints PASS/FAIL:
  1. the bridge loads (MCCL_UNIFIED_COLLECTIVE=1), and which storage mode torch's mps tensors have;
  2. all_reduce of mps tensors written by GPU kernels just before the call equals Gloo's on CPU copies
     (SUM and AVG, float32/float16/bfloat16, several sizes), in place or staged;
  3. the call returns before the GPU ran the kernels queued in front of the bucket (no hidden sync);
  4. a DDP step on mps equals the same step with Gloo (parameters allclose);
  5. with --daemon (mccld running on the Mac: `mccld &`, MCCL_DAEMON=1 is set for the ranks): the
     same all-reduce through mccld equals Gloo's, and for private-storage tensors the staging
     blit wrote straight into mccld's shared buffer (libmccl/segment_staging.py over
     mccl_metal_wrap_host): no byte copied into or out of the client's segment (copy_stats()).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MCCL_UNIFIED_COLLECTIVE="1")
    import libmccl  # noqa: F401  registers the backend
    from libmccl import metal_tensors

    rows: list[tuple[str, bool, str]] = []
    dist.init_process_group("mccl", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    dev = metal_tensors.device()
    probe = torch.zeros(1024, device="mps")
    ops, _ = metal_tensors.ops_for(probe, "probe")
    rows.append(("bridge loads; mps storage is " + ("shared (in place)" if ops.unified else "private (staged)"),
                 True, ""))
    ok = True
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (1, 4097, 1 << 20):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                g = torch.Generator().manual_seed(rank * 1000 + n)
                src = torch.randint(-50, 50, (n,), generator=g).to(dtype)
                t = torch.zeros(n, dtype=dtype, device="mps")
                t.copy_(src.to("mps")).mul_(1)  # GPU kernels write the bucket right before the call
                dist.all_reduce(t, op=op)
                want = src.clone()
                dist.all_reduce(want, op=op, group=gloo)
                ok &= torch.allclose(t.cpu().float(), want.float(), atol=1e-2 if dtype != torch.float32 else 0)
    rows.append(("all_reduce of GPU-written mps buckets equals Gloo", bool(ok), ""))
    # A long GPU queue in front of the bucket: the call must return long before it drains.
    a = torch.randn(4096, 4096, device="mps")
    t = torch.ones(1 << 20, device="mps")
    torch.mps.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a = a @ a / 4096
    t.add_(a[0, 0] * 0)
    queued = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    returned = time.perf_counter() - queued
    work.wait()
    torch.mps.synchronize()
    gpu = time.perf_counter() - t0
    rows.append((f"the call returned in {returned * 1e3:.2f} ms with {gpu * 1e3:.1f} ms of GPU work queued",
                 returned < gpu / 4, ""))
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    ref.load_state_dict(m.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(m.to("mps"), bucket_cap_mb=0.25)
    ddp_ref = torch.nn.parallel.DistributedDataParallel(ref, process_group=gloo, bucket_cap_mb=0.25)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))
    for model, inp in ((ddp, x.to("mps")), (ddp_ref, x)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(inp).square().mean().backward()
            opt.step()
    same = all(torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5)
               for p, q in zip(ddp.parameters(), ddp_ref.parameters()))
    rows.append(("DDP on mps equals DDP with Gloo after 3 steps", same, ""))
    if os.environ.get("MCCL_DAEMON") == "1":
        rows.append(_through_mccld(rank, gloo, ops.unified))
    dist.destroy_process_group()
    out.put((rank, rows))


def _through_mccld(rank: int, gloo, unified: bool) -> tuple[str, bool, str]:
    pg = dist.distributed_c10d._get_default_group()
    before = pg.copy_stats()
    n = 1 << 20
    src = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(rank)).float()
    t = src.to("mps").mul_(1)
    dist.all_reduce(t)
    want = src.clone()
    dist.all_reduce(want, group=gloo)
    equal = torch.equal(t.cpu(), want)
    after = pg.copy_stats()
    into = after["copy_host_to_segment_bytes"] - before["copy_host_to_segment_bytes"]
    out = after["copy_segment_to_host_bytes"] - before["copy_segment_to_host_bytes"]
    blit = after["copy_device_to_host_bytes"] - before["copy_device_to_host_bytes"]
    detail = f"device->host {blit} B, host->segment {into} B, segment->host {out} B"
    if unified:  # shared storage is reduced from unified memory: the client still copies it (not addressed)
        return (f"through mccld, shared storage: equals Gloo ({detail})", equal, detail)
    return (f"through mccld, private storage: equals Gloo, blit straight into mccld's buffer ({detail})",
            equal and blit == n * 4 and into == 0 and out == 0, detail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--json")
    ap.add_argument("--daemon", action="store_true", help="also check through the local mccld (start it first)")
    args = ap.parse_args()
    if args.daemon:
        os.environ["MCCL_DAEMON"] = "1"  # the spawned ranks inherit it
    if not torch.backends.mps.is_available():
        print("FAIL torch reports MPS unavailable: run this on Apple silicon")
        return 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, args.port, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        r, rows = out.get(timeout=600)
        results[r] = rows
    for p in procs:
        p.join(60)
    failed = False
    for i, (name, _, _) in enumerate(results[0]):
        ok = all(rows[i][1] for rows in results.values())  # every rank ran the same checks in order
        failed |= not ok
        print(("PASS " if ok else "FAIL ") + name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(r): rows for r, rows in results.items()}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
