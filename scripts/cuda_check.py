#!/usr/bin/env python3
"""CUDA tensors through MCCL (libmccl/devices/device_order.py, docs/cuda.md), checked on an NVIDIA
host. Self-checking: one PASS/FAIL line per check, exit status 1 if any fails; with $OUT
set, every figure also goes to $OUT/cuda_check.json.

Run from the repository root on a machine with a CUDA GPU, after building the engine there
(torch-free, so any torch with CUDA will do; pyzmq is not needed):

    pip install --no-build-isolation --no-deps -e .     # or put a built libmccl/_core*.so in place
    python scripts/cuda_check.py                         # about 1-2 minutes on the H200
    python scripts/cuda_check.py --emulated              # no GPU: the emulated driver (a dry run)
    python scripts/cuda_check.py --daemon                # the same through one mccld (MCCL_DAEMON=1; needs pyzmq)

1. Every collective (libmccl.devices.device_check.CASES) with CUDA tensors at 1, 2 and 4 ranks
   sharing GPU 0 equals the same case on CPU copies over Gloo (or mccl's CPU path where
   Gloo lacks the op), bit for bit (integer-valued data). Each input is written by a kernel
   queued behind a ~25 ms GPU sleep and the results are read by a kernel queued after
   Work.wait(), so O1 and O2 are what make them right. A first pass warms the staging pool.
2. Non-blocking: in the second pass every call returned while the GPU had not yet run
   the kernels writing its inputs (their event not reached), with its time beside the sleep's.
3. A CPU rank and a CUDA rank in one job: every case equal.
4. DDP of a CUDA model (2 ranks, several buckets) over mccl equals DDP over Gloo.
5. Negative control: with O1 removed (the CPU raises ``ready`` while the copies are queued)
   the results are wrong.
7. With --daemon: CUDA buckets are staged in mccld's shared buffers registered with the driver
   (cuMemHostRegister; libmccl/devices/segment_staging.py, issue 27): a 16 MB all-reduce is exact and
   copies nothing into or out of the client's segment (ProcessGroupMCCL.copy_stats()).
6. Latency of an 8-byte all-reduce, CUDA tensor vs CPU tensor (2 ranks), and of the
   tickets themselves; whether cuMemHostAlloc waits for queued GPU work (the hidden
   synchronisation the pool avoids).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLDS = (1, 2, 4)
LATENCY_ITERS = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, emulated: bool):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import libmccl  # noqa: F401 - registers "mccl"

    if not emulated:
        torch.cuda.set_device(0)
    dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return dist, dist.new_group(backend="gloo")


def _device(emulated: bool, cpu: bool = False):
    from libmccl.devices import device_check as C

    if cpu:
        return C.CpuDevice()
    return C.emulated_cuda() if emulated else C.CudaDevice()


def _cases_rank(rank: int, world: int, port: int, emulated: bool, mode: str, q) -> None:
    """mode: "all" (every case, warm-up then held), "mixed" (rank 0 on the CPU), "broken" (no O1)."""
    try:
        dist, gloo = _init(rank, world, port, emulated)
        from libmccl.devices import device_check as C
        from mccl_common.errors import MCCLError

        dev = _device(emulated, cpu=mode == "mixed" and rank == 0)
        undo = C.without_o1() if mode == "broken" else None
        rows = []
        try:
            for held in (False, True):
                for name in C.CASES:
                    try:
                        r = C.run_case(name, dev, None, [("gloo", gloo), ("mccl-cpu", None)], rank, world,
                                       hold=held, seed_offset=1000 * held)
                    except MCCLError as e:
                        if mode != "broken":
                            raise
                        # Without O1 the bytes may change under a sealed frame's tag: the receiver
                        # fails the op (AuthError) instead of summing them. The race was seen; the
                        # communicator is failed, so the cases end here.
                        rows.append({"case": name, "equal": False, "error": f"{type(e).__name__}: {e}"})
                        break
                    if held:
                        rows.append(r.__dict__)
                else:
                    continue
                break
        finally:
            if undo is not None:
                undo()
            dev.close()
        dist.destroy_process_group()
        q.put((rank, "ok", rows))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))


def _ddp_rank(rank: int, world: int, port: int, emulated: bool, mode: str, q) -> None:
    """DDP of a CUDA model over mccl and over Gloo, same data: equal parameters."""
    try:
        dist, gloo = _init(rank, world, port, emulated)
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from libmccl.devices.device_check import SLEEP_CYCLES

        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()

        trained = []
        for pg in (None, gloo):
            m = DDP(model(), process_group=pg, bucket_cap_mb=0.25)  # several buckets per step
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            g = torch.Generator(device="cuda").manual_seed(7 + rank)
            for _ in range(5):
                x = torch.randn(64, 256, device="cuda", generator=g)
                opt.zero_grad()
                torch.cuda._sleep(SLEEP_CYCLES // 10)  # the GPU runs behind the CPU
                m(x).square().mean().backward()
                opt.step()
            trained.append([p.detach().cpu() for p in m.parameters()])
        diff = max(float((a - b).abs().max()) for a, b in zip(*trained))
        replicas = [torch.cat([p.reshape(-1) for p in trained[0]])]
        dist.all_reduce(replicas[0], op=dist.ReduceOp.MAX, group=gloo)
        spread = float((replicas[0] - torch.cat([p.reshape(-1) for p in trained[0]])).abs().max())
        dist.destroy_process_group()
        q.put((rank, "ok", [{"ddp_max_diff": diff, "replica_spread": spread}]))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))


SEGMENT_MB = 16


def _segment_rank(rank: int, world: int, port: int, emulated: bool, mode: str, q) -> None:
    """Through mccld: three all-reduces of a SEGMENT_MB cuda bucket, exact, and their copies."""
    try:
        dist, gloo = _init(rank, world, port, emulated)
        import torch

        from libmccl.devices.device_check import pattern

        dev = _device(emulated)
        pg = dist.distributed_c10d._get_default_group()
        n = SEGMENT_MB << 18
        want = sum(pattern(n, torch.float32, r) for r in range(world))
        before, exact = pg.copy_stats(), True
        for _ in range(3):
            t = dev.produce(n, torch.float32, rank)
            dist.all_reduce(t)
            exact &= torch.equal(dev.read(t), want)
        after = pg.copy_stats()
        row = {k: after[k] - before[k] for k in after if k.endswith(("_bytes", "_count", "_s"))}
        row.update(exact=exact, slabs=pg._segment_staging.slabs(), bytes=3 * n * 4)
        dev.close()
        dist.destroy_process_group()
        q.put((rank, "ok", [row]))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))


def _latency_rank(rank: int, world: int, port: int, emulated: bool, mode: str, q) -> None:
    """Median time of a synchronous 8-byte all-reduce: device tensor (result read back) vs CPU tensor."""
    try:
        dist, _ = _init(rank, world, port, emulated)
        import torch

        dev = _device(emulated)
        out = {}
        for label in ("device", "cpu"):
            t = dev.produce(2, torch.float32, rank) if label == "device" else torch.ones(2)
            times = []
            for i in range(LATENCY_ITERS + 10):
                t0 = time.perf_counter()
                dist.all_reduce(t, async_op=True).wait()
                if label == "device":
                    dev.read(t)  # the result is on the device, usable by the next kernel
                if i >= 10:
                    times.append(time.perf_counter() - t0)
            out[label] = statistics.median(times) * 1e6
        dev.close()
        dist.destroy_process_group()
        q.put((rank, "ok", [out]))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))


def _run_world(target, world: int, emulated: bool, mode: str = "all", timeout_s: float = 120.0) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, emulated, mode, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                r, status, value = q.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty: poll again
                continue
            out[r] = (status, value)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    if len(out) < world:
        raise RuntimeError(f"Timed out after {timeout_s} s: only ranks {sorted(out)} of {world} reported")
    for r, (status, value) in sorted(out.items()):
        if status != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
    return [out[r][1] for r in range(world)]


def _sleep_ms() -> float:
    import torch

    from libmccl.devices.device_check import SLEEP_CYCLES

    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    s1.record()
    s1.synchronize()
    return s0.elapsed_time(s1)


def _host_alloc_blocks_ms() -> dict:
    """How long cuMemHostAlloc(16 MiB) takes with ~25 ms of GPU work queued, per flag set:
    close to the sleep means it waits for the GPU (why staging blocks come from a pool)."""
    import ctypes

    import torch

    from libmccl.devices.cuda_ops import _Driver
    from libmccl.devices.device_check import SLEEP_CYCLES

    drv = _Driver()
    out = {}
    for label, flags in (("portable|devicemap", 0x03), ("portable", 0x01), ("none", 0x00)):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        ptr = ctypes.c_void_p()
        t0 = time.perf_counter()
        drv.check(drv.cuMemHostAlloc(ctypes.byref(ptr), 16 << 20, flags), "cuMemHostAlloc")
        out[f"alloc {label}"] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        drv.check(drv.cuMemFreeHost(ptr), "cuMemFreeHost")
        out[f"free {label}"] = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return out


def _ticket_latency(host_wake: bool, trials: int = 500) -> tuple[list[float], list[float]]:
    """CPU signal -> GPU wait -> GPU signal -> CPU, by a CPU spinning on the word and by
    Ticket.wait (the engine's wait)."""
    import torch

    from libmccl.devices.cuda_ops import CudaOps
    from libmccl.devices.device_order import TICKET_BASE

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    ops = CudaOps(0)
    ops.host_wake = host_wake
    stream = torch.cuda.current_stream().cuda_stream
    a, b = ops.new_ticket(), ops.new_ticket()
    spin, waited = [], []
    for i in range(2 * trials):
        v = TICKET_BASE + i + 1
        ops.wait(stream, a, v)   # the GPU holds here ...
        ops.signal(stream, b, v)  # ... then answers
        time.sleep(0.0002)        # let the GPU reach its wait
        t0 = time.perf_counter_ns()
        a.signal(v)
        if i % 2 == 0:
            while b.value < v:
                pass
            spin.append((time.perf_counter_ns() - t0) / 1e3)
        else:
            b.wait(v, 5.0, "[cuda_check] latency")
            waited.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return spin, waited


def _pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emulated", action="store_true",
                    help="no GPU: CUDA tensors are host memory behind libmccl.devices.cuda_emulator (a dry run of this script)")
    ap.add_argument("--daemon", action="store_true",
                    help="every rank through one mccld started by this script (MCCL_DAEMON=1), as on one host")
    args = ap.parse_args()
    if args.daemon:
        return _with_daemon(lambda: _checks(args))
    if os.environ.get("MCCL_JOB_KEY_FILE") or os.environ.get("MCCL_WIRE_SECURITY") == "off":
        return _checks(args)
    # In-process the ranks need a job key (through mccld the daemon's fleet key serves): a
    # throwaway one, as a check on one machine needs nothing more.
    import tempfile

    from mccl_common.daemon_settings import write_key_file

    with tempfile.TemporaryDirectory(prefix="mccl-cudacheck-") as keys:
        os.environ["MCCL_JOB_KEY_FILE"] = str(write_key_file(os.path.join(keys, "job.key")))
        return _checks(args)


