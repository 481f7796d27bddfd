"""Issue 13's faults in an elastic run, end to end on loopback (``mcclctl run --min 1 --max 2``
on two real mcclds, examples/elastic_train.py saving every 5 steps):

- kill -9 of a worker: the others' collectives fail, both torchruns re-form and resume from
  the last checkpoint; the steps after it are run again with the same losses, none skipped;
- SIGSTOP of a worker: the others time out naming it (--timeout 3), torchrun replaces the
  stopped worker, and the job finishes;
- the rendezvous anchor dies: mcclctl says so and stops the job on every host, nothing hangs
  and nothing is left running.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from support.daemon import stop_process
from support.elastic import job_pids, reference_losses, run_elastic, start_hosts, steps_of

pytestmark = pytest.mark.timeout(240)

STEPS = 40
EVERY = 5


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = start_hosts(tmp_path_factory.mktemp("faults"), ["h1", "h2"])
    yield h
    h.stop()


@pytest.fixture(scope="module")
def reference():
    return reference_losses(STEPS)


def _workers(host: str) -> list[int]:
    """The training processes on ``host``, not its torchrun (python -m torch.distributed.run)."""
    return [pid for pid in job_pids(host, "elastic_train.py")
            if "torch.distributed.run" not in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")]


def _drive(run, act_at_step: int, act) -> tuple[list[str], float | None]:
    """Streams the job's output; calls ``act()`` once a world-2 step >= act_at_step is printed,
    and prints how long after it the job resumed."""
    lines, acted, resumed = [], None, None
    for line in run.stdout:
        lines.append(line.rstrip())
        s = steps_of(line)
        if acted is None and s and s[0][0] >= act_at_step and s[0][2] == 2:
            act()
            acted = time.monotonic()
        if acted and resumed is None and "resumed after step" in line:
            resumed = time.monotonic()
            print(f"resumed {resumed - acted:.1f} s after the fault: {line.strip()}")
    return lines, acted


def _no_job_left(host: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while job_pids(host, "elastic_train.py") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_pids(host, "elastic_train.py"), f"{host} still runs the job"


def _check_losses(steps, reference) -> None:
    assert sorted({s for s, _, _ in steps}) == list(range(STEPS)), steps     # none skipped
    for s, loss, _ in steps:
        assert abs(loss - reference[s]) < 1e-4, (s, loss, reference[s])     # repeats are identical


def test_a_killed_worker_costs_the_steps_since_the_last_checkpoint(hosts, tmp_path, reference):
    run = run_elastic(hosts, tmp_path / "ckpt", STEPS, 1, 2, every=EVERY)
    try:
        def kill():
            for pid in _workers("h2"):
                os.kill(pid, signal.SIGKILL)
        lines, killed = _drive(run, 12, kill)
        text = "\n".join(lines)
        assert run.wait(timeout=60) == 0, text
        assert killed, text
        steps = steps_of(text)
        _check_losses(steps, reference)
        order = [s for s, _, _ in steps]
        back = max(order[i - 1] - order[i] + 1 for i in range(1, len(order)) if order[i] <= order[i - 1])
        assert 0 < back <= EVERY, (back, text)          # ran again from the last checkpoint only
        assert "resumed after step" in text and steps[-1][2] == 2, text
    finally:
        stop_process(run)
        run.stdout.close()
    _no_job_left("h1"), _no_job_left("h2")


def test_a_stopped_worker_is_timed_out_and_replaced(hosts, tmp_path, reference):
    run = run_elastic(hosts, tmp_path / "ckpt", STEPS, 1, 2, every=EVERY, timeout_s=3.0)
    stopped = []
    try:
        def stop():
            for pid in _workers("h2"):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        lines, _ = _drive(run, 12, stop)
        text = "\n".join(lines)
        assert run.wait(timeout=90) == 0, text
        assert stopped, text
        assert "Timed out" in text, text                # the others' error says which wait ran out
        _check_losses(steps_of(text), reference)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_process(run)
        run.stdout.close()
    _no_job_left("h1"), _no_job_left("h2")


def test_a_dead_anchor_stops_the_job_everywhere_with_a_clear_error(hosts, tmp_path):
    run = run_elastic(hosts, tmp_path / "ckpt", 400, 1, 2, every=EVERY)
    try:
        def kill_anchor():
            for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
                try:
                    cmd = open(f"/proc/{pid}/cmdline").read()
                except OSError:
                    continue
                if "libmccl.elastic.rdzv" in cmd and f"--parent\0{run.pid}" in cmd:
                    os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        lines, killed = _drive(run, 3, kill_anchor)
        text = "\n".join(lines)
        assert run.wait(timeout=30) == 1, text
        assert killed and time.monotonic() - killed < 25, text
        assert "the rendezvous anchor (port" in text and "exited with code -9" in text, text
        assert steps_of(text)[-1][0] < 399, text        # stopped, not run to the end
        print(f"stopped {time.monotonic() - killed:.1f} s after the anchor died ({time.monotonic() - started:.1f} s run)")
    finally:
        stop_process(run)
        run.stdout.close()
    _no_job_left("h1"), _no_job_left("h2")
