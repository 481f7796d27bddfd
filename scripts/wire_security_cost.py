"""What sealing the engine's frames (MCCL_WIRE_SECURITY) costs: CPU per byte, and what that
means for a link at line rate.

    python scripts/wire_security_cost.py [--rate-gbit 10] [--mb 64] [--json out.json]

Two measurements, both of the engine's own code:
  1. one core sealing and opening 64 KiB records (integrity/aead.h's RecordCipher, the
     header as associated data, over a buffer larger than the caches): GB/s per core for
     aead (AES-256-GCM) and mac (GMAC), and the cores a rank needs at --rate-gbit, since it
     seals what it sends and opens what it receives;
  2. two ranks (threads of this process, on loopback sockets, as mccld hands the engine
     its sockets) all-reducing --mb MB in off, mac and aead modes: the process's CPU
     seconds (user + system) per GB that crossed the link, the whole path included
     (sendmsg/recv, staging, reductions, the crypto on the send and receive threads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import sys
import threading
import time

import numpy as np

from libmccl import _core

W = _core.WireSecurity
MODES = {"aead": W.aead, "mac": W.mac, "off": W.off}


def per_core() -> dict:
    out = {}
    for name in ("aead", "mac"):
        seal = 1 / _core.record_seconds_per_byte(MODES[name], False, 256 << 20, 5)
        opn = 1 / _core.record_seconds_per_byte(MODES[name], True, 256 << 20, 5)
        out[name] = {"seal_gb_per_s": seal / 1e9, "open_gb_per_s": opn / 1e9,
                     "cpu_s_per_wire_gb": 1e9 / seal + 1e9 / opn}
    return out


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def engine_run(mode: str, mb: int, reps: int, k: int = 2) -> dict:
    socks = [_pair() for _ in range(k)]
    # The keyed handshake derives each socket's keys from this secret (None: bare frames).
    secret = os.urandom(32) if mode != "off" else None
    opts = _core.Options()
    opts.sockets_per_peer = k
    opts.wire_security = MODES[mode]
    opts.connect_timeout_s = opts.timeout_s = 60.0
    cid = random.getrandbits(63)
    comms: list = [None, None]

    def make(r):
        fds = {1 - r: [p[r].fileno() for p in socks]}
        comms[r] = _core.Communicator(r, 2, cid, fds, ["127.0.0.1:1", "127.0.0.1:2"], opts, None, secret=secret)
    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    count = (mb << 20) // 4
    bufs = [np.ones(count, dtype=np.float32) for _ in range(2)]

    def ops(r):
        for _ in range(reps):
            comms[r].wait(comms[r].allreduce(bufs[r].ctypes.data, count, int(_core.DType.float32),
                                             int(_core.ReduceOp.SUM)), 120)
    ops_threads = [threading.Thread(target=ops, args=(r,)) for r in range(2)]
    [t.start() for t in ops_threads]   # one warm-up round inside: the first op is timed too
    c0, t0 = _cpu(), time.perf_counter()
    [t.join() for t in ops_threads]
    cpu, wall = _cpu() - c0, time.perf_counter() - t0
    threads = [threading.Thread(target=lambda r=r: comms[r].shutdown(5.0)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for a, b in socks:
        a.close()
        b.close()
    wire = 2 * reps * (mb << 20)  # a 2-rank all-reduce moves its size each way
    return {"cpu_s_per_wire_gb": cpu / (wire / 1e9), "wall_s": wall, "wire_gb": wire / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    need = 2 * args.rate_gbit * 1e9 / 8   # bytes a rank seals and opens per second at line rate
    cores = per_core()
    for name, row in cores.items():
        row["cores_per_rank_at_rate"] = need / 1e9 * row["cpu_s_per_wire_gb"] / 2
        print(f"{name}: one core seals {row['seal_gb_per_s']:.2f} GB/s, opens {row['open_gb_per_s']:.2f} GB/s; "
              f"at {args.rate_gbit:g} Gbit/s each way a rank needs {row['cores_per_rank_at_rate']:.2f} cores for it")
    runs = {}
    for name in ("off", "mac", "aead", "off", "mac", "aead"):   # interleaved: the machine's load drifts
        r = engine_run(name, args.mb, args.reps)
        runs.setdefault(name, []).append(r)
        print(f"engine, 2 ranks, {args.mb} MB all-reduce x{args.reps}, {name:4s}: "
              f"{r['cpu_s_per_wire_gb']:.3f} CPU s per wire GB ({r['wall_s']:.1f} s wall)")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate_gbit": args.rate_gbit, "cpus": os.cpu_count(), "per_core": cores, "engine": runs},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
