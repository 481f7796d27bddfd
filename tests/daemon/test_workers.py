"""mccld.net.workers.WorkerPool, the bounded pool behind gossip's dials and the on-demand leases:
its bound counts queued and running tasks together, a full pool refuses at once, and stop drops
what has not started and ends every thread."""

from __future__ import annotations

import threading
import time

from mccld.net.workers import WorkerPool

WAIT_S = 10.0


def _threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(name + "-")]


def _settles(pool: WorkerPool, unfinished: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while pool.unfinished != unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    return pool.unfinished == unfinished


def test_the_bound_counts_queued_and_running_tasks_and_refuses_past_it():
    errors: list[int] = []
    pool = WorkerPool("wp-bound", workers=1, limit=3, on_error=lambda: errors.append(1)).start()
    gate, started, ran = threading.Event(), threading.Event(), []

    def held(i: int) -> None:
        started.set()
        assert gate.wait(WAIT_S)
        ran.append(i)
    try:
        assert pool.submit(held, 0)
        assert started.wait(WAIT_S)                 # one running ...
        assert pool.submit(ran.append, 1) and pool.submit(ran.append, 2)   # ... two queued
        assert pool.unfinished == 3
        assert not pool.submit(ran.append, 3)       # full: refused, and it never runs
        gate.set()
        assert _settles(pool, 0) and ran == [0, 1, 2]
        assert pool.submit(ran.append, 4)           # room again once they finished
        assert _settles(pool, 0) and ran == [0, 1, 2, 4] and errors == []
    finally:
        gate.set()
        pool.stop()


def test_a_failing_task_is_reported_and_the_worker_goes_on():
    errors: list[str] = []

    def report() -> None:
        import sys
        errors.append(str(sys.exc_info()[1]))
    pool = WorkerPool("wp-error", workers=1, limit=4, on_error=report).start()
    done = threading.Event()
    try:
        assert pool.submit(lambda: 1 / 0)
        assert pool.submit(done.set)
        assert done.wait(WAIT_S)
        assert errors == ["division by zero"]
    finally:
        pool.stop()


def test_stop_drops_what_has_not_started_and_ends_every_thread():
    pool = WorkerPool("wp-stop", workers=2, limit=8, on_error=lambda: None, join_s=WAIT_S).start()
    assert len(_threads("wp-stop")) == 2
    gate, started, ran = threading.Event(), threading.Barrier(3, timeout=WAIT_S), []

    def held(i: int) -> None:
        started.wait()
        assert gate.wait(WAIT_S)
        ran.append(i)
    assert pool.submit(held, 0) and pool.submit(held, 1)
    started.wait()                                  # both workers busy
    assert pool.submit(ran.append, 2)               # queued behind them
    stopper = threading.Thread(target=pool.stop)
    stopper.start()
    assert _settles(pool, 2)                        # the queued one dropped, the two running go on
    gate.set()
    stopper.join(2 * WAIT_S)
    assert not stopper.is_alive() and _threads("wp-stop") == []
    assert sorted(ran) == [0, 1]                    # the running ones finished, the queued one never ran
    assert not pool.submit(ran.append, 3) and pool.unfinished == 0
