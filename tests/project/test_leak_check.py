"""The after-test leak check (tests/support/leak_check.py) sees each kind of leftover, and only new ones."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support import leak_check


@pytest.mark.leaks_ok("this test makes and cleans up its own leftovers")
def test_each_kind_of_leftover_is_reported_until_it_goes():
    before = leak_check.snapshot()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="leaky-thread")
    thread.start()
    r, w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seg = Path(f"/dev/shm/mccl-0000leak-0-{os.getpid()}-0")
    seg.write_bytes(b"x")
    try:
        left = leak_check.leftovers(before, grace_s=0.3)
        assert "leaky-thread" in left["threads"][0]
        assert len(left["fds"]) >= 2, left
        assert [c.split()[0] for c in left["children"]] == [str(child.pid)]
        assert left["segments"] == [seg.name]
    finally:
        stop.set()
        thread.join(5)
        os.close(r)
        os.close(w)
        child.kill()
        child.wait(10)
        seg.unlink()
    assert leak_check.leftovers(before, grace_s=2.0) == {}


def _sleep_rank(rank: int, world: int) -> None:
    import time
    time.sleep(60)


@pytest.mark.leaks_ok("this test makes and cleans up its own leftovers")
def test_a_rank_left_running_is_reported_though_the_rank_server_forked_it():
    from support.ranks import reap, spawn_ranks, start_rank_server

    start_rank_server()   # the session's, as the warm-up starts it (this test skips the check)
    before = leak_check.snapshot()
    procs, results, _port = spawn_ranks(_sleep_rank, 1)
    try:
        left = leak_check.leftovers(before, grace_s=0.3)
        assert [c.split()[0] for c in left["children"]] == [str(procs[0].pid)], left
    finally:
        reap(procs)
        results.close()
        del procs, results
    assert leak_check.leftovers(before, grace_s=5.0) == {}


@pytest.mark.leaks_ok("measures the check itself")
def test_another_processes_segment_is_not_blamed_on_this_test():
    before = leak_check.snapshot()
    seg = Path("/dev/shm/mccl-0000leak-0-1-0")     # pid 1: never ours
    seg.write_bytes(b"x")
    try:
        assert leak_check.leftovers(before, grace_s=0.2) == {}
    finally:
        seg.unlink()


def test_a_thread_that_is_still_exiting_gets_the_grace_period():
    done = threading.Event()
    threading.Thread(target=lambda: done.wait(1.0), daemon=True).start()   # ends 1 s into the grace period
