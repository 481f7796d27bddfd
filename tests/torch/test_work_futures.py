"""Every way an MCCLWork can fail reaches C++ consumers of its future as an error.

DDP's reducer reads a Work's future in C++; a future failed with
``torch.futures.Future.set_exception`` looks to it like a success holding an
exception object, and the reducer crashed (SIGSEGV) on it. ``cxx_wait`` is such a
C++ consumer: TorchScript's ``wait`` reads the c10 future and rethrows its error,
with none of the Python-side unwrapping that hides the difference from Python.
These tests drive the completion paths directly, without an engine.
"""

from __future__ import annotations

import datetime
import re

import pytest
import torch

from libmccl.torch.compat import ResultFuture
from mccl_common.errors import AbortedError, CollectiveTimeout, MCCLError, PeerLostError
from libmccl.torch.work import AllOf, CompletionRouter, MCCLWork, shutdown_error
from support.futures import cxx_wait

PEER_LOST_KIND = 1  # mccl::ErrorKind::PeerLost (mccl_common/errors.py _KINDS)




def _work(name: str = "allreduce", post=None, timeout_s: float = 30.0) -> MCCLWork:
    return MCCLWork(name, 0, [torch.ones(3)], (), post, timeout_s)


def _assert_failed_everywhere(work: MCCLWork, error_type: type, words: str) -> None:
    """C++ readers, Python future waiters, then-chains and Work.wait all see the failure."""
    fut = work.get_future()
    assert fut.done() and work.is_completed() and not work.is_success()
    with pytest.raises(RuntimeError, match="TorchScript"):
        cxx_wait(fut)
    with pytest.raises(RuntimeError, match=f"{error_type.__name__}: .*{re.escape(words)}"):
        fut.wait()
    chained = fut.then(lambda f: f.value()[0] * 2)
    with pytest.raises(RuntimeError, match=re.escape(words)):
        chained.wait()
    with pytest.raises(RuntimeError, match="TorchScript"):
        cxx_wait(chained)
    with pytest.raises(error_type, match=re.escape(words)):
        work.wait()
    assert isinstance(work.exception(), error_type)


@pytest.mark.timeout(30)
def test_success_reaches_cxx_as_the_outputs() -> None:
    work = _work()
    router = CompletionRouter(0)
    router.track(7, work)
    router.on_complete([(7, None, -1)])
    cxx_wait(work.get_future())
    value = work.get_future().wait()
    assert isinstance(value, list) and torch.equal(value[0], torch.ones(3))
    assert work.get_future().then(lambda f: f.value()[0] * 2).wait().tolist() == [2.0] * 3
    assert work.wait() and work.is_success()


@pytest.mark.timeout(30)
def test_engine_error_fails_the_cxx_future() -> None:
    router = CompletionRouter(0)
    work = router.track(1, _work())
    router.on_complete([(1, (PEER_LOST_KIND, "[transport] lost peer=10.0.0.2:1234 (rank 1)", 1,
                             "10.0.0.2:1234"), -1)])
    _assert_failed_everywhere(work, PeerLostError, "lost peer=10.0.0.2:1234 (rank 1)")
    assert work.exception().peer_rank == 1


@pytest.mark.timeout(30)
def test_error_before_track_fails_the_cxx_future() -> None:
    router = CompletionRouter(0)
    router.on_complete([(2, (PEER_LOST_KIND, "[transport] lost peer (rank 1)", 1, ""), -1)])
    _assert_failed_everywhere(router.track(2, _work()), PeerLostError, "lost peer (rank 1)")


@pytest.mark.timeout(30)
def test_copy_back_failure_fails_the_cxx_future() -> None:
    def broken_copy_back() -> None:
        raise RuntimeError("destination freed")

    router = CompletionRouter(0)
    work = router.track(3, _work(post=broken_copy_back))
    router.on_complete([(3, None, -1)])
    _assert_failed_everywhere(work, MCCLError, "copying its result back failed on rank 0: destination freed")


@pytest.mark.timeout(30)
def test_fail_all_fails_pending_and_later_futures() -> None:
    router = CompletionRouter(0)
    pending = router.track(4, _work())
    router.fail_all(shutdown_error(0))
    _assert_failed_everywhere(pending, AbortedError, "shut down on rank 0")
    _assert_failed_everywhere(router.track(5, _work()), AbortedError, "shut down on rank 0")


@pytest.mark.timeout(30)
def test_coalesced_work_fails_after_every_member_is_done() -> None:
    router = CompletionRouter(0)
    first, second = router.track(6, _work()), router.track(7, _work())
    group = AllOf([first, second], 0, 30.0)
    router.on_complete([(6, (PEER_LOST_KIND, "[transport] lost peer (rank 1)", 1, ""), -1)])
    # Its members' buffers are in use until the last one is done: no early verdict.
    assert not group.is_completed() and not group.get_future().done()
    router.on_complete([(7, None, -1)])
    _assert_failed_everywhere(group, PeerLostError, "lost peer (rank 1)")


@pytest.mark.timeout(30)
def test_wait_timeout_says_timed_out_and_the_op_can_still_finish() -> None:
    router = CompletionRouter(0)
    work = router.track(8, _work())
    with pytest.raises(CollectiveTimeout, match=r"^\[mccl\] Timed out after 0\.2 s waiting for allreduce on rank 0"):
        work.wait(datetime.timedelta(seconds=0.2))
    assert not work.get_future().done()
    router.on_complete([(8, None, -1)])
    cxx_wait(work.get_future())
    assert work.wait()


@pytest.mark.timeout(30)
def test_on_failure_gets_the_typed_error_and_nothing_on_success() -> None:
    """A CUDA-aware future is handed out done before the engine finishes
    (device_tensors.DeviceSide); the process group learns a later failure through
    on_failure, typed, not as torch's RuntimeError rewrap."""
    seen: list[BaseException] = []
    ok, failed = ResultFuture(), ResultFuture()
    for result in (ok, failed):
        result.on_failure(seen.append)
    ok.set_result([torch.ones(1)])
    error = PeerLostError("[transport] lost peer (rank 1)")
    failed.set_exception(error)
    assert seen == [error]


@pytest.mark.timeout(30)
def test_wait_returns_once_the_future_and_its_callbacks_are_complete() -> None:
    # torchft waits on a Work and then chains callbacks on its future, expecting a completed one;
    # before the fix wait() returned as soon as the op was done, while the completion thread was
    # still completing the future, and torchft's chain lost the op to the race.
    import threading

    work = _work()
    router = CompletionRouter(0)
    router.track(9, work)
    ran = threading.Event()
    release = threading.Event()

    def slow_callback(f: torch.futures.Future) -> list:
        release.wait(20)    # holds the completion thread inside the future's callbacks
        ran.set()
        return f.value()

    chained = work.get_future().then(slow_callback)
    done = threading.Thread(target=router.on_complete, args=([(9, None, -1)],))
    done.start()
    threading.Timer(0.5, release.set).start()
    assert work.wait()
    # wait() returned: the future is complete and the callbacks chained on it have run
    assert ran.is_set() and work.get_future().done() and chained.done()
    done.join(20)
