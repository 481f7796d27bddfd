"""The Metal bridge on a Mac, end to end: what CI (Linux) cannot run. The macOS workflow
(.github/workflows/macos.yml) runs it on GitHub's Apple-silicon runners; metal/README.md says
which of its checks need a GPU.

    pip install --no-build-isolation -e .      # builds metal/bridge (and the .metallib) on macOS
    python scripts/metal_check.py [--ranks 2] [--json out.json] [--no-mps-ok]

Without a GPU (checked first, in this process):
  a. the bridge library is built, loads, speaks this mccl's ABI and finds torch's three
     torch::mps entry points in libtorch_cpu (its open then stops at MTLCreateSystemDefaultDevice);
  b. mccl_reduce.metallib was built and names every kernel metal/README.md lists.
With MPS, ranks are processes on one Mac (loopback). Each check prints PASS/FAIL:
  1. the bridge loads (MCCL_UNIFIED_COLLECTIVE=1), and which storage mode torch's mps tensors have;
  2. all_reduce of mps tensors written by GPU kernels just before the call equals Gloo's on CPU copies
     (SUM and AVG, float32/float16/bfloat16, several sizes), in place or staged;
  3. the call returns before the GPU ran the kernels queued in front of the bucket (no hidden sync);
  4. a DDP step on mps equals the same step with Gloo (parameters allclose);
  5. with --daemon (mccld running on the Mac: `mccld &`, MCCL_DAEMON=1 is set for the ranks): the
     same all-reduce through mccld equals Gloo's, and for private-storage tensors the staging
     blit wrote straight into mccld's shared buffer (libmccl/devices/segment_staging.py over
     mccl_metal_wrap_host): no byte copied into or out of the client's segment (copy_stats()).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MCCL_UNIFIED_COLLECTIVE="1")
    import libmccl  # noqa: F401  registers the backend
    from libmccl.devices import metal_tensors

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


# The kernels metal/reduce.metal instantiates (metal/README.md, "Kernels").
KERNELS = ([f"mccl_reduce_{op}_{dt}" for op in ("sum", "min", "max", "product")
            for dt in ("float32", "float16", "bfloat16", "int32")]
           + [f"mccl_reduce_{op}_int32" for op in ("band", "bor", "bxor")]
           + [f"mccl_finalize_avg_{dt}" for dt in ("float32", "float16", "bfloat16", "int32")])


def _bridge_check() -> tuple[str, bool, str]:
    """Loads the bridge as the backend would; without a Metal GPU its open fails only after the
    torch symbols were found, at MTLCreateSystemDefaultDevice, which still proves the rest."""
    from mccl_common.errors import ConfigError
    from libmccl.devices import metal_ops, metal_tensors

    name = "the Metal bridge loads, matches this mccl's ABI and finds torch::mps in libtorch_cpu"
    if not os.path.exists(metal_ops.bridge_path()):
        return name, False, f"{metal_ops.bridge_path()} was not built"
    try:
        metal_tensors.device()
    except ConfigError as exc:
        no_gpu = "MTLCreateSystemDefaultDevice returned nil" in str(exc)
        return name + (" (no Metal GPU: stopped at MTLCreateSystemDefaultDevice)" if no_gpu else ""), no_gpu, str(exc)
    return name + " (a Metal GPU is present)", True, ""


def _metallib_check() -> tuple[str, bool, str]:
    from libmccl.devices import metal_ops

    path = os.path.join(os.path.dirname(metal_ops.bridge_path()), "mccl_reduce.metallib")
    name = f"mccl_reduce.metallib holds the {len(KERNELS)} kernels"
    if not os.path.exists(path):
        return name, False, f"{path} was not built (CMake builds it where `xcrun metal` exists)"
    with open(path, "rb") as f:
        blob = f.read()
    # A metallib's function list stores each host name as a string (no name is a prefix of another).
    missing = [k for k in KERNELS if k.encode() not in blob]
    return name, not missing, f"missing: {missing}" if missing else f"{len(blob)} bytes"


def _mps_usable() -> tuple[bool, str]:
    """torch's is_available() is not enough: GitHub's hosted Apple-silicon runners (VMs) report
    MPS available, then fail every allocation ("MPS backend out of memory ... MPS allocated: 0
    bytes", actions/runner-images#9918). A small kernel round trip decides."""
    if not torch.backends.mps.is_available():
        return False, "torch reports MPS unavailable"
    try:
        got = torch.ones(1024, device="mps").add_(1).sum().item()
    except RuntimeError as exc:
        return False, f"torch reports MPS available, but a first kernel failed: {str(exc).splitlines()[0]}"
    return got == 2048, f"a first kernel on mps gave {got}, expected 2048" if got != 2048 else ""


def _report(rows: list[tuple[str, bool, str]]) -> bool:
    for name, ok, detail in rows:
        print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail and not ok else ""))
    return all(ok for _, ok, _ in rows)


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
    ap.add_argument("--json", help="write what ran, whether MPS was present, and each check's result here")
    ap.add_argument("--no-mps-ok", action="store_true",
                    help="without MPS (a hosted runner), pass on the checks that need no GPU")
    ap.add_argument("--summary", help="append the results as Markdown here (a GitHub job summary)")
    ap.add_argument("--daemon", action="store_true", help="also check through the local mccld (start it first)")
    args = ap.parse_args()
    if args.daemon:
        os.environ["MCCL_DAEMON"] = "1"  # the spawned ranks inherit it
    mps, why_not = _mps_usable()
    record = {"platform": sys.platform, "torch": torch.__version__,
              "mps_reported": torch.backends.mps.is_available(), "mps_available": mps, "mps_detail": why_not,
              "no_gpu_checks": [], "ranks": {}}
    no_gpu = [_bridge_check(), _metallib_check()]
    record["no_gpu_checks"] = no_gpu
    failed = not _report(no_gpu)
    if not mps:
        print(f"SKIP the rank checks: {why_not} (they need Apple silicon with a usable Metal GPU)")
        _write(args.json, args.summary, record)
        return 1 if failed or not args.no_mps_ok else 0
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
    for i, (name, _, _) in enumerate(results[0]):
        ok = all(rows[i][1] for rows in results.values())  # every rank ran the same checks in order
        failed |= not ok
        print(("PASS " if ok else "FAIL ") + name)
    record["ranks"] = {str(r): rows for r, rows in results.items()}
    _write(args.json, args.summary, record)
    return 1 if failed else 0


def _write(path: str | None, summary: str | None, record: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    if not summary:
        return
    lines = [f"### metal_check on {platform.platform()}, torch {record['torch']}", "",
             f"MPS usable: **{'yes' if record['mps_available'] else 'no'}**"
             + ("" if record["mps_available"] else f" ({record['mps_detail']}; the checks on a GPU did not run)"), "",
             "| check | rank | result | detail |", "|---|---|---|---|"]
    rows = [("-", r) for r in record["no_gpu_checks"]]
    rows += [(rank, r) for rank, rank_rows in sorted(record["ranks"].items()) for r in rank_rows]
    for rank, (name, ok, detail) in rows:
        lines.append(f"| {name} | {rank} | {'PASS' if ok else 'FAIL'} | {detail.replace('|', '/')} |")
    with open(summary, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
