"""All-reduce time per algorithm beside the cost model's prediction, ranks as threads of one
process on loopback, bare frames (indicative only: the ranks share this machine's cores).

    python -m tools.bench.algo_table --ranks 8,16 --sizes 8,1K,64K,1M,16M

For each world size one communicator per algorithm (MCCL_ALGO pinned) plus one with the
automatic choice; each size runs ``--reps`` times back to back after a warm-up, and the
median per-op time of rank 0 is printed with the model's prediction from the parameters
the auto communicator measured and agreed at start, and which algorithm auto took.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from libmccl import _core

from .metrics import parse_bytes

ALGOS = ["oneround", "rd", "rabenseifner", "ring"]


def _build(n: int, spec: str) -> list:
    opts = _core.Options()
    opts.algo = spec
    opts.timeout_s = 120.0
    opts.connect_timeout_s = 60.0
    opts.sockets_per_peer = 1
    # Bare frames: the table compares algorithms, not the cost of sealing them.
    opts.wire_security = _core.WireSecurity.off
    secret = None
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(n)]
    addrs = [x.address for x in listeners]
    cid = random.getrandbits(63)
    return _threads(n, lambda r: _core.Communicator(r, n, cid, listeners[r], addrs, opts, secret=secret))


def _threads(n: int, fn) -> list:
    import threading
    out: list = [None] * n
    err: list = []

    def body(i):
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)
    ts = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if err:
        raise err[0]
    return out


def _time_allreduce(comms: list, nbytes: int, reps: int) -> tuple[float, str]:
    count = max(nbytes // 4, 1)
    bufs = [np.ones(count, np.float32) for _ in comms]
    dt, op = int(_core.DType.float32), int(_core.ReduceOp.SUM)

    def body(r):
        c = comms[r]
        c.wait(c.allreduce(bufs[r].ctypes.data, count, dt, op), 120)  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            c.wait(c.allreduce(bufs[r].ctypes.data, count, dt, op), 120)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), c.last_algorithm("allreduce")
    return _threads(len(comms), body)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--sizes", default="8,1K,64K,1M,16M")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    for n in [int(x) for x in a.ranks.split(",")]:
        auto = _build(n, "auto")
        cost = auto[0].cost_params()
        print(f"\n### N={n}: alpha {cost['alpha_s'] * 1e6:.1f} us, beta {1e-9 / cost['beta_s_per_byte']:.2f} GB/s, "
              f"gamma {1e-9 / max(cost['gamma_s_per_byte'], 1e-30):.2f} GB/s (agreed at start)\n")
        print("| bytes | " + " | ".join(f"{x} ms (model)" for x in ALGOS) + " | auto took | auto ms |")
        print("|---" * (len(ALGOS) + 3) + "|")
        pinned = {x: _build(n, f"allreduce={x}") for x in ALGOS}
        try:
            for size in [parse_bytes(s) for s in a.sizes.split(",")]:
                reps = a.reps if size <= (1 << 20) else max(3, a.reps // 3)
                cells = []
                for x in ALGOS:
                    if x == "oneround" and size * n > (64 << 20):
                        cells.append("-")  # N copies of the buffer per rank: beyond this box's memory
                        continue
                    t, _ = _time_allreduce(pinned[x], size, reps)
                    p = _core.predict("allreduce", x, n, size, cost["alpha_s"], cost["beta_s_per_byte"],
                                      cost["gamma_s_per_byte"])
                    cells.append(f"{t * 1e3:.3f} ({p * 1e3:.3f})")
                t, took = _time_allreduce(auto, size, reps)
                print(f"| {size} | " + " | ".join(cells) + f" | {took} | {t * 1e3:.3f} |", flush=True)
        finally:
            for comms in [auto, *pinned.values()]:
                _threads(n, lambda r, cs=comms: cs[r].shutdown(10.0))


if __name__ == "__main__":
    main()
