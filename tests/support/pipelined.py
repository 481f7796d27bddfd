"""The pipelined all-reduce's rank program (tests/daemon/test_daemon_pipelined.py on one host,
tests/e2e/test_daemon_fleet.py across hosts): every finishing path, with random pauses in the
client's copies (``Jittery``); the in-process mccld with a tiny pipeline and random pauses in
its own stages (``jittery_daemon``), and the check that a rank killed mid-op is reported and
its memory freed (``check_killed_rank``)."""

from __future__ import annotations

import ctypes
import random
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mccl_common.daemon_settings import load_config
from mccl_common.settings import EngineConfig, load

from .daemon import AVG, F16, F32, I32, MAX, SUM, connect, daemon_env, segments_left
from .ranks import collect, reap, spawn_ranks

PIPE = 16 << 10


# The small-op queue would take most of OPS (all-reduces up to MCCL_DAEMON_FAST_BYTES go there
# first): keep it to the one that must not be pipelined. The copy-in's lead is cut to five
# pieces (320K of a 1 MB op), so the clients pace their copies.
PIPE_ENV = {"MCCL_PIPELINE_BYTES": str(PIPE), "MCCL_DAEMON_FAST_BYTES": "4K",
            "MCCL_DAEMON_COPY_AHEAD_BYTES": "64K"}


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


def rank_input(rank: int, count: int, dtype: int, i: int) -> np.ndarray:
    return np.random.default_rng(1000 * i + rank).integers(-8, 9, count).astype(NP[dtype])


def expected(count: int, dtype: int, op: int, i: int, world: int) -> np.ndarray:
    parts = [rank_input(r, count, dtype, i) for r in range(world)]
    if op == MAX:
        return np.maximum.reduce(parts)
    total = np.sum(np.stack(parts).astype(np.float64), axis=0)
    if op == AVG:
        total = total / world if dtype != I32 else np.trunc(total / world)
    return total.astype(NP[dtype])


class LeadWatch:
    """Samples how far the client's input (``ready``) runs ahead of the results (``done``)."""

    def __init__(self, comm):
        self._comm, self.max_gap, self.samples_in_flight = comm, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            seg = self._comm._segment
            if seg is not None:
                done = seg.done.value
                gap = seg.ready.value - done  # ready read second: never under the true gap
                if gap > 0:
                    self.samples_in_flight += 1
                    self.max_gap = max(self.max_gap, gap)
            time.sleep(0.0002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def rank_pipelined(rank: int, world: int) -> str:
    import libmccl.daemon.submit as dc  # where the copies are
    dc.ctypes = Jittery(ctypes, ("memmove",), 100 + rank)
    comm, _store = connect(rank, world)
    watch = LeadWatch(comm)
    for rep in range(2):  # the second round runs on tickets already far from zero
        for i, (count, dtype, op) in enumerate(OPS):
            a = rank_input(rank, count, dtype, i)
            comm.wait(comm.allreduce(a.ctypes.data, count, dtype, op), 30)
            want = expected(count, dtype, op, i, world)
            assert np.array_equal(a, want), (rep, i, np.flatnonzero(a != want)[:5])
    watch.stop()
    # The copy-in stayed within its lead of the results (plus the piece being copied), and
    # the 1 MB ops were paced: their input did not all go in at once.
    lead = comm._copy_lead({"count": 1 << 18, "dtype": F32}, 1 << 20)
    assert lead < 1 << 20, lead
    assert watch.samples_in_flight > 0, "the watcher never saw an op in flight"
    assert watch.max_gap <= lead + PIPE, (watch.max_gap, lead)
    sizes = [c * np.dtype(NP[d]).itemsize for c, d, _ in OPS]
    seg = comm._segment  # the first op sized it for all: one segment, its tickets never reset
    assert seg.ready.value == seg.done.value == 2 * sum(n for n in sizes if n > PIPE), \
        "the tickets did not count exactly the pipelined ops' bytes"
    comm.shutdown(5)
    return "ok"


@pytest.fixture
def jittery_daemon(monkeypatch):
    """An mccld in this process with PIPE_ENV's tiny pipeline and random pauses in its
    reductions and copies: (daemon, the ranks' env)."""
    import mccld.jobs.pipelined as pipelined
    from mccld.daemon import Daemon
    monkeypatch.setattr(pipelined, "ctypes", Jittery(ctypes, ("memmove",), 1))
    monkeypatch.setattr(pipelined, "_core", Jittery(pipelined._core, ("reduce_inplace", "finalize_avg"), 2))
    rdir = Path(tempfile.mkdtemp(prefix="mccl-ptest-"))
    env = daemon_env(rdir)
    d = Daemon(load_config(env=env), load(EngineConfig, env=PIPE_ENV)).start()
    try:
        yield d, {**env, **PIPE_ENV}
    finally:
        d.stop()
        for p in rdir.iterdir():
            p.unlink()
        rdir.rmdir()


def check_killed_rank(fn, comm_id: int, env: dict) -> None:
    """Three ranks run ``fn``, in which rank 1 kills itself mid-op: the other two must return
    (their PeerLostError, "after <s>s") within the pid check's time, not a timeout, and every
    segment of the job must be gone soon after."""
    procs, results, _ = spawn_ranks(fn, 3, env=env)
    try:
        out = collect(procs, results, 60, expect=2)
    finally:
        reap(procs)
    for r in (0, 2):
        status, value = out[r]
        assert status == "ok", value
        assert float(value.split()[-1][:-1]) < 5.0, value  # the pid check, not a timeout
    assert segments_left(comm_id) == []
