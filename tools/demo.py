"""``python -m tools.demo``: train a tiny transformer with DDP over the mccl backend.

Launches N ranks (default 4) on this machine, each an ordinary torch.distributed
process calling ``init_process_group("mccl")``. They learn a synthetic language (a
fixed random Markov chain over 128 tokens, two likely successors per token) for a
bounded time, and rank 0 prints per-step loss, samples/s and the all-reduce
bandwidth DDP achieved, then a summary. The run fails (exit status 1) if a rank
fails, the loss does not fall, or the replicas' parameters diverge.

``--daemon`` runs the same job through the local mccld (MCCL_DAEMON=1);
``--with-daemon`` (what ``make demo`` runs) starts a private mccld for it first and
shows ``mcclctl status`` and the daemon's Prometheus figures around the job.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mccl_common import shm

VOCAB, SEQ, D_MODEL, LAYERS = 128, 32, 128, 2


@dataclass(frozen=True)
class DemoArgs:
    world: int
    steps: int
    seconds: float
    batch: int
    daemon: bool
    port: int


def _markov_chain(seed: int = 0):
    """A fixed chain every rank agrees on: token t -> one of two favourite successors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    probs = torch.full((VOCAB, VOCAB), 0.02 / (VOCAB - 2))
    for t in range(VOCAB):
        a, b = torch.randperm(VOCAB, generator=g)[:2].tolist()
        probs[t, a], probs[t, b] = 0.7, 0.28
    return probs


