"""What a failed job's ranks read is the job's verdict, never the engine's echo of it.

When a peer host fails a job, two things reach this daemon at about the same time: the
peer's ``job_failed`` notice on the control link (its verdict: "rank 3 died") and the
engine's abort ("[engine] communicator aborted by rank 1: <that verdict>"). The campaign
saw 2 of 100 trials under load where the far host's ranks got the second: the link thread
had set the job's verdict but not failed the native dispatcher yet, the dispatcher's own
callback found the job failed and returned, and the dispatcher then failed its clients
with the raw engine error it held. A Job with a stand-in host and dispatcher replays that
interleaving exactly.

The peer's notice can also overtake the last bytes of an op the peer finished before its
rank died; that op must still complete here (the peer's ABORT frames come behind its data).
"""

from __future__ import annotations

import threading
import time

import pytest

from mccl_common.errors import AbortedError, MCCLError, PeerLostError
from mccl_common import attach_protocol as protocol
from mccld.jobs.job import Job
from support.job_host import StandInHost


class _Dispatcher:
    """The fast path's fail(): the first error wins, as in the native dispatcher."""

    def __init__(self) -> None:
        self.written: MCCLError | None = None

    def fail(self, exc: MCCLError) -> None:
        if self.written is None:
            self.written = exc

    def close(self) -> None: ...
    def records(self) -> list:
        return []


class _Engine:
    """The engine seam fail() touches: abort (recorded) and what closing the job calls."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)

    def barrier(self) -> int:
        raise AbortedError("[engine] aborted")

    def wait(self, op_id, timeout_s) -> None: ...
    def shutdown(self, timeout_s) -> bool:
        return True


@pytest.fixture
def job():
    hosts = (protocol.Host("h0", "10.0.0.1:1", (0, 1)), protocol.Host("h1", "10.0.0.2:1", (2, 3)))
    j = Job(StandInHost(), "00000000000000aa", 4, hosts, 2.0, {})
    j.fast = _Dispatcher()
    yield j
    j.close(stopping=True)


def test_the_dispatchers_clients_read_the_peers_verdict_when_its_notice_wins_the_race(job):
    verdict = PeerLostError("[daemon] job 00000000000000aa: rank 3 (pid 1) on host h1 died", peer_rank=3)
    echo = AbortedError(f"[engine] communicator aborted by rank 1: {verdict}", peer_rank=1)
    # The link thread is inside job.fail(verdict): the verdict is set, the dispatcher not failed yet.
    with job._lock:
        job.failed, job.state = verdict, "failed"
    # The dispatcher's thread reports the engine's abort; once its callback returns it fails
    # its clients with what it holds unless the callback failed it first.
    job._fast_failed(echo, from_engine=True)
    job.fast.fail(echo)
    assert job.fast.written is verdict, job.fast.written


def test_a_dispatcher_error_with_no_verdict_yet_becomes_the_verdict(job):
    echo = AbortedError("[engine] communicator aborted by rank 1: rank 3 died", peer_rank=1)
    done = threading.Event()

    def report() -> None:
        job._fast_failed(echo, from_engine=True)
        done.set()

    t = threading.Thread(target=report)
    t.start()
    assert done.wait(10)
    t.join()
    assert isinstance(job.fast.written, PeerLostError), job.fast.written
    assert job.fast.written is job.failed
    assert "host h1, ranks [2, 3]" in str(job.failed)
    assert job.host.notified == [job.failed]


_VERDICT = PeerLostError("[daemon] job 00000000000000aa: rank 3 (pid 1) on host h1 died", peer_rank=3)


def test_a_peers_verdict_lets_the_op_running_here_finish_and_cuts_it_later(job):
    engine = job.engine = _Engine()
    job.fail(_VERDICT, local=False)
    # Later ops fail at once: the verdict is the job's, and no peer is told again.
    assert job.failed is _VERDICT and job.state == "failed"
    assert job.host.notified == []
    # The op in flight keeps its engine and dispatcher: its data may all be here already.
    assert engine.aborted == [] and job.fast.written is None
    job.check_timeouts(time.monotonic())
    assert engine.aborted == [] and job.fast.written is None
    # Past the grace whatever still runs is cut, with the peer's verdict.
    job.check_timeouts(time.monotonic() + 60)
    assert job.fast.written is _VERDICT
    assert engine.aborted == [str(_VERDICT)] and job.aborting
    job.check_timeouts(time.monotonic() + 120)
    assert engine.aborted == [str(_VERDICT)], "cut twice"


def test_an_op_ended_by_the_peers_abort_reports_the_peers_verdict(job):
    job.engine = _Engine()
    job.fail(_VERDICT, local=False)
    echo = AbortedError(f"[engine] communicator aborted by rank 1: {_VERDICT}", peer_rank=1)
    job._fast_failed(echo, from_engine=True)
    assert job.fast.written is _VERDICT


def test_a_verdict_of_our_own_cuts_everything_at_once_and_tells_the_peers(job):
    engine = job.engine = _Engine()
    job.fail(_VERDICT, local=True)
    assert job.fast.written is _VERDICT
    assert engine.aborted == [str(_VERDICT)] and job.aborting
    assert job.host.notified == [_VERDICT]


def test_a_job_closed_before_the_cut_cuts_at_once_and_never_after(job):
    engine = job.engine = _Engine()
    job.fail(_VERDICT, local=False)
    job.close()  # every rank left: the job's thread closes it
    job._thread.join(10)
    assert not job._thread.is_alive()
    assert engine.aborted == [str(_VERDICT)] and job.fast.written is _VERDICT
    job.check_timeouts(time.monotonic() + 60)
    assert engine.aborted == [str(_VERDICT)] and job.engine is None


class _AbortedEngine(_Engine):
    """An engine whose ops end in its abort, as a failed job's do."""

    def barrier(self) -> int:
        return 1

    @staticmethod
    def wait(op_id, timeout_s) -> None:
        # Static: the native engine's frames hold no reference to it either.
        raise AbortedError("[engine] communicator aborted by rank 1: the job failed", peer_rank=1)

    def own_error_bound_s(self, timeout_s: float) -> float:
        return timeout_s


def test_a_verdict_raised_by_an_engine_op_keeps_no_engine_alive(job):
    """The p2p mailbox receive raises the job's verdict from _engine_run when the aborted
    engine ends it, and on a loaded host it does so after the job closed (a failed job's
    close does not wait for it), so past _drop_frames: the verdict's traceback, and the
    engine error it was raised over (its __context__), held _engine_run's frame, whose
    ``engine`` local kept the shut-down engine and its progress pipe until a cyclic GC (the
    fuzz test's no-GC check failed 2 in 17 under load)."""
    import gc
    import weakref

    engine = _AbortedEngine()
    gone = weakref.ref(engine)
    job.engine = engine
    verdict = PeerLostError("[daemon] job 00000000000000aa: rank 1 aborted the communicator: test", peer_rank=1)
    job.fail(verdict, local=True)
    assert engine.aborted == [str(verdict)]
    gc.disable()
    try:
        try:
            job._engine_run("barrier")
        except MCCLError as e:
            raised = e
        assert raised is verdict
        job.engine = None      # the job closed
        del engine
        assert gone() is None, "the raised verdict's frames keep the job's engine alive"
    finally:
        gc.enable()
