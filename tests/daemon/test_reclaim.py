"""The parts of handing a host back to its user (mccld/host/reclaim.py, proctree.py, priority.py)
on real processes: the job tree survives its torchrun's death, a removal escalates to SIGKILL,
background priority reaches every thread, and the watch times each hand-back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mccld.host.priority import Background, is_background
from mccld.host.proctree import JobTree, descendants, process_table
from mccld.host.reclaim import ReclaimWatch, Removal

pytestmark = pytest.mark.timeout(60)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A "torchrun" that starts a "worker" in a session of its own (as torchrun does), prints its
# pid and waits; the worker ignores SIGTERM when asked to (a rank stuck in native code).
PARENT = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(w.pid, flush=True)
time.sleep(60)
"""
WORKER = "import signal, threading, time; {ignore}[threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(2)]; time.sleep(60)"


def _job(ignore_term: bool = False) -> tuple[subprocess.Popen, int]:
    worker = WORKER.format(ignore="signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_term else "")
    proc = subprocess.Popen([sys.executable, "-c", PARENT, worker], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_the_process_table_and_the_tree_walk():
    table = process_table()                       # psutil, on Linux and macOS alike
    assert table[os.getpid()][0] == os.getppid()
    assert process_table()[os.getpid()][1] == table[os.getpid()][1] != ""   # a stable start identity
    assert descendants(1, {1: (0, "a"), 2: (1, "b"), 3: (2, "c"), 4: (0, "d")}) == {1: "a", 2: "b", 3: "c"}


def test_an_unreaped_child_is_in_the_tree_but_not_alive():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        tree = JobTree(proc.pid)
        assert tree.scan() == [proc.pid]
        deadline = time.monotonic() + 30
        while tree.alive():          # exits by itself; unreaped, it is a zombie holding no CPU
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.05)
        assert tree.scan() == [proc.pid]
    finally:
        proc.wait(timeout=10)


def test_the_job_tree_keeps_a_worker_orphaned_by_its_torchruns_death():
    proc, worker = _job()
    try:
        tree = JobTree(proc.pid)
        assert set(tree.scan()) == {proc.pid, worker}
        proc.kill()
        proc.wait(timeout=10)
        assert tree.scan() == [worker]          # re-parented, still the job's
        assert tree.signal(signal.SIGKILL) == 1
        assert _gone(worker)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


@linux
def test_a_removal_terminates_torchrun_then_kills_whatever_of_the_job_is_left():
    proc, worker = _job(ignore_term=True)
    now = [0.0]
    try:
        time.sleep(0.3)     # the worker has set its SIGTERM handler
        removal = Removal(JobTree(proc.pid), kill_after_s=5.0, clock=lambda: now[0])
        assert proc.wait(timeout=10) == -signal.SIGTERM     # the "torchrun" alone, which left its worker
        removal.tick()
        assert not _gone(worker, within_s=0.5)  # before the wait is over: SIGTERM only
        now[0] = 5.0
        removal.tick()
        assert _gone(worker)
        removal.finish()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


@linux
def test_background_priority_reaches_every_thread_of_every_process():
    proc, worker = _job()
    try:
        time.sleep(0.3)     # the worker's threads exist
        tids = [int(t) for p in (proc.pid, worker) for t in os.listdir(f"/proc/{p}/task")]
        assert len(tids) >= 4 and not any(is_background(t) for t in tids)
        bg = Background()
        assert bg.lower(JobTree(proc.pid).scan()) == 2
        assert all(is_background(t) for t in tids)
        assert bg.lower([worker]) == 1          # again: already there, still counted
        assert bg.lower([2 ** 22 + 1]) == 0     # no such process
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        os.kill(worker, signal.SIGKILL)
        assert _gone(worker)


class FakeLauncher:
    def __init__(self):
        self.removed = 0
        self.lowered = 0
        self.deadlines: list[float] = []

    def background(self) -> int:
        self.lowered += 1
        return 3

    def reclaim_after(self, grace_s: float) -> int:
        self.deadlines.append(grace_s)
        return 1


def test_the_watch_yields_arms_the_deadline_and_times_the_hand_back():
    now = [1000.0]
    recorded = []
    watch = ReclaimWatch(60.0, lambda s, how: recorded.append((s, how)), clock=lambda: now[0])
    launcher = FakeLauncher()
    assert watch.update({"state": "leased", "since": 900.0}, False, launcher)["leaves_in_s"] is None
    assert launcher.lowered == 0                # the user is away: full speed
    now[0] = 1000.5
    fields = watch.update({"state": "draining", "since": 1000.0}, True, launcher)
    assert launcher.lowered == 1 and launcher.deadlines == [59.5]   # counted from the sample that saw the user
    assert fields["leaves_in_s"] == 59.5 and fields["reclaim_grace_s"] == 60.0
    now[0] = 1042.0
    assert watch.fields("draining")["leaves_in_s"] == 18.0
    launcher.removed = 1                        # the deadline ended the job
    now[0] = 1066.0
    fields = watch.update({"state": "busy", "since": 1066.0}, True, launcher)
    assert recorded == [(66.0, "removed")]
    assert fields["last_reclaim"] == {"seconds": 66.0, "how": "removed", "at": 1066.0}
    assert fields["leaves_in_s"] is None and launcher.lowered == 2  # busy: still in the background
    # The next one leaves by itself.
    watch.update({"state": "draining", "since": 2000.0}, True, launcher)
    now[0] = 2004.0
    watch.update({"state": "busy", "since": 2004.0}, True, launcher)
    assert recorded[-1] == (4.0, "left")


def test_the_exporter_has_the_reclaim_latency_histogram():
    from prometheus_client import generate_latest

    from mccld.report.metrics import make_registry
    from mccld.report.stats import DaemonStats
    stats = DaemonStats()
    stats.record_reclaim(3.0, "left")
    stats.record_reclaim(64.0, "removed")
    stats.record_reclaim(10.0, "removed")
    with pytest.raises(ValueError):
        stats.record_reclaim(1.0, "vanished")
    text = generate_latest(make_registry(stats, host="h1")).decode()
    assert 'mccl_reclaim_seconds_bucket{how="left",le="5.0"} 1.0' in text
    assert 'mccl_reclaim_seconds_bucket{how="removed",le="10.0"} 1.0' in text
    assert 'mccl_reclaim_seconds_bucket{how="removed",le="70.0"} 2.0' in text
    assert 'mccl_reclaim_seconds_count{how="removed"} 2.0' in text
    assert 'mccl_reclaim_seconds_sum{how="removed"} 74.0' in text


@pytest.mark.skipif(sys.platform != "darwin", reason="macOS only: taskpolicy and ps -o lstart")
def test_macos_background_priority_and_job_tree():
    """Never run yet (no Mac): taskpolicy -b and the ps-based job tree on real processes."""
    proc, worker = _job()
    try:
        tree = JobTree(proc.pid)
        assert set(tree.scan()) == {proc.pid, worker}
        assert Background().lower(tree.scan()) == 2
        for pid in (proc.pid, worker):
            nice = subprocess.run(["ps", "-o", "ni=", "-p", str(pid)], capture_output=True, text=True).stdout
            assert int(nice) == 19
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        os.kill(worker, signal.SIGKILL)
