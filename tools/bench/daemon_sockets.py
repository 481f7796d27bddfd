"""How many data sockets each daemon holds for a job (issue 26: links on demand through mccld).

Emulates N hosts in this process on loopback, each a daemon's link manager and data-socket
pool (mccld/net/links.py, datalinks.py) with one engine rank, as mccld builds a job's host
communicator. One all-reduce-only job (all-reduce, all-gather, broadcast, barrier), then,
in the same job, an all-to-all; after each, every pool's data sockets are counted:

  eager      every peer host leased at set-up (mccld before on-demand leases)
  on-demand  the engine's set-up hosts only (ondemand.setup_hosts), the rest when first sent to

    python -m tools.bench.daemon_sockets --hosts 8,16 [--json out.json]

Runs anywhere (no root, no shaping); 16 hosts take a few seconds on 2 cores, 32 about 25 s.
Every host of the run is in this one process: N hosts hold ~N^2 control links (two reader
threads each) and, eager, N(N-1)K data sockets plus the engines' dups, so N much above 32
needs a high open-file limit.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import secrets
import statistics
import threading
import time
from typing import Any, Callable

import numpy as np

from libmccl import _core
from mccl_common.errors import MCCLError
from mccld.net.datalinks import DataLinks
from mccld.net.links import LinkManager
from mccld.net.ondemand import setup_hosts

F32, SUM = 0, 0


class PoolHost:
    """One emulated host: a link manager and its data-socket pool on loopback."""

    def __init__(self, host_id: str, key: bytes, k: int, timeout_s: float = 5.0):
        self.links = LinkManager(key, "f", host_id, "127.0.0.1", 0, timeout_s, self.on_message)
        self.data = DataLinks(self.links, k, timeout_s)

    def on_message(self, peer: str, msg: dict[str, Any]) -> None:
        self.data.on_message(peer, msg)

    def __enter__(self) -> "PoolHost":
        self.data.start()
        self.links.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.data.stop()
        self.links.stop()

    def sockets(self) -> int:
        """Data sockets this host holds, idle or leased, to every peer."""
        return sum(p["idle"] + p["leased"] for p in self.data.status())


def run_job(hosts: list, job: str, body: Callable[[int, Any], Any], secret: bytes, k: int,
            eager: bool = False, timeout_s: float = 20.0, budget_s: float = 10.0) -> list:
    """One engine rank per host (objects with ``links`` and ``data``), built as mccld builds a
    job's: set-up hosts leased (every peer if ``eager``), the rest on demand. Runs ``body(rank,
    comm)`` on every host, shuts down and gives the sockets back; returns [(body's result or
    its MCCLError, clean)] by rank."""
    n = len(hosts)
    comm_id = random.getrandbits(63)
    names = [(h.links.host_id, h.links.address) for h in hosts]
    finished = threading.Barrier(n)

    def side(rank: int) -> tuple[Any, bool]:
        me = hosts[rank]
        ranks = [p for p in range(n) if p != rank] if eager else setup_hosts(rank, n)
        leased = me.data.lease(job, [(p, *names[p]) for p in ranks], time.monotonic() + 20, lambda: None)
        opts = _core.Options()
        opts.sockets_per_peer, opts.timeout_s, opts.connect_timeout_s = k, timeout_s, 10.0
        opts.wire_security = _core.WireSecurity.aead
        comm = _core.Communicator(rank, n, comm_id, {p: [s.sock.fileno() for s in socks] for p, socks in leased.items()},
                                  [a for _, a in names], opts, secret=secret,
                                  want=functools.partial(me.data.on_demand.want, job))
        me.data.on_demand.attach(job, comm, rank, names, budget_s)
        try:
            out = body(rank, comm)
        except MCCLError as e:
            out = e.with_traceback(None)     # its frames hold the engine
        finished.wait(60)
        clean = comm.shutdown(5.0)
        me.data.give_back(job, clean)
        return out, clean

    results: list = [None] * n
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, side(r)), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if None in results:
        raise RuntimeError(f"[bench] job {job}: a host did not finish: {results}")
    return results


def measure(n: int, eager: bool, k: int) -> dict[str, Any]:
    key, secret = secrets.token_bytes(32), secrets.token_bytes(32)
    hosts = [PoolHost(f"h{i:03d}", key, k) for i in range(n)]
    for h in hosts:
        h.__enter__()
    counts: dict[str, list[int]] = {"allreduce": [0] * n, "alltoall": [0] * n}
    phase = threading.Barrier(n)

    def body(rank: int, comm: Any) -> None:
        a = np.full(1 << 18, rank + 1, dtype=np.float32)
        comm.wait(comm.allreduce(a.ctypes.data, a.size, F32, SUM), 30)
        out = np.zeros(n * 4, dtype=np.int32)
        comm.wait(comm.allgather(np.full(4, rank, np.int32).ctypes.data, out.ctypes.data, 16), 30)
        comm.wait(comm.broadcast(a.ctypes.data, a.nbytes, 0), 30)
        comm.wait(comm.barrier(), 30)
        phase.wait(60)
        counts["allreduce"][rank] = hosts[rank].sockets()
        send, recv = np.arange(n * 4, dtype=np.int32), np.zeros(n * 4, dtype=np.int32)
        comm.wait(comm.alltoall(send.ctypes.data, recv.ctypes.data, 16), 30)
        phase.wait(60)
        counts["alltoall"][rank] = hosts[rank].sockets()

    started = time.monotonic()
    try:
        out = run_job(hosts, "bench", body, secret, k, eager=eager)
    finally:
        for h in hosts:
            h.__exit__(None, None, None)
    errors = [o for o, _ in out if o is not None]
    if errors:
        raise errors[0]
    row = {"hosts": n, "mode": "eager" if eager else "on-demand", "k": k, "seconds": round(time.monotonic() - started, 2)}
    for phase_name, c in counts.items():
        row[phase_name] = {"min": min(c), "max": max(c), "mean": round(statistics.mean(c), 2)}
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="8,16", help="host counts, comma-separated")
    ap.add_argument("--sockets-per-peer", type=int, default=2)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    rows = [measure(n, eager, args.sockets_per_peer) for n in map(int, args.hosts.split(",")) for eager in (True, False)]
    print(f"data sockets per daemon, K={args.sockets_per_peer} (min / mean / max over hosts)")
    print(f"{'hosts':>5}  {'mode':<9}  {'after all-reduce-only ops':>26}  {'after an all-to-all':>22}  seconds")
    for r in rows:
        ar, aa = r["allreduce"], r["alltoall"]
        print(f"{r['hosts']:>5}  {r['mode']:<9}  {ar['min']:>8} / {ar['mean']:>6} / {ar['max']:>6}  "
              f"{aa['min']:>6} / {aa['mean']:>6} / {aa['max']:>6}  {r['seconds']:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
