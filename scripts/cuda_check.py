#!/usr/bin/env python3
"""CUDA tensors through MCCL's device-ordering protocol (libmccl/device_order.py), checked
on an NVIDIA host. Self-checking: one line per check, exit status 1 if any fails.

Run from the repository root on a machine with a CUDA GPU, after building the engine there
(torch-free, so any torch with CUDA will do; pyzmq is not needed):

    pip install --no-build-isolation --no-deps -e .     # or put a built libmccl/_core*.so in place
    python scripts/cuda_check.py                         # about a minute

1. all-reduce of CUDA tensors with 1 (solo_comm: no engine, the identity), 2, 3 and 4 ranks
   sharing GPU 0 equals Gloo on CPU copies (integer-valued data, so every sum is exact). Each bucket is written by a kernel queued
   behind a ~25 ms GPU sleep, so the CPU is far ahead of the GPU and the engine must wait
   for O1; the result is read by a kernel queued right after Work.wait(), which only O2
   orders (half the buckets are read through Work.get_future() instead, as DDP does).
   Three buckets are in flight at once. Then DDP of a CUDA model over mccl and over Gloo:
   equal parameters after 5 steps.
2. The collective call does not block its caller on the GPU (no synchronize): issuing takes
   far less than the sleep in front of the bucket.
3. Negative control: with O1 replaced by the CPU raising ``ready`` at once, results are wrong.
4. Latency of the tickets themselves (no engine): CPU signal -> GPU wait -> GPU signal -> CPU,
   seen by a CPU spinning on the word and by Ticket.wait (the engine's wait), with and
   without the host callback that wakes the waiters (CudaOps.host_wake), 2000 trials each.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: ~25 ms at H200 clocks
CASES = [  # (elements, dtype name, op name)
    (1 << 20, "float32", "SUM"), (3_000_001, "float32", "AVG"), (1 << 18, "bfloat16", "SUM"),
    (7, "float32", "SUM"), (1 << 24, "float32", "SUM"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop_o1() -> None:
    from libmccl.device_order import OrderedOp

    def launch(self, stream):
        if not self.ops.unified:
            self.ops.copy_to_host(stream, self.buffer, self.dev_ptr, self.nbytes)
        self.ready.signal(self.target)  # the CPU says "ready" while the copy is still queued
    OrderedOp.launch = launch


def _rank(rank: int, world: int, port: int, broken: bool, q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist

        import libmccl  # noqa: F401 - registers "mccl"

        if broken:
            _drop_o1()
        torch.cuda.set_device(0)
        dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        gloo = dist.new_group(backend="gloo")
        rows = []
        cases = CASES[:1] if broken else CASES
        for trial in range(0, len(cases), 3):
            batch = cases[trial:trial + 3]
            xs, buckets, works, issue = [], [], [], 0.0
            for i, (n, dt, _) in enumerate(batch):
                g = torch.Generator(device="cuda").manual_seed(1000 * (trial + i) + rank)
                xs.append(torch.randint(-30, 30, (n,), device="cuda", generator=g).to(getattr(torch, dt)))
            for (n, dt, op), x in zip(batch, xs):
                torch.cuda._sleep(SLEEP_CYCLES)
                b = x * 1  # the bucket, written by a kernel behind the sleep
                t0 = time.perf_counter()
                works.append(dist.all_reduce(b, op=getattr(dist.ReduceOp, op), async_op=True))
                issue = max(issue, time.perf_counter() - t0)
                buckets.append(b)
            outs = []
            for i, (w, b) in enumerate(zip(works, buckets)):
                if (trial + i) % 2 == 0:
                    w.wait()
                    outs.append(b.clone())  # a kernel reading the result, ordered after done by O2 only
                else:  # as DDP: chained on the (CUDA-aware) future
                    outs.append(w.get_future().then(lambda f: f.value()[0].clone()).wait())
            for (n, dt, op), x, out in zip(batch, xs, outs):
                ref = x.cpu()
                dist.all_reduce(ref, group=gloo)  # Gloo has no AVG: SUM, then divide as the engine does
                if op == "AVG":
                    ref = ref / world
                got = out.cpu()
                rows.append((n, dt, op, bool(torch.equal(got, ref)), float((got.float() - ref.float()).abs().max())))
            rows.append(("issue_s", issue))
        dist.destroy_process_group()
        q.put((rank, "ok", rows))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))


def _ddp_rank(rank: int, world: int, port: int, broken: bool, q) -> None:
    """DDP of a CUDA model over mccl and over Gloo, same data: equal parameters."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import libmccl  # noqa: F401 - registers "mccl"

        torch.cuda.set_device(0)
        dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        gloo = dist.new_group(backend="gloo")

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
        dist.destroy_process_group()
        q.put((rank, "ok", [("ddp_max_diff", diff)]))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "error", traceback.format_exc()))


