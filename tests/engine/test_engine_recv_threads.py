"""The engine's receive threads and reduce-receives (transport/recv_thread.h, landing.h):
exact results with any number of receive threads, element sizes that recv() splits and
messages that arrive before their receive; a peer that dies or stalls while a receive
thread reads its payload; abort mid-receive; no leaked threads; no CPU when idle."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from libmccl import _core
from support.leak_check import pipe_fds
from mccl_common.errors import AbortedError, PeerLostError
from support.engine import DT, SUM, build, file_rendezvous, job_secret, make_options, ptr, ranks, run_ranks, run_threads

pytestmark = pytest.mark.timeout(120)


def allreduce_all(comms, count: int, dtype, late_rank: int = -1) -> list[np.ndarray]:
    early = comms[late_rank].stats()["unexpected_messages"] if late_rank >= 0 else 0

    def body(r, c):
        a = (np.arange(count) % 7 + r).astype(dtype)
        if r == late_rank:
            # Post only once its left neighbour's frames arrived, before the receives exist
            # (a fixed sleep was too short on a loaded box: the neighbour had not sent yet).
            deadline = time.monotonic() + 15
            while c.stats()["unexpected_messages"] == early and time.monotonic() < deadline:
                time.sleep(0.01)
        c.wait(c.allreduce(ptr(a), count, DT[a.dtype], SUM), 30)
        return a
    return run_ranks(comms, body)


@pytest.mark.parametrize("recv_threads", [0, 1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int8])
def test_allreduce_is_exact_with_any_number_of_receive_threads(recv_threads, dtype):
    # Three sockets per peer: stripes of odd sizes. Loopback's 65483-byte MSS makes recv()
    # split 2- and 8-byte elements between reads, so the carry of split elements is used.
    opts = make_options(recv_threads=recv_threads, sockets_per_peer=3)
    with ranks(3, opts=opts) as comms:
        for count in (1, 1000, 100_003, (3 << 20) + 7):
            want = sum((np.arange(count) % 7 + r).astype(dtype) for r in range(3)).astype(dtype)
            for out in allreduce_all(comms, count, dtype):
                assert np.array_equal(out, want), (count, dtype)


@pytest.mark.parametrize("recv_threads", [0, 2])
def test_frames_arriving_before_their_reduce_receive_are_reduced_when_it_is_posted(recv_threads):
    with ranks(3, opts=make_options(recv_threads=recv_threads)) as comms:
        count = (2 << 20) + 3
        before = comms[1].stats()["unexpected_messages"]
        want = sum((np.arange(count) % 7 + r).astype(np.float32) for r in range(3))
        for out in allreduce_all(comms, count, np.float32, late_rank=1):
            assert np.array_equal(out, want)
        assert comms[1].stats()["unexpected_messages"] > before, "nothing arrived early: the test tests nothing"


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _still_running(ours: set[int], timeout_s: float = 5.0) -> set[int]:
    """Which of the threads ``ours`` are still there once they had ``timeout_s`` to end."""
    deadline = time.monotonic() + timeout_s
    while ours & _thread_ids() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ours & _thread_ids()


@pytest.mark.parametrize("recv_threads", [0, 3])
def test_threads_per_communicator_and_none_left_after_shutdown(recv_threads):
    # worker, completion and send thread, plus the receive threads, per communicator. The
    # threads are told apart by id, not counted: an earlier test's threads still exiting
    # meanwhile made every count-based bound flaky (a full run saw a baseline of 57).
    before, pipes_before = _thread_ids(), pipe_fds()
    comms = build(2, opts=make_options(recv_threads=recv_threads))
    ours = _thread_ids() - before
    assert len(ours) >= 2 * (3 + recv_threads), (recv_threads, len(ours))
    allreduce_all(comms, 4 << 20, np.float32)
    run_threads(2, lambda r: comms[r].shutdown(5.0))
    # Still referenced, as a failed job's error frames once kept one in mccld (3 threads and
    # 8 pipe fds per job until a full GC): shutdown alone gives the threads and the helper
    # threads' pipes back; each keeps only its own wake pipe until it is dropped.
    left = _still_running(ours)
    assert not left, f"{len(left)} engine thread(s) outlived shutdown"
    assert pipe_fds() <= pipes_before + 2 * 2, (pipes_before, pipe_fds())


def test_an_idle_communicator_uses_no_cpu():
    with ranks(2) as comms:
        allreduce_all(comms, 8 << 20, np.float32)  # every thread has had work
        time.sleep(0.2)
        t = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - t < 0.05


# ------------------------------------------------------------- ranks as processes

CHILD = r'''
import json, os, sys, time
from pathlib import Path
import numpy as np
from libmccl import _core
from mccl_common.errors import MCCLError
sys.path.insert(0, 'tests')
from support.engine import file_rendezvous, job_secret

rank, world, comm_id, d = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
lst, addrs = file_rendezvous(rank, world, d)
opts = _core.Options()
opts.timeout_s = 30.0
opts.connect_timeout_s = 20.0
opts.wire_security = _core.WireSecurity.aead
comm = _core.Communicator(rank, world, comm_id, lst, addrs, opts, None, secret=job_secret())
bufs = [np.ones(8 << 20, np.float32) for _ in range(3)]
batches, outcome = 0, []
while not outcome:
    # Three ops pending at once: a failure must reach every one of them.
    ids = [comm.allreduce(b.ctypes.data, b.size, int(_core.DType.float32), int(_core.ReduceOp.MAX)) for b in bufs]
    for i in ids:
        try:
            comm.wait(i, 60)
        except MCCLError as e:
            outcome.append({"cls": type(e).__name__, "peer_rank": e.peer_rank, "msg": str(e)})
    if outcome and len(outcome) < len(ids):
        outcome.append({"cls": "completed"})  # part of the batch succeeded
    batches += 1
    if batches == 2:
        (d / f"running.{rank}").write_text("1")
comm.shutdown(2.0)
(d / f"result.{rank}").write_text(json.dumps(outcome))
'''


def _wait_for(tmp: Path, name: str, ranks_, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp / f"{name}.{r}").exists() for r in ranks_):
        assert time.monotonic() < deadline, f"ranks never wrote {name}"
        time.sleep(0.02)


def _spawn(tmp: Path, world: int, ranks_, comm_id: int):
    script = tmp / "child.py"
    script.write_text(CHILD)
    return [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(comm_id), str(tmp)],
                             cwd=Path(__file__).resolve().parents[2]) for r in ranks_]


def _reap(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_peer_killed_mid_receive_fails_every_pending_op_with_peer_lost(tmp_path):
    world, victim = 3, 2
    procs = _spawn(tmp_path, world, range(world), random.getrandbits(63))
    try:
        _wait_for(tmp_path, "running", range(world), 60)
        os.kill(procs[victim].pid, signal.SIGKILL)
        _wait_for(tmp_path, "result", [0, 1], 30)
        for r in (0, 1):
            outcome = json.loads((tmp_path / f"result.{r}").read_text())
            failed = [o for o in outcome if o["cls"] != "completed"]
            assert failed and all(o["cls"] == "PeerLostError" and o["peer_rank"] == victim for o in failed), outcome
    finally:
        _reap(procs)


def test_abort_while_a_receive_thread_waits_for_a_stopped_peer(tmp_path):
    # Rank 0 runs here, rank 1 in a child that is stopped in the middle of its ops, so
    # this rank's receive threads sit on half-read payloads when it aborts.
    procs = _spawn(tmp_path, 2, [1], comm_id := random.getrandbits(63))
    try:
        before = _thread_ids()
        lst, addrs = file_rendezvous(0, 2, tmp_path)
        comm = _core.Communicator(0, 2, comm_id, lst, addrs, make_options(), None, secret=job_secret())
        bufs = [np.ones(8 << 20, np.float32) for _ in range(3)]
        for _ in range(2):
            ids = [comm.allreduce(ptr(b), b.size, DT[b.dtype], int(_core.ReduceOp.MAX)) for b in bufs]
            for i in ids:
                comm.wait(i, 30)
        ids = [comm.allreduce(ptr(b), b.size, DT[b.dtype], int(_core.ReduceOp.MAX)) for b in bufs]
        time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGSTOP)
        time.sleep(0.3)
        started = time.monotonic()
        aborter = threading.Thread(target=comm.abort, args=("abort mid-receive",))
        aborter.start()
        for i in ids:
            try:
                comm.wait(i, 10)
            except AbortedError as e:
                assert "abort mid-receive" in str(e)
        aborter.join(10)
        assert not aborter.is_alive() and time.monotonic() - started < 5
        comm.shutdown(2.0)
        del comm
        assert not _still_running(_thread_ids() - before)
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
        _reap(procs)
