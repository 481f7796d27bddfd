"""Memory bandwidth of the machine, and a memory hog to put beside a benchmark.

    python -m tools.bench.membw scale --procs 1,2,4,8,16 --mb 256 --seconds 3 [--json F]
    python -m tools.bench.membw hog --procs K --mb 256 [--nice 19] [--json F] -- CMD...

Why: at 8 emulated hosts the daemon path (which adds two copies of the whole buffer per op
and host, tensor -> shared memory -> tensor) falls behind in-process while cores sit idle.
If the machine's memory bandwidth were the binding resource, (a) ``scale`` shows how much
copy bandwidth P processes get together, and (b) ``hog`` takes some of it away from CMD
(with cores that CMD leaves idle: niced) to see whether CMD's busbw drops.

Every process copies a private array into another with np.copyto. GB/s counts the bytes
copied (10^9 bytes/s); the memory traffic is twice that (each byte read once, written once).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np

_CTX = mp.get_context("fork")


def _copier(i: int, mb: int, start, stop, done, seconds: float, nice: int) -> None:
    """Copy mb MB back and forth until `stop` is set or `seconds` pass after `start`;
    done[2i], done[2i+1] = bytes copied, seconds spent, updated after every copy."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if nice:
        os.nice(nice)
    n = mb << 20
    a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)   # pages touched before timing
    np.copyto(b, a)
    start.wait(60)
    t0 = time.perf_counter()
    copied = 0
    while not stop.is_set() and os.getppid() == parent:   # an orphan stops too
        np.copyto(b, a)
        a, b = b, a
        copied += n
        t = time.perf_counter() - t0
        done[2 * i], done[2 * i + 1] = copied, t
        if seconds and t >= seconds:
            break


def _start(procs: int, mb: int, seconds: float, nice: int):
    start, stop = _CTX.Barrier(procs + 1), _CTX.Event()
    done = _CTX.Array("d", 2 * procs, lock=False)
    ps = [_CTX.Process(target=_copier, args=(i, mb, start, stop, done, seconds, nice), daemon=True)
          for i in range(procs)]
    for p in ps:
        p.start()
    start.wait(60)        # every copier has its pages: timing starts now
    return ps, stop, done, time.perf_counter()


def _finish(ps, stop, done, t0: float) -> dict:
    stop.set()
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    wall = time.perf_counter() - t0
    per = [done[2 * i] / done[2 * i + 1] / 1e9 if done[2 * i + 1] else 0.0 for i in range(len(ps))]
    total = sum(done[2 * i] for i in range(len(ps)))
    span = max([done[2 * i + 1] for i in range(len(ps))] + [1e-9])  # first copy started .. last ended
    return {"procs": len(ps), "wall_s": round(wall, 3), "copied_gb": round(total / 1e9, 3),
            "aggregate_copy_gbs": round(total / span / 1e9, 3),
            "per_proc_copy_gbs": [round(x, 3) for x in per],
            "mean_per_proc_copy_gbs": round(sum(per) / len(per), 3) if per else 0.0}


def scale(a) -> int:
    rows = []
    print(f"# membw scale: {a.mb} MB np.copyto per process, {a.seconds:g} s each, {os.cpu_count()} CPUs; "
          "GB/s = bytes copied (memory traffic read+write = 2x)")
    print(f"{'procs':>6} {'aggregate GB/s':>15} {'per-proc GB/s':>14} {'min':>7} {'max':>7}")
    for p in [int(x) for x in a.procs.split(",")]:
        ps, stop, done, t0 = _start(p, a.mb, a.seconds, 0)
        for q in ps:
            q.join(a.seconds + 10)
        r = _finish(ps, stop, done, t0)
        rows.append(r)
        print(f"{p:>6} {r['aggregate_copy_gbs']:>15.2f} {r['mean_per_proc_copy_gbs']:>14.2f} "
              f"{min(r['per_proc_copy_gbs']):>7.2f} {max(r['per_proc_copy_gbs']):>7.2f}", flush=True)
        if a.json:
            _dump(a.json, {"mb": a.mb, "seconds": a.seconds, "cpus": os.cpu_count(),
                           "unit": "GB/s of bytes copied (traffic = 2x)", "rows": rows})
    return 0


def hog(a) -> int:
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        sys.exit("membw hog: no command after --")
    ps, stop, done, t0 = _start(a.procs, a.mb, 0, a.nice)
    child = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    got = []

    def forward(sig, _frame):        # SIGTERM (timeout) / SIGINT: pass on, then clean up below
        got.append(sig)
        if child.poll() is None:
            child.send_signal(sig)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        rc = child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        r = _finish(ps, stop, done, t0)
    r.update({"mb": a.mb, "nice": a.nice, "cmd_rc": rc, "signals": got,
              "unit": "GB/s of bytes copied (traffic = 2x)"})
    print(f"# membw hog: {a.procs} copier(s) of {a.mb} MB at nice {a.nice} beside the command for "
          f"{r['wall_s']:.1f} s: {r['aggregate_copy_gbs']:.2f} GB/s copied in all "
          f"({r['mean_per_proc_copy_gbs']:.2f} per copier; traffic 2x), command rc={rc}", flush=True)
    if a.json:
        _dump(a.json, r)
    return rc if rc >= 0 else 128 - rc


def _die_with_parent() -> None:
    """In CMD before exec: SIGTERM when this process dies (even by SIGKILL)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _dump(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.membw", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("scale", help="aggregate copy bandwidth of 1..N processes")
    s.add_argument("--procs", default="1,2,4,8,16")
    s.add_argument("--seconds", type=float, default=3.0)
    h = sub.add_parser("hog", help="copy in the background while CMD runs")
    h.add_argument("--procs", type=int, default=4)
    h.add_argument("--nice", type=int, default=19, help="copiers' niceness: take only idle cores (default 19)")
    h.add_argument("cmd", nargs=argparse.REMAINDER)
    for p in (s, h):
        p.add_argument("--mb", type=int, default=256)
        p.add_argument("--json")
    a = ap.parse_args(argv)
    return scale(a) if a.verb == "scale" else hog(a)


if __name__ == "__main__":
    sys.exit(main())