def _run_world(world: int, broken: bool = False, timeout_s: float = 90.0, target=None) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target or _rank, args=(r, world, port, broken, q), daemon=True)
             for r in range(world)]
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
        raise RuntimeError(f"only ranks {sorted(out)} of {world} reported within {timeout_s} s")
    for r, (status, value) in sorted(out.items()):
        if status != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
    return [out[r][1] for r in range(world)]


def _latency(host_wake: bool, trials: int = 1000) -> tuple[list[float], list[float]]:
    import torch

    from libmccl.cuda_ops import CudaOps
    from libmccl.device_order import TICKET_BASE

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
    import torch

    if not torch.cuda.is_available():
        print("FAIL torch sees no CUDA device")
        return 1
    failed = 0

    def report(ok: bool, line: str) -> None:
        nonlocal failed
        failed += not ok
        print(("PASS " if ok else "FAIL ") + line, flush=True)

    sleep_ms = None
    for world in (1, 2, 3, 4):  # 1: solo_comm, no engine
        t0 = time.monotonic()
        per_rank = _run_world(world)
        rows = [row for rank_rows in per_rank for row in rank_rows if row[0] != "issue_s"]
        issue = max(row[1] for rank_rows in per_rank for row in rank_rows if row[0] == "issue_s")
        bad = [row for row in rows if not row[3]]
        report(not bad, f"all-reduce of cuda tensors equals gloo, {world} ranks on one GPU, "
                        f"{len(rows)} checks ({time.monotonic() - t0:.1f} s)" + (f"; wrong: {bad[:3]}" if bad else ""))
        if sleep_ms is None:
            s0 = torch.cuda.Event(enable_timing=True)
            s1 = torch.cuda.Event(enable_timing=True)
            s0.record()
            torch.cuda._sleep(SLEEP_CYCLES)
            s1.record()
            s1.synchronize()
            sleep_ms = s0.elapsed_time(s1)
        report(issue * 1e3 < sleep_ms / 2, f"the collective call returned in at most {issue * 1e3:.2f} ms while the "
                                           f"GPU had {sleep_ms:.1f} ms of work in front of the bucket ({world} ranks)")
    diffs = [row[1] for rank_rows in _run_world(2, target=_ddp_rank) for row in rank_rows]
    report(max(diffs) < 1e-5, f"DDP of a cuda model over mccl equals DDP over gloo after 5 steps, 2 ranks "
                              f"(max parameter difference {max(diffs):.2e})")
    per_rank = _run_world(2, broken=True)
    wrong = [row for rank_rows in per_rank for row in rank_rows if row[0] != "issue_s" and not row[3]]
    report(bool(wrong), "negative control: without O1 the results are wrong" if wrong else
           "negative control: without O1 the results were still right (the GPU won the race?)")
    for host_wake in (False, True):
        spin, waited = _latency(host_wake)
        print(f"INFO CPU->GPU->CPU round trip through two tickets, host wake {'on' if host_wake else 'off'}: "
              f"CPU spinning median {statistics.median(spin):.1f} us, p99 {_pct(spin, 0.99):.1f} us; "
              f"Ticket.wait (the engine's wait) median {statistics.median(waited):.1f} us, "
              f"p99 {_pct(waited, 0.99):.1f} us ({len(spin)}+{len(waited)} trials)")
    print("OK" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