def _batch(probs, n: int, g):
    import torch

    tokens = torch.empty(n, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for i in range(SEQ):
        tokens[:, i + 1] = torch.multinomial(probs[tokens[:, i]], 1, generator=g).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def _model():
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
            layer = nn.TransformerEncoderLayer(D_MODEL, nhead=4, dim_feedforward=4 * D_MODEL, dropout=0.0,
                                               batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(D_MODEL, VOCAB)
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

        def forward(self, x):
            return self.head(self.blocks(self.embed(x) + self.pos, mask=self.causal, is_causal=True))

    torch.manual_seed(0)  # every replica starts identical; DDP also broadcasts rank 0's
    return TinyLM()


class _AllReduceMeter:
    """State of ``_metered_allreduce_hook``: bytes all-reduced in a step and the wall
    time from the first bucket issued to the last bucket done."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0
        self.first_issue: float | None = None
        self.last_issue = 0.0
        self.last_done = 0.0

    def reset(self) -> None:
        self.bytes, self.first_issue, self.last_issue, self.last_done = 0, None, 0.0, 0.0

    def overlap(self) -> float | None:
        """1 - exposed/total communication time. The last bucket is issued when backward's
        compute ends, so the exposed part is from then until the last bucket is done."""
        if self.first_issue is None or self.last_done <= self.first_issue:
            return None
        exposed = max(0.0, self.last_done - self.last_issue)
        return min(1.0, max(0.0, 1.0 - exposed / (self.last_done - self.first_issue)))

    def bus_gbps(self) -> float:
        """Bus bandwidth (nccl-tests convention): algbw * 2(n-1)/n, in Gbit/s."""
        if self.first_issue is None or self.last_done <= self.first_issue:
            return 0.0
        alg = self.bytes / (self.last_done - self.first_issue)
        return alg * 2 * (self.world - 1) / self.world * 8 / 1e9


def _metered_allreduce_hook(meter: _AllReduceMeter, bucket):
    """DDP comm hook: all-reduce the gradient bucket over mccl, average, and time it."""
    import torch.distributed as dist

    buf = bucket.buffer()
    meter.bytes += buf.numel() * buf.element_size()
    meter.last_issue = time.perf_counter()
    if meter.first_issue is None:
        meter.first_issue = meter.last_issue
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        meter.last_done = time.perf_counter()
        return f.value()[0].div_(meter.world)
    return fut.then(done)


def _rank_main(rank: int, args: DemoArgs) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port),
                       "MCCL_DAEMON": "1" if args.daemon else "0"})
    torch.set_num_threads(1)
    dist.init_process_group("mccl", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=60))
    try:
        _train(rank, args, torch, dist, DDP)
    finally:
        dist.destroy_process_group()


def _train(rank: int, args: DemoArgs, torch, dist, DDP) -> None:
    say = print if rank == 0 else (lambda *a, **k: None)
    model = DDP(_model())
    meter = _AllReduceMeter(args.world)
    model.register_comm_hook(meter, _metered_allreduce_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    probs = _markov_chain()
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
    comm = getattr(model.process_group, "communicator", None)
    report_overlap = getattr(comm, "report_overlap", None)  # only the daemon client collects it
    n_params = sum(p.numel() for p in model.parameters())
    say(f"[demo] {args.world} ranks, backend={dist.get_backend()}{' via mccld' if args.daemon else ''}, "
        f"model {n_params / 1e6:.2f}M params ({n_params * 4 / 2**20:.1f} MiB of gradients per step), "
        f"global batch {args.batch * args.world} x {SEQ} tokens")
    # Per step, DDP's all-reduce figure is gradient bytes over the time from the first
    # bucket issued to the last one done; buckets overlap the backward pass, so it is a
    # lower bound on what the links sustain (the probe at the end measures that).
    say(f"{'step':>5} {'loss':>7} {'samples/s':>10} {'step ms':>8} {'DDP allreduce Gbit/s':>21}")
    losses, rates, bws = [], [], []
    started = time.perf_counter()
    step = 0
    while True:
        x, y = _batch(probs, args.batch, g)
        t0 = time.perf_counter()
        meter.reset()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        # One tiny all-reduce carries the mean loss and rank 0's decision to stop, so
        # every rank leaves the loop after the same step.
        elapsed = time.perf_counter() - started
        stop = float(rank == 0 and (step + 1 >= args.steps or elapsed >= args.seconds))
        control = torch.tensor([loss.item() / args.world, stop])
        dist.all_reduce(control)
        dt = time.perf_counter() - t0
        losses.append(control[0].item())
        rates.append(args.batch * args.world / dt)
        bws.append(meter.bus_gbps())
        ratio = meter.overlap()
        if report_overlap is not None and ratio is not None:
            report_overlap(ratio)
        if step % 5 == 0 or control[1] > 0:
            say(f"{step:>5} {losses[-1]:>7.3f} {rates[-1]:>10.0f} {dt * 1e3:>8.1f} {bws[-1]:>21.2f}")
        step += 1
        if control[1] > 0:
            break
    _summary(rank, args, torch, dist, model, losses, rates, bws, time.perf_counter() - started, say)


def _summary(rank, args, torch, dist, model, losses, rates, bws, wall, say) -> None:
    # Replicas must hold identical parameters: compare a checksum's min and max.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    lo, hi = checksum.clone(), checksum.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    probe = _bandwidth_probe(torch, dist, args.world)
    stats = model.process_group.communicator.stats() if hasattr(model.process_group, "communicator") else {}
    first = sum(losses[:3]) / len(losses[:3])
    last = sum(losses[-3:]) / len(losses[-3:])
    say(f"[demo] summary: {len(losses)} steps in {wall:.1f}s, loss {first:.3f} -> {last:.3f} "
        f"(uniform guess: {math.log(VOCAB):.3f}), {sum(rates) / len(rates):.0f} samples/s mean")
    say(f"[demo] all-reduce bus bandwidth: {sum(bws) / len(bws):.2f} Gbit/s during DDP steps (overlapping "
        f"backward), {probe:.2f} Gbit/s for back-to-back 16 MiB all-reduces")
    if stats:
        say(f"[demo] rank 0 engine: {stats.get('ops_completed', 0)} ops, "
            f"{stats.get('bytes_sent', 0) / 2**20:.0f} MiB sent, {stats.get('bytes_received', 0) / 2**20:.0f} MiB received")
    if not hi.item() - lo.item() <= 1e-6 * max(1.0, abs(hi.item())):
        raise SystemExit(f"[demo] FAILED: replicas diverged (parameter checksum {lo.item()} .. {hi.item()})")
    if not last < first - 0.5:
        raise SystemExit(f"[demo] FAILED: the loss did not fall ({first:.3f} -> {last:.3f})")
    say("[demo] OK: loss fell and all replicas hold identical parameters")
    dist.barrier()  # nobody tears its links down while a peer still finishes the probe


def _bandwidth_probe(torch, dist, world: int, mib: int = 16, iters: int = 5) -> float:
    t = torch.ones(mib << 18)
    dist.all_reduce(t)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dt = (time.perf_counter() - t0) / iters
    return (mib << 20) / dt * 2 * (world - 1) / world * 8 / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(args: DemoArgs, during=None) -> int:
    """Spawn the ranks and wait for them; ``during()`` is polled about once a second while
    they run, until it returns True."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    ctx = mp.start_processes(_rank_main, args=(args,), nprocs=args.world, join=False, start_method="spawn")
    deadline = time.monotonic() + args.seconds + 120  # start-up and summary on a loaded machine
    try:
        while not ctx.join(timeout=1.0):
            if during is not None and during():
                during = None
            if time.monotonic() > deadline:
                print(f"[demo] FAILED: ranks still running after {args.seconds + 120:.0f}s", file=sys.stderr)
                return 1
    except ProcessException as exc:
        print(f"[demo] FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return 0


def orphaned_segments() -> set[str]:
    """The mccl segments in /dev/shm whose owner (the pid in the name) is gone: what a demo
    that cleaned up leaves none of, once its processes ended. A live process's segments belong
    to whatever else runs here (CI runs tests beside the demos)."""
    if not Path("/dev/shm").is_dir():
        return set()
    names = (p.name for p in Path("/dev/shm").glob("mccl-*"))
    return {n for n in names if (pid := shm.owner_pid(n)) is None or not shm.pid_alive(pid)}


def _run_with_daemon(args: DemoArgs) -> int:
    """Start a private mccld, train through it, show it with mcclctl and its exporter."""
    from .demo_daemon import DemoDaemon, host_states, show_metrics, show_status

    daemon = DemoDaemon()
    segments_before = orphaned_segments()
    print("[demo] starting mccld (loopback only, private runtime dir and fleet key)", flush=True)
    daemon.start()
    try:
        os.environ.update(daemon.env)  # the spawned ranks attach to this daemon
        show_status(daemon, "before the job")
        print("[demo] one host: mccld reduces the ranks' gradients in shared memory; LINKS and TX/RX "
              "count links to other hosts, so they stay 0 here", flush=True)
        started = time.monotonic()

        def show_once_training() -> bool:
            # Print the fleet once the job is attached and has trained for a few seconds.
            if time.monotonic() - started < 5 or "training" not in host_states(daemon):
                return False
            show_status(daemon, "while the job trains")
            return True

        rc = _run_ranks(args, during=show_once_training)
        if rc == 0:
            show_status(daemon, "after the job")
            show_metrics(daemon)
            states = host_states(daemon)
            if states and any(s != "idle" for s in states):
                print(f"[demo] FAILED: daemon still busy after the job: {states}", file=sys.stderr)
                rc = 1
        return rc
    finally:
        daemon.stop()
        leaked = sorted(orphaned_segments() - segments_before)
        daemon.cleanup()
        print(f"[demo] mccld stopped; shared-memory segments left: {len(leaked)}", flush=True)
        if leaked:
            print(f"[demo] FAILED: leaked segments {leaked}", file=sys.stderr)
            return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks to launch (default 4)")
    p.add_argument("--steps", type=int, default=300, help="at most this many steps (default 300)")
    p.add_argument("--seconds", type=float, default=30.0, help="stop training after this long (default 30)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--daemon", action="store_true", help="run collectives through an already running mccld")
    p.add_argument("--with-daemon", action="store_true",
                   help="start a private mccld, train through it and show mcclctl status and its metrics")
    ns = p.parse_args(argv)
    if ns.world < 2:
        p.error("--world must be at least 2")
    args = DemoArgs(ns.world, ns.steps, ns.seconds, ns.batch, ns.daemon or ns.with_daemon, _free_port())
    if ns.with_daemon:
        return _run_with_daemon(args)
    return _run_ranks(args)


if __name__ == "__main__":
    sys.exit(main())
