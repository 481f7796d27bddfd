"""The walk of an all-reduce's tensors through libmccl (issue 28): which of our modules one
``dist.all_reduce`` call passes through on the calling thread, from torch's entry into
``ProcessGroupMCCL.allreduce`` until it returns the Work. Two ranks as processes, one on CPU
tensors and one on the fake device (libmccl.devices.fake_device), each after a warm-up call.

    .venv/bin/python -m tools.device_walk                 # prints each walk and its counts
    python -m tools.device_walk --kinds cpu,fake,cuda      # on a machine with a GPU
    .venv/bin/python -m tools.device_walk --all-gather    # an all_gather's walk too

What is counted, per walk (``Walk``):
  stops     runs of calls inside one module, in the order the thread ran them (the path printed);
  entries   calls from a module A into another module B (per B): how often B is entered;
  callers   for each module, the modules that call it;
  up-calls  calls into a module that is already on the call stack below the caller: B calls
            back into A while A's frame is still active, the bouncing issue 28 complains about.
The target (issue 28, deliverable 2; tests/torch/test_device_walk.py holds it): no up-calls; the
backend enters libmccl.devices through one module, at most twice per collective (prepare, then
launch); every other devices module is called from one devices module only (a tree). A
collective with several buffers (--all-gather) builds them on the plan between the two calls:
the same tree, more entries into the plan.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.multiprocessing as mp

N = 5003
OUTSIDE = "<outside>"  # a caller that is none of our modules (torch's dist.all_reduce)


def _module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("libmccl") else None


def _stack(frame: Any) -> list[str]:
    """Our modules on the call stack below ``frame``, innermost first."""
    out = []
    f = frame.f_back
    while f is not None:
        mod = _module(f)
        if mod is not None:
            out.append(mod)
        f = f.f_back
    return out


@dataclass
class Walk:
    path: list[str] = field(default_factory=list)            # the stops
    entries: Counter = field(default_factory=Counter)        # module -> calls into it from another module
    callers: dict[str, set[str]] = field(default_factory=dict)
    up_calls: list[tuple[str, str]] = field(default_factory=list)  # (caller, callee already below it)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (caller, callee) per entry, in order

    def note(self, mod: str) -> None:
        if not self.path or self.path[-1] != mod:
            self.path.append(mod)

    def enter(self, frame: Any, mod: str) -> None:
        below = _stack(frame)
        caller = below[0] if below else OUTSIDE
        if caller == mod:
            return
        self.entries[mod] += 1
        self.callers.setdefault(mod, set()).add(caller)
        self.calls.append((caller, mod))
        if mod in below[1:]:
            self.up_calls.append((caller, mod))

    def counts(self) -> dict[str, int]:
        return {"modules": len(set(self.path)), "stops": len(self.path), "entries": sum(self.entries.values()),
                "up_calls": len(self.up_calls)}

    def entries_from(self, caller: str, package: str) -> Counter:
        """Calls from ``caller`` into each module of ``package``."""
        return Counter(m for c, m in self.calls if c == caller and m.startswith(package + "."))


def walk(fn: Callable[[], Any]) -> Walk:
    """What ``fn()`` runs through of libmccl on this thread."""
    w = Walk()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            mod = _module(frame)
            if mod is not None:
                w.note(mod)
                w.enter(frame, mod)
            return local
        return None

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and frame.f_back is not None:
            mod = _module(frame.f_back)
            if mod is not None:
                w.note(mod)
        return local

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return w


def tree_violations(w: Walk, backend: str = "libmccl.torch.backend", package: str = "libmccl.devices",
                    max_entries: int | None = 2) -> list[str]:
    """How ``w`` misses issue 28's target for the device path (empty: it meets it)."""
    bad = [f"up-call {c} -> {m}" for c, m in w.up_calls]
    into = w.entries_from(backend, package)
    if len(into) > 1:
        bad.append(f"{backend} enters {package} through {len(into)} modules: {dict(into)}")
    if max_entries is not None:
        bad += [f"{backend} enters {m} {n} times (at most {max_entries})" for m, n in into.items() if n > max_entries]
    for mod, callers in sorted(w.callers.items()):
        if mod.startswith(package + ".") and mod not in into:
            if len(callers) > 1 or not all(c.startswith(package + ".") for c in callers):
                bad.append(f"{mod} is called from {sorted(callers)}, not from one {package} module")
    return bad


