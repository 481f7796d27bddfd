"""Helpers for the engine tests: ranks as threads of this process (no torch).

``ranks(n)`` builds n communicators over loopback in parallel threads and tears them
down afterwards; ``run_ranks(comms, fn)`` runs ``fn(rank, comm)`` on every rank in its
own thread and re-raises the first failure. Buffers are numpy arrays, passed to the
engine as ``arr.ctypes.data``.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading

import numpy as np

from libmccl import _core
from mccl_common import jobkey

DT = {
    np.dtype(np.float32): int(_core.DType.float32),
    np.dtype(np.float64): int(_core.DType.float64),
    np.dtype(np.float16): int(_core.DType.float16),
    np.dtype(np.int8): int(_core.DType.int8),
    np.dtype(np.uint8): int(_core.DType.uint8),
    np.dtype(np.int32): int(_core.DType.int32),
    np.dtype(np.int64): int(_core.DType.int64),
    np.dtype(np.bool_): int(_core.DType.bool),
}
SUM, AVG, MIN, MAX, PRODUCT = (int(getattr(_core.ReduceOp, n)) for n in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"))


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def make_options(timeout_s: float = 30.0, **kw) -> "_core.Options":
    """Engine options as the backend builds them: MCCL_WIRE_SECURITY's default (aead) unless
    ``wire_security`` says otherwise, so every test's links prove the job key."""
    o = _core.Options()
    o.timeout_s = timeout_s
    o.connect_timeout_s = kw.pop("connect_timeout_s", 20.0)
    o.wire_security = _core.WireSecurity.aead
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def job_secret(opts: "_core.Options | None" = None) -> bytes | None:
    """The engine secret the ranks of this test process share (tests/support/jobkey.py's key,
    derived as libmccl/torch/backend.py does); None for options with MCCL_WIRE_SECURITY=off."""
    mode = "aead" if opts is None else opts.wire_security.name
    return jobkey.engine_secret(mode)


def run_threads(n: int, fn, timeout: float = 60.0) -> list:
    """Runs fn(i) for i in range(n) in threads; returns results, raises the first error."""
    results: list = [None] * n
    errors: list = [None] * n

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    for e in errors:
        if e is not None:
            raise e
    return results


def build(n: int, opts=None, comm_ids=None, on_complete=None):
    opts = opts or make_options()
    comm_id = random.getrandbits(64)
    ids = comm_ids or [comm_id] * n
    listeners = [_core.Listener("127.0.0.1", 0) for _ in range(n)]
    addrs = [lst.address for lst in listeners]
    cbs = on_complete or [None] * n
    secret = job_secret(opts)
    return run_threads(n, lambda r: _core.Communicator(r, n, ids[r], listeners[r], addrs, opts, cbs[r],
                                                       secret=secret))


@contextlib.contextmanager
def ranks(n: int, **kw):
    comms = build(n, **kw)
    try:
        yield comms
    finally:
        run_threads(n, lambda r: comms[r].shutdown(5.0))


def run_ranks(comms, fn, timeout: float = 60.0) -> list:
    return run_threads(len(comms), lambda r: fn(r, comms[r]), timeout)


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def file_rendezvous(rank: int, world: int, d, timeout: float = 20.0):
    """For ranks in separate processes: publish this rank's listener address as a file in
    directory ``d`` and wait for everyone's; returns (listener, addresses)."""
    import time
    from pathlib import Path

    d = Path(d)
    lst = _core.Listener("127.0.0.1", 0)
    (d / f"addr.{rank}.tmp").write_text(lst.address)
    os.rename(d / f"addr.{rank}.tmp", d / f"addr.{rank}")
    deadline = time.monotonic() + timeout
    while not all((d / f"addr.{r}").exists() for r in range(world)):
        assert time.monotonic() < deadline, "peers never published their addresses"
        time.sleep(0.01)
    return lst, [(d / f"addr.{r}").read_text() for r in range(world)]
