"""A rank's teardown when mccld dies under it: the rank exits cleanly (no signal death),
its failed ops' callbacks run to their end, and its shared-memory segment is gone.

The process that raised DaemonUnavailableError usually exits right away, while its
I/O thread is still failing the other pending ops (running torch future callbacks).
An interpreter that finalizes under that thread froze it inside torch's C++ and died
of SIGABRT, leaving the segment behind (issue 11; scripts/faults/daemon_kill.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.ranks import free_port, run_ranks
from support.daemon import daemon_env, our_segments

ROOT = Path(__file__).resolve().parents[2]

# Rank 0 of a 2-rank job (both ranks in this one process) has an allreduce pending that
# rank 1 never joins; its completion callback is slow, like a DDP comm hook, and the main
# thread exits as soon as its wait raises.
CHILD = r"""
import json, sys, threading, time
from pathlib import Path
import numpy as np
import torch.distributed as dist
from libmccl.daemon.client import DaemonCommunicator
from mccl_common.errors import DaemonUnavailableError

work, port = Path(sys.argv[1]), int(sys.argv[2])
stores = [dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False),
          dist.TCPStore("127.0.0.1", port, 2, False)]

def slow_callback(batch):
    if any(err is not None for _, err, _ in batch):
        time.sleep(1.0)
        (work / "callback-done").write_text("1")

comms = [None, None]
def make(rank):
    comms[rank] = DaemonCommunicator(rank, 2, 0xdead07, stores[rank], None,
                                     slow_callback if rank == 0 else None, timeout_s=60)
threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
for t in threads: t.start()
for t in threads: t.join(60)
a = np.ones(4096, dtype=np.float32)
op = comms[0].allreduce(a.ctypes.data, a.size, 0, 0)
(work / "pending").write_text("1")
try:
    comms[0].wait(op, 30)
except DaemonUnavailableError as e:
    print(json.dumps({"raised": type(e).__name__}), flush=True)
"""


@pytest.mark.timeout(120)
def test_rank_exiting_on_daemon_death_finishes_teardown(tmp_path):
    rdir = tmp_path / "rt"
    env = {**os.environ, **daemon_env(rdir), "PYTHONPATH": str(ROOT)}
    daemon = subprocess.Popen([sys.executable, "-m", "mccld"], env=env, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 30
        while not (rdir / "token").exists():
            assert daemon.poll() is None and time.monotonic() < deadline, "mccld did not start"
            time.sleep(0.1)
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(free_port())], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (tmp_path / "pending").exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never got its op pending"
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait(10)
        out, err = child.communicate(timeout=40)
        assert child.returncode == 0, f"child exited {child.returncode}: {err[-2000:]}"
        assert json.loads(out.strip().splitlines()[-1]) == {"raised": "DaemonUnavailableError"}, out
        assert (tmp_path / "callback-done").exists(), \
            "the interpreter exited under the I/O thread while it still ran a failed op's callback"
        left = [s for s in our_segments() if s.split("-")[3] == str(child.pid)]
        assert left == [], f"segments left behind by the exited rank: {left}"
    finally:
        for p in (child, daemon):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        for s in our_segments():
            if child is not None and s.split("-")[3] == str(child.pid):
                Path("/dev/shm", s).unlink(missing_ok=True)


@pytest.mark.timeout(150)
def test_fault_campaign_daemon_kill_short():
    """A short run of the campaign; the full one is `scripts/faults/daemon_kill.py --trials 1000`."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts/faults/daemon_kill.py"), "--trials", "12",
                        "--max-seconds", "30"], capture_output=True, text=True, timeout=140, cwd=ROOT)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    failed = [line for line in r.stdout.splitlines() if '"ok": false' in line]
    assert r.returncode == 0 and summary["failed"] == 0, "\n".join(failed) or r.stderr[-2000:]
    assert summary["trials"] >= 1


def rank_io_thread_exits_first(rank: int, world: int) -> str:
    import numpy as np
    from support.daemon import connect
    comm, _store = connect(rank, world, comm_id=0xdead08, timeout_s=30)
    a = np.ones(8, dtype=np.float32)
    comm.wait(comm.allreduce(a.ctypes.data, a.size, 0, 0), 20)
    fail_ops = comm._fail_ops

    def io_thread_first(ops, exc):
        # The order seen in test_daemon_fleet: the I/O thread notices _closed (its poll
        # returns at least once a second) and exits, closing its end of the wake pipe,
        # before the closing thread wakes it.
        comm._thread.join(5)
        fail_ops(ops, exc)

    comm._fail_ops = io_thread_first
    comm.shutdown(5)
    assert not comm._thread.is_alive() and comm._sock is None and comm._segment is None
    return "ok"


@pytest.mark.timeout(60)
def test_shutdown_after_the_io_thread_exited_completes(daemon):  # noqa: F811
    """shutdown() raised zmq.Again from its wake-up of an I/O thread that had already gone,
    leaving the sockets open and the leave unsent."""
    _d, env = daemon
    assert run_ranks(rank_io_thread_exits_first, 1, env=env, timeout_s=45) == ["ok"]
