"""Soak: a small DDP training job through mccld on an emulated fleet, for a given time.

Two hosts (network namespaces, tools.fleet) with one mccld and two ranks each. The
ranks train an MLP under DistributedDataParallel with ``init_process_group("mccl")`` and
MCCL_DAEMON=1, the path a user runs; every ``--epoch-seconds`` they destroy the group
and build a new one (a new job on every daemon). Every step is checked: each rank
recomputes every rank's gradients on a plain copy of the model and compares their mean
with what DDP's all-reduce left in ``.grad``; every epoch the ranks all-gather a
checksum of their parameters, which must be identical.

The parent samples each daemon's RSS, fds and threads every ``--interval`` seconds (one
line each, and the JSON summary at the end), and fails if, from the first sample after
the first epoch to the last one, RSS grew more than ``--rss-mb`` or threads/fds more
than ``--slack``.

Usage::

    .venv/bin/python scripts/soak.py --minutes 60 [--json soak.json]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "faults"))

PLACEMENT = (0, 0, 1, 1)
_GROUP_TIMEOUT_S = 60.0
_STORE_PORT = 29790
_GRAD_RTOL, _GRAD_ATOL = 1e-4, 1e-6


# -- a rank ---------------------------------------------------------------------------------
def rank_main(rank: int, world: int, stop_at: float, epoch_s: float) -> dict:
    import copy
    import datetime

    import torch
    import torch.distributed as dist
    import libmccl

    libmccl.register()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=_GROUP_TIMEOUT_S)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _STORE_PORT, world, rank == 0, timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = {"rank": rank, "steps": 0, "epochs": 0, "grad_mismatches": 0, "param_mismatches": 0}
    step = 0
    done = False
    while not done:
        epoch = out["epochs"]
        dist.init_process_group("mccl", store=dist.PrefixStore(f"epoch{epoch}", store), rank=rank,
                                world_size=world, timeout=timeout)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        ref = copy.deepcopy(model)
        epoch_end = min(stop_at, time.time() + epoch_s)
        while True:
            batches = [_batch(step, r) for r in range(world)]
            opt.zero_grad()
            x, y = batches[rank]
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            out["grad_mismatches"] += not _grads_match(model, ref, batches)
            opt.step()
            step += 1
            # Every rank stops at the same step: the latest clock decides.
            flag = torch.tensor([1.0 if time.time() >= epoch_end else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        sums = torch.zeros(world, dtype=torch.float64)
        mine = torch.cat([p.detach().double().flatten() for p in model.parameters()]).sum().reshape(1)
        dist.all_gather_into_tensor(sums, mine)
        out["param_mismatches"] += int((sums != sums[0]).any())
        del ddp
        dist.destroy_process_group()
        out["epochs"] += 1
        out["steps"] = step
        done = time.time() >= stop_at
    return out


def _batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(step * 64 + rank)
    return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)


def _grads_match(model, ref, batches) -> bool:
    """DDP's averaged gradient against the mean of every rank's, recomputed here."""
    import torch
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    for x, y in batches:
        (torch.nn.functional.mse_loss(ref(x), y) / len(batches)).backward()
    return all(torch.allclose(p.grad, q.grad, rtol=_GRAD_RTOL, atol=_GRAD_ATOL)
               for p, q in zip(model.parameters(), ref.parameters()))


# -- the harness ------------------------------------------------------------------------------
def _growth(samples: list[dict], first: int) -> dict[str, dict[str, int]]:
    start, end = samples[first]["daemons"], samples[-1]["daemons"]
    return {h: {k: end[h][k] - start[h][k] for k in start[h]} for h in start if h in end}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples of the daemons")
    ap.add_argument("--epoch-seconds", type=float, default=20.0, help="a new process group (job) this often")
    ap.add_argument("--rss-mb", type=float, default=16.0, help="allowed RSS growth per daemon")
    ap.add_argument("--slack", type=int, default=2, help="allowed growth of threads and fds per daemon")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from daemons import HostDaemons, daemon_footprint
    from tools.fleet import Fleet

    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the fleet and its daemons are torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="mccl-soak-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    world = len(PLACEMENT)
    samples: list[dict] = []
    began = time.time()
    stop_at = began + 60 * args.minutes
    ranks: list[subprocess.Popen] = []
    with Fleet(max(PLACEMENT) + 1, rate=None) as fleet:
        daemons = HostDaemons(fleet, work / "daemons")
        try:
            daemons.start_all()
            base_env = {"MCCL_DAEMON": "1", "MASTER_ADDR": fleet.hosts[PLACEMENT[0]].addr,
                        "WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT)}
            for r, h in enumerate(PLACEMENT):
                ranks.append(fleet.popen(h, [sys.executable, __file__, "--worker", str(r), str(world),
                                             str(stop_at), str(args.epoch_seconds)],
                                         env={**daemons.env(h), **base_env, "RANK": str(r)},
                                         stdout=open(work / f"rank{r}.out", "w"),
                                         stderr=open(work / f"rank{r}.err", "w")))
            while any(p.poll() is None for p in ranks):
                if time.time() > stop_at + 120:
                    break
                now = {f"h{h}": daemon_footprint(daemons.pid(h)) for h in range(fleet.n_hosts)
                       if daemons.procs[h].poll() is None}
                samples.append({"t": round(time.time() - began, 1), "daemons": now})
                print(f"[soak] t={samples[-1]['t']:7.1f}s " + "  ".join(
                    f"{h}: rss {v['rss_kb'] / 1024:.1f} MB fds {v['fds']} threads {v['threads']}"
                    for h, v in now.items()), flush=True)
                _sleep_while_running(ranks, args.interval)
        finally:
            for p in ranks:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            daemons.stop_all()
    results, problems = [], []
    for r, p in enumerate(ranks):
        lines = (work / f"rank{r}.out").read_text().strip().splitlines()
        if p.returncode != 0 or not lines:
            problems.append(f"rank {r} exited {p.returncode}: {(work / f'rank{r}.err').read_text()[-1500:]}")
            continue
        results.append(json.loads(lines[-1]))
    mismatches = sum(r["grad_mismatches"] + r["param_mismatches"] for r in results)
    if mismatches:
        problems.append(f"{mismatches} checksum mismatch(es): {results}")
    first = min(len(samples) - 1, max(1, int(args.epoch_seconds // args.interval) + 1))
    growth = _growth(samples, first) if samples else {}
    for h, g in growth.items():
        if g["rss_kb"] > args.rss_mb * 1024 or g["threads"] > args.slack or g["fds"] > args.slack:
            problems.append(f"mccld on {h} grew by {g} (from sample {first} to the last)")
    summary = {"minutes": args.minutes, "seconds": round(time.time() - began, 1), "ranks": results,
               "steps": min((r["steps"] for r in results), default=0),
               "epochs": min((r["epochs"] for r in results), default=0),
               "checksum_mismatches": mismatches, "growth": growth, "samples": samples, "problems": problems}
    text = json.dumps(summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1), flush=True)
    if args.json:
        args.json.write_text(text)
    return 1 if problems else 0


def _sleep_while_running(procs: list[subprocess.Popen], seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until and any(p.poll() is None for p in procs):
        time.sleep(0.2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, stop, epoch = sys.argv[2:6]
        print(json.dumps(rank_main(int(r), int(w), float(stop), float(epoch))), flush=True)
        sys.exit(0)
    sys.exit(main())
