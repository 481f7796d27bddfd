"""Set-up time of an 8-rank engine job with and without a flood of idle connections on every
rank's listener (issue 34), alternating rounds in one run.

The attacker holds FLOOD idle connections to each listening port, from SOURCES source
addresses (127.0.0.2 ... on Linux's loopback, which routes all of 127/8), and keeps them
topped up: whenever a rank closes one (to make room, or at its hello deadline) it dials
again. It starts before the first rank builds and goes on through the job, so links opened
on demand mid-job (every rank sending to every other) meet it too. Ranks are threads of
this process; the ranks dial from 127.0.0.1.

    .venv/bin/python -m tools.flood_setup [--rounds 5] [--ranks 8] [--flood 200] [--sources 8]
    .venv/bin/python -m tools.flood_setup --sources 0      # the attacker on the ranks' own address

Prints one line per round and the medians. Not a test: timings are wall clock.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import statistics
import threading
import time

import numpy as np

from libmccl import _core


class Flood:
    """`per_port` idle connections to each (address, port) target, spread over the source
    addresses `ips` (None: the host's own), topped up every 20 ms until stop()."""

    def __init__(self, targets: list[tuple[str, int]], per_port: int, ips: list[str] | None) -> None:
        self.targets, self.per_port = targets, per_port
        self.ips = ips
        self.held: dict[tuple[str, int], list[socket.socket]] = {t: [] for t in targets}
        self.dials = 0
        self.closed_by_rank = 0
        self._stop = threading.Event()
        self._top_up()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _dial(self, target: tuple[str, int], i: int) -> socket.socket | None:
        s = socket.socket()
        try:
            if self.ips:
                s.bind((self.ips[i % len(self.ips)], 0))
            s.setblocking(False)
            s.connect_ex(target)
            self.dials += 1
            return s
        except OSError:
            s.close()
            return None

    def _top_up(self) -> None:
        for target, socks in self.held.items():
            alive = []
            for s in socks:
                try:
                    gone = s.recv(1) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    self.closed_by_rank += 1
                    s.close()
                else:
                    alive.append(s)
            i = len(alive)
            while len(alive) < self.per_port:
                s = self._dial(target, i)
                i += 1
                if s is not None:
                    alive.append(s)
            self.held[target] = alive

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._top_up()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for socks in self.held.values():
            for s in socks:
                s.close()


def job(c, r: int, n: int) -> None:  # noqa: ANN001 - an engine Communicator
    """An all-reduce, then every pair: the links not built at set-up are opened now."""
    x = np.full(1 << 16, float(r + 1), np.float32)
    c.wait(c.allreduce(x.ctypes.data, x.size, int(_core.DType.float32), int(_core.ReduceOp.SUM)), 60)
    assert x[0] == n * (n + 1) / 2
    outs = {q: np.full(256, r, np.int32) for q in range(n) if q != r}
    ins = {q: np.zeros(256, np.int32) for q in range(n) if q != r}
    ids = [c.send(outs[q].ctypes.data, outs[q].nbytes, q, 1) for q in outs]
    ids += [c.recv(ins[q].ctypes.data, ins[q].nbytes, q, 1) for q in ins]
    for i in ids:
        c.wait(i, 60)
    assert all((ins[q] == q).all() for q in ins)


def one_round(n: int, flood_per_port: int, sources: int, secret: bytes) -> dict:
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(n)]
    addrs = [x.address for x in listeners]
    opts = _core.Options()
    opts.timeout_s, opts.connect_timeout_s = 60.0, 30.0
    opts.wire_security = _core.WireSecurity.aead
    # sources=0: from the ranks' own address, where no cap per host can tell them apart.
    ips = [f"127.0.0.{2 + i}" for i in range(sources)] if sources else ["127.0.0.1"]
    flood = Flood([("127.0.0.1", int(a.rpartition(":")[2])) for a in addrs], flood_per_port, ips) \
        if flood_per_port else None
    cid = random.getrandbits(63)
    comms: list = [None] * n
    errors: list = []

    def make(r: int) -> None:
        try:
            comms[r] = _core.Communicator(r, n, cid, listeners[r], addrs, opts, secret=secret)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        t0 = time.monotonic()
        threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        setup_s = time.monotonic() - t0
        if errors:
            raise errors[0]

        t1 = time.monotonic()
        job_errors: list = []

        def guarded(r: int) -> None:
            try:
                job(comms[r], r, n)
            except Exception as e:  # noqa: BLE001
                job_errors.append(e)
        threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        job_s = time.monotonic() - t1
        if job_errors:
            raise job_errors[0]
        return {"setup_s": setup_s, "job_s": job_s,
                "flood_dials": flood.dials if flood else 0,
                "closed_by_ranks": flood.closed_by_rank if flood else 0}
    finally:
        for c in comms:
            if c is not None:
                c.shutdown(5.0)
        if flood:
            flood.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--flood", type=int, default=200, help="idle connections held per listening port")
    ap.add_argument("--sources", type=int, default=8,
                    help="attacker source addresses (0: the ranks' own, 127.0.0.1)")
    args = ap.parse_args()
    # Each rank logs the first drop per attacker address at WARNING: not what is measured here.
    logging.getLogger("libmccl.engine").setLevel(logging.ERROR)
    secret = os.urandom(32)
    got: dict[str, list[dict]] = {"none": [], "flood": []}
    for i in range(args.rounds):
        for kind in ("none", "flood"):
            r = one_round(args.ranks, args.flood if kind == "flood" else 0, args.sources, secret)
            got[kind].append(r)
            print(f"round {i} {kind:5s} set-up {r['setup_s']:.3f} s  job (all-reduce + every pair) "
                  f"{r['job_s']:.3f} s  attacker dials {r['flood_dials']}  closed by the ranks "
                  f"{r['closed_by_ranks']}", flush=True)
    for kind, rs in got.items():
        print(f"median {kind:5s} set-up {statistics.median(x['setup_s'] for x in rs):.3f} s  "
              f"job {statistics.median(x['job_s'] for x in rs):.3f} s")
    grow = statistics.median(x["setup_s"] for x in got["flood"]) - statistics.median(x["setup_s"] for x in got["none"])
    where = f"{args.sources} addresses" if args.sources else "the ranks' own address"
    print(f"set-up time grows by {grow:+.3f} s under a flood of {args.flood} connections per port "
          f"from {where} ({args.ranks} ranks)")


if __name__ == "__main__":
    main()
