"""Requests still on their way while mccld stops map nothing and start nothing for good.

The attach thread can be working through a client's backlog (joins, registers, releases, a
leave) while ``Daemon.stop`` frees the jobs' segments and ends their threads. Two CI runs' leak
checks found a client's shared buffer still mapped (its two fds) by a stopped in-process
mccld: a register processed after the segments were freed, then a release taken just
before the job's thread ended and queued behind its end. A Job with a stand-in host
replays each interleaving, with real segments. A join taken after ``stop`` listed the jobs
would start one whose thread outlives mccld; it is refused.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from mccl_common import attach_protocol as protocol
from mccl_common import shm
from mccl_common.errors import AbortedError
from mccld.jobs.job import Job, Member
from support.daemon import running_daemon
from support.job_host import StandInHost
from support.leak_check import fd_targets


@pytest.fixture
def job():
    j = Job(StandInHost(), "00000000000000ab", 1, (protocol.Host("h0", "10.0.0.1:1", (0,)),), 2.0, {})
    j.members[0] = Member(rank=0, ident=b"c0", pid=os.getpid(), join_req=1)
    yield j
    j.close(stopping=True)


@pytest.fixture
def client_segment(job):
    """A buffer as the client creates it (the client's own mapping holds one fd)."""
    seg = shm.Segment(f"mccl-{job.id[-8:]}-0-{os.getpid()}-1", 4096, create=True)
    job.host.handed[seg.name] = os.dup(seg.handover_fd)   # what mccld's fd inbox would hold
    seg.handed_over()
    yield seg
    seg.close()
    for fd in job.host.handed.values():
        os.close(fd)


def _fds_on(name: str) -> int:
    return sum(t.removesuffix(" (deleted)") in (f"/dev/shm/{name}", f"/memfd:{name}") for t in fd_targets())


def _stop(job: Job) -> None:
    """What Daemon.stop does to each job."""
    job.free_segments()
    job.close(stopping=True)


def test_a_register_that_arrives_while_mccld_stops_maps_nothing(job, client_segment):
    name = client_segment.name
    job.free_segments()
    with pytest.raises(AbortedError, match="mccld is stopping"):
        job.register(0, b"c0", name, 4096, buffer=True)
    assert not job.members[0].buffers
    assert _fds_on(name) == 1   # the client's own mapping only


def test_a_release_taken_just_before_the_jobs_thread_ended_is_still_unmapped(job, client_segment):
    name = client_segment.name
    job.register(0, b"c0", name, 4096, buffer=True)
    ours = job.members[0].buffers[name]
    assert _fds_on(name) == 3   # mccld's side keeps the file open beside its mapping
    unlink = ours.unlink

    def stop_in_between() -> None:
        # release_buffer took the buffer out of the member, then mccld stopped before it
        # handed the unmap on: the job's thread is gone when it does.
        _stop(job)
        assert not job._thread.is_alive()
        unlink()

    ours.unlink = stop_in_between
    job.release_buffer(0, b"c0", name)
    assert ours.closed and _fds_on(name) == 1


def test_an_unmap_queued_behind_the_jobs_stop_is_done_before_its_thread_ends(job, client_segment):
    name = client_segment.name
    job.register(0, b"c0", name, 4096, buffer=True)
    ours = job.members[0].buffers[name]
    busy, go = threading.Event(), threading.Event()

    class _Slow:
        """An unmap the job's thread is still doing while the stop and the release queue up."""
        def close(self) -> None:
            busy.set()
            go.wait(10)

    job._unmap([_Slow()])
    assert busy.wait(10)
    stopper = threading.Thread(target=job.close, kwargs={"stopping": True})
    stopper.start()
    try:
        deadline = time.monotonic() + 10
        while job._tasks.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job._tasks.qsize() == 1, "the stop never got queued"
        job.release_buffer(0, b"c0", name)   # its unmap goes behind the stop
    finally:
        go.set()
        stopper.join(10)
    assert not job._thread.is_alive() and ours.closed and _fds_on(name) == 1


def test_a_join_that_arrives_while_mccld_stops_starts_no_job():
    with running_daemon() as (d, _env):
        hello = protocol.build_request({"type": "hello", "req": 1, "token": "", "pid": os.getpid()})
        d.jobs.handle(b"c0", hello)
        d.stop()
        join = protocol.build_request({"type": "join", "req": 2, "job": "ac", "rank": 0, "size": 1,
                                       "timeout_s": 5, "opts": {},
                                       "hosts": [{"host_id": d.host_id, "link_addr": "h:1", "ranks": [0]}]})
        with pytest.raises(AbortedError, match="mccld is stopping, join refused"):
            d.jobs.handle(b"c0", join)
        assert d.jobs.table == {}
        assert not [t.name for t in threading.enumerate() if t.name.startswith("mccld-job-")]