def report(kind: str, w: Walk, max_entries: int | None = 2) -> str:
    short = lambda m: m.removeprefix("libmccl.")   # noqa: E731
    lines = [f"{kind}: {w.counts()}", "  path: " + " -> ".join(short(m) for m in w.path), "  entries (callers):"]
    for mod, n in w.entries.most_common():
        lines.append(f"    {short(mod):28s} {n:3d}  <- {', '.join(sorted(short(c) for c in w.callers[mod]))}")
    for c, m in w.up_calls:
        lines.append(f"  up-call: {short(c)} -> {short(m)}")
    lines += [f"  off target: {v}" for v in tree_violations(w, max_entries=max_entries)]
    return "\n".join(lines)


KINDS = ("cpu", "fake")
# What is walked: one all-reduce (the target's walk), and an all-gather, a collective whose
# several buffers the backend builds on the plan between prepare and launch (--all-gather).


def _issue(collective: str, t: Any, make: Callable[[], Any]) -> Callable[[], Any]:
    import torch.distributed as dist

    if collective == "all_gather":
        outs = [make() for _ in range(dist.get_world_size())]
        return lambda: dist.all_gather(outs, t, async_op=True)
    return lambda: dist.all_reduce(t, async_op=True)


def _rank(rank: int, world: int, port: int, kinds: tuple[str, ...], collectives: tuple[str, ...],
          out: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("mccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        for kind in kinds:
            dev = None
            try:
                if kind == "fake":
                    from libmccl.devices import device_check

                    dev = device_check.fake_device(seed=rank, unified=False)
                    make = lambda: dev.produce(N, torch.float32, rank)   # noqa: E731
                elif kind == "cuda":  # both ranks on the first GPU, as tools/bench/device_run.sh step 8
                    make = lambda: torch.ones(N, device="cuda")           # noqa: E731
                else:
                    make = lambda: torch.ones(N)                          # noqa: E731
                for collective in collectives:
                    _issue(collective, make(), make)().wait()            # warm: pools, links, lazy imports
                    call = _issue(collective, make(), make)
                    works: list[Any] = []
                    w = walk(lambda: works.append(call()))
                    works[0].wait()
                    if rank == 0:
                        out.send((kind if collective == "all_reduce" else f"{kind} {collective}", w))
            finally:
                if dev is not None:
                    dev.close()
    finally:
        dist.destroy_process_group()


def walks(kinds: tuple[str, ...] = KINDS, collectives: tuple[str, ...] = ("all_reduce",),
          timeout_s: float = 120.0) -> dict[str, Walk]:
    """Rank 0's walk of one call of each collective per kind, two ranks as processes on loopback;
    keyed by the kind for all_reduce, else by "kind collective"."""
    import tempfile

    from mccl_common.daemon_settings import write_key_file
    from tools.bench.init_scale import free_port

    ctx = mp.get_context("spawn")
    got: dict[str, Walk] = {}
    with tempfile.TemporaryDirectory(prefix="mccl-walk-") as keys:
        env = {"MCCL_JOB_KEY_FILE": str(write_key_file(os.path.join(keys, "job.key")))}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        recv, send = ctx.Pipe(duplex=False)
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, kinds, collectives, send), daemon=True)
                 for r in range(2)]
        try:
            for p in procs:
                p.start()
            send.close()  # the ranks hold it now: once both are gone, recv sees the end
            deadline = time.monotonic() + timeout_s
            while len(got) < len(kinds) * len(collectives):
                if not recv.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"[device_walk] no walk from rank 0 within {timeout_s:.0f} s; "
                                       f"got {sorted(got)}")
                try:
                    kind, w = recv.recv()
                except EOFError:
                    for p in procs:
                        p.join(5)
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(f"[device_walk] the ranks exited ({codes}) after {sorted(got)}; "
                                       "their stderr says why") from None
                got[kind] = w
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
                p.close()
            recv.close()
            send.close()
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return got


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="the walk of one all_reduce's tensors through libmccl")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="comma-separated: cpu, fake (the fake device), cuda (needs a GPU; default: %(default)s)")
    ap.add_argument("--all-gather", action="store_true",
                    help="walk an all_gather too (its buffers are built on the plan: more than two entries)")
    opts = ap.parse_args()
    kinds = tuple(k for k in opts.kinds.split(",") if k)
    bad = [k for k in kinds if k not in (*KINDS, "cuda")]
    if bad:
        ap.error(f"unknown kind(s) {bad}; choose from cpu, fake, cuda")
    if "cuda" in kinds:
        import torch

        if not torch.cuda.is_available():
            ap.error("--kinds cuda: torch sees no CUDA device here")
    collectives = ("all_reduce", "all_gather") if opts.all_gather else ("all_reduce",)
    for kind, w in walks(kinds, collectives).items():
        print(report(kind, w, max_entries=None if kind.endswith("all_gather") else 2))


if __name__ == "__main__":
    main()
