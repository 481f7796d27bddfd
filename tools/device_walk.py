"""The walk of an all-reduce's tensors through libmccl (issue 28): which of our modules one
``dist.all_reduce`` call passes through on the calling thread, in order, from torch's entry into
``ProcessGroupMCCL.allreduce`` until it returns the Work. Two ranks as processes, one on CPU
tensors and one on the fake device (libmccl.devices.fake_device), each after a warm-up call.

    .venv/bin/python -m tools.device_walk            # prints each walk and its counts

A stop is a run of calls inside one module; a return is a stop in a module the walk had
already left. The target (issue 28, deliverable 2) is no returns.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch.multiprocessing as mp

N = 5003


def _module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("libmccl") else None


def walk(fn: Any) -> list[str]:
    """The libmccl modules ``fn()`` runs through on this thread, consecutive repeats merged."""
    seq: list[str] = []

    def note(mod: str | None) -> None:
        if mod is not None and (not seq or seq[-1] != mod):
            seq.append(mod)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            note(_module(frame))
            return local
        return None

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and frame.f_back is not None:
            note(_module(frame.f_back))
        return local

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seq


def counts(seq: list[str]) -> dict[str, int]:
    seen: set[str] = set()
    returns = 0
    for mod in seq:
        returns += mod in seen
        seen.add(mod)
    return {"modules": len(seen), "stops": len(seq), "returns": returns}


def _rank(rank: int, world: int, port: int, kind: str, out: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    dev = None
    try:
        if kind == "fake":
            from libmccl.devices import device_check

            dev = device_check.fake_device(seed=rank, unified=False)
            make = lambda: dev.produce(N, torch.float32, rank)   # noqa: E731
        else:
            make = lambda: torch.ones(N)                          # noqa: E731
        dist.all_reduce(make(), async_op=True).wait()            # warm: pools, links, lazy imports
        t = make()
        works: list[Any] = []
        seq = walk(lambda: works.append(dist.all_reduce(t, async_op=True)))
        works[0].wait()
        if rank == 0:
            out.put((kind, seq))
    finally:
        if dev is not None:
            dev.close()
        dist.destroy_process_group()


def main() -> None:
    import tempfile

    from mccl_common.daemon_settings import write_key_file
    from tools.bench.init_scale import free_port

    ctx = mp.get_context("spawn")
    keys = tempfile.TemporaryDirectory(prefix="mccl-walk-")
    os.environ["MCCL_JOB_KEY_FILE"] = str(write_key_file(os.path.join(keys.name, "job.key")))
    for kind in ("cpu", "fake"):
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, kind, out), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            got, seq = out.get(timeout=120)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        short = [m.removeprefix("libmccl.") for m in seq]
        print(f"{got}: {counts(seq)}\n  " + " -> ".join(short))
    keys.cleanup()


if __name__ == "__main__":
    main()
