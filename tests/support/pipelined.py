"""The pipelined all-reduce's rank program (tests/daemon/test_daemon_pipelined.py on one host,
tests/e2e/test_daemon_fleet.py across hosts): every finishing path, with random pauses in the
client's copies (``Jittery``)."""

from __future__ import annotations

import ctypes
import random
import time

import numpy as np

from .daemon import AVG, F16, F32, I32, MAX, SUM, connect

PIPE = 16 << 10


# The small-op queue would take most of OPS (all-reduces up to MCCL_DAEMON_FAST_BYTES go there
# first): keep it to the one that must not be pipelined.
PIPE_ENV = {"MCCL_PIPELINE_BYTES": str(PIPE), "MCCL_DAEMON_FAST_BYTES": "4K"}


NP = {F32: np.float32, F16: np.float16, I32: np.int32}


# (count, dtype, op): pipelined (over one piece) and not, odd sizes, every finishing path
OPS = [(1 << 18, F32, SUM), (100_003, F32, AVG), (1000, F32, SUM), (1 << 18, I32, AVG),
       (65_537, F16, MAX), (1 << 18, F32, SUM)]


class Jittery:
    """Stands in for a module's ``ctypes`` / ``_core``: the same calls, after random pauses."""

    def __init__(self, real, names: tuple[str, ...], seed: int):
        self._real, self._names, self._rnd = real, names, random.Random(seed)

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in self._names:
            return fn

        def slow(*args):
            if self._rnd.random() < 0.3:
                time.sleep(self._rnd.random() * 0.003)
            return fn(*args)
        return slow


def _input(rank: int, count: int, dtype: int, i: int) -> np.ndarray:
    return np.random.default_rng(1000 * i + rank).integers(-8, 9, count).astype(NP[dtype])


def _want(count: int, dtype: int, op: int, i: int, world: int) -> np.ndarray:
    parts = [_input(r, count, dtype, i) for r in range(world)]
    if op == MAX:
        return np.maximum.reduce(parts)
    total = np.sum(np.stack(parts).astype(np.float64), axis=0)
    if op == AVG:
        total = total / world if dtype != I32 else np.trunc(total / world)
    return total.astype(NP[dtype])


def rank_pipelined(rank: int, world: int) -> str:
    import libmccl.daemon_client as dc
    dc.ctypes = Jittery(ctypes, ("memmove",), 100 + rank)
    comm, _store = connect(rank, world)
    for rep in range(2):  # the second round runs on tickets already far from zero
        for i, (count, dtype, op) in enumerate(OPS):
            a = _input(rank, count, dtype, i)
            comm.wait(comm.allreduce(a.ctypes.data, count, dtype, op), 30)
            want = _want(count, dtype, op, i, world)
            assert np.array_equal(a, want), (rep, i, np.flatnonzero(a != want)[:5])
    sizes = [c * np.dtype(NP[d]).itemsize for c, d, _ in OPS]
    seg = comm._segment  # the first op sized it for all: one segment, its tickets never reset
    assert seg.ready.value == seg.done.value == 2 * sum(n for n in sizes if n > PIPE), \
        "the tickets did not count exactly the pipelined ops' bytes"
    comm.shutdown(5)
    return "ok"