def _with_daemon(run) -> int:
    """Start one mccld in this process for the spawned ranks (they inherit the environment)."""
    import contextlib
    import tempfile

    from mccl_common.daemon_settings import load_config
    from mccld.daemon import Daemon

    with tempfile.TemporaryDirectory(prefix="mccl-cudacheck-") as rdir, contextlib.ExitStack() as stack:
        env = {"MCCL_RUNTIME_DIR": rdir, "MCCL_FLEET_KEY": "cuda-check-" + "k" * 32, "MCCL_LISTEN_ADDR": "127.0.0.1",
               "MCCL_PORT": "0", "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0",
               "MCCL_HOST_ID": f"cudacheck{os.getpid()}"}
        daemon = Daemon(load_config(env=env)).start()
        stack.callback(daemon.stop)
        os.environ.update(env, MCCL_DAEMON="1")
        rc = run()
        ops = daemon.stats.snapshot()["ops"] if daemon.stats is not None else {}
        served = sum(o["count"] for o in ops.values())
        print(("PASS " if served else "FAIL ") + f"mccld served the ranks' collectives ({served} ops: "
              + ", ".join(f"{k} {o['count']}" for k, o in sorted(ops.items())) + ")", flush=True)
        return rc if served else 1


def _checks(args) -> int:
    import torch

    if not args.emulated and not torch.cuda.is_available():
        print("FAIL torch sees no CUDA device (use --emulated for a dry run without one)")
        return 1
    t_start = time.monotonic()
    failed = 0
    report_json: dict = {"emulated": args.emulated, "checks": [], "figures": {}}

    def report(ok: bool, line: str) -> None:
        nonlocal failed
        failed += not ok
        print(("PASS " if ok else "FAIL ") + line, flush=True)
        report_json["checks"].append({"ok": ok, "line": line})

    def info(line: str, **figures) -> None:
        print("INFO " + line, flush=True)
        report_json["figures"].update(figures)

    def guarded(what: str, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            report(False, f"{what}: {type(exc).__name__}: {str(exc)[-1500:]}")

    if args.emulated:
        held = "the emulated stream was held"
    else:
        held_ms = _sleep_ms()
        held = f"{held_ms:.1f} ms of GPU work was queued in front"
        info(f"the sleep in front of each case's inputs: {held_ms:.1f} ms of GPU work", sleep_ms=held_ms)

    def cases(world: int) -> None:
        t0 = time.monotonic()
        rows = [row for rank_rows in _run_world(_cases_rank, world, args.emulated) for row in rank_rows]
        report_json["figures"][f"cases_{world}"] = rows
        bad = [f"{r['case']} ({r['detail']})" for r in rows if not r["equal"]]
        refs = sorted({r["reference"] for r in rows})
        report(not bad, f"every collective ({len({r['case'] for r in rows})} cases) on cuda tensors equals the CPU "
                        f"reference ({', '.join(refs)}), {world} ranks on one GPU ({time.monotonic() - t0:.1f} s)"
               + (f"; wrong: {bad[:4]}" if bad else ""))
        late = [r["case"] for r in rows if not r["returned_early"]]
        worst = max(r["issue_s"] for r in rows) * 1e3
        report(not late, f"every collective call returned before the GPU ran its inputs' kernels, at most "
                         f"{worst:.2f} ms per case while {held} ({world} ranks)" + (f"; waited: {late}" if late else ""))

    for world in WORLDS:
        guarded(f"every collective, {world} ranks", lambda w=world: cases(w))

    def mixed() -> None:
        rows = [row for rank_rows in _run_world(_cases_rank, 2, args.emulated, "mixed") for row in rank_rows]
        bad = [f"{r['case']} ({r['detail']})" for r in rows if not r["equal"]]
        report(not bad, "a CPU rank and a CUDA rank in one job: every collective equals the CPU reference"
               + (f"; wrong: {bad[:4]}" if bad else ""))
    guarded("mixed CPU/CUDA ranks", mixed)

    def ddp() -> None:
        rows = [row for rank_rows in _run_world(_ddp_rank, 2, args.emulated) for row in rank_rows]
        diff = max(r["ddp_max_diff"] for r in rows)
        spread = max(r["replica_spread"] for r in rows)
        report(diff < 1e-5 and spread == 0.0, f"DDP of a cuda model over mccl equals DDP over gloo after 5 steps, "
                                              f"2 ranks (max parameter difference {diff:.2e}; replicas differ by "
                                              f"{spread:.2e})")
        report_json["figures"]["ddp"] = rows
    if args.emulated:
        info("DDP over cuda skipped with --emulated (torch's reducer needs real CUDA tensors; "
             "tests/torch/test_device_order_ddp.py drives DDP through the fake device)")
    else:
        guarded("DDP over cuda", ddp)

    def negative() -> None:
        rows = [row for rank_rows in _run_world(_cases_rank, 2, args.emulated, "broken") for row in rank_rows]
        wrong = [r["case"] for r in rows if not r["equal"]]
        failed = [r for r in rows if "error" in r]
        seen = (f"an op failed ({failed[0]['case']}: {failed[0]['error'].splitlines()[0][:160]})" if failed else
                f"wrong results ({len(wrong)} of {len(rows)} case results)")
        report(bool(wrong), f"negative control: without O1 the checks see {seen}" if wrong else
               "negative control: without O1 every result was still right (the checks cannot see a missing O1)")
    guarded("negative control", negative)

    def segment() -> None:
        rows = [row for rank_rows in _run_world(_segment_rank, 2, args.emulated) for row in rank_rows]
        report_json["figures"]["segment_staging"] = rows
        into = max(r["copy_host_to_segment_bytes"] for r in rows)
        staged = min(r["copy_device_to_host_bytes"] for r in rows)
        d2h_ms = max(r["copy_device_to_host_s"] for r in rows) * 1e3
        h2d_ms = max(r["copy_host_to_device_s"] for r in rows) * 1e3
        ok = all(r["exact"] and r["slabs"] > 0 for r in rows) and into == 0 and staged == rows[0]["bytes"]
        report(ok, f"through mccld, {SEGMENT_MB} MB cuda buckets are staged in mccld's shared buffers (registered "
                   f"with the driver): exact, host->segment {into} B, device->host {staged} B in {d2h_ms:.2f} ms, "
                   f"host->device in {h2d_ms:.2f} ms (3 all-reduces, 2 ranks)")
    if args.daemon:
        guarded("segment staging", segment)

    def latency() -> None:
        rows = [row for rank_rows in _run_world(_latency_rank, 2, args.emulated) for row in rank_rows]
        dev_us, cpu_us = max(r["device"] for r in rows), max(r["cpu"] for r in rows)
        info(f"8-byte all_reduce, 2 ranks, median of {LATENCY_ITERS}: cuda tensor {dev_us:.0f} us (call, wait, "
             f"result read back), cpu tensor {cpu_us:.0f} us", allreduce_8b_cuda_us=dev_us, allreduce_8b_cpu_us=cpu_us)
    guarded("latency", latency)

    if not args.emulated:
        def host_alloc() -> None:
            ms = _host_alloc_blocks_ms()
            info("pinned allocation with 25 ms of GPU work queued: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                 + f" (near {held_ms:.0f} ms: it waits for the GPU)", host_alloc_ms=ms)
        guarded("cuMemHostAlloc timing", host_alloc)

        def tickets() -> None:
            for host_wake in (False, True):
                spin, waited = _ticket_latency(host_wake)
                info(f"CPU->GPU->CPU round trip through two tickets, host wake {'on' if host_wake else 'off'}: "
                     f"CPU spinning median {statistics.median(spin):.1f} us, p99 {_pct(spin, 0.99):.1f} us; "
                     f"Ticket.wait median {statistics.median(waited):.1f} us, p99 {_pct(waited, 0.99):.1f} us",
                     **{f"ticket_rtt_us_wake_{host_wake}": statistics.median(waited)})
        guarded("ticket latency", tickets)

    elapsed = time.monotonic() - t_start
    print(f"INFO total {elapsed:.0f} s")
    report_json["elapsed_s"] = elapsed
    report_json["daemon"] = bool(args.daemon)
    if os.environ.get("OUT"):
        name = "cuda_check_daemon.json" if args.daemon else "cuda_check.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(report_json, f, indent=1, default=str)
    print("OK" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
