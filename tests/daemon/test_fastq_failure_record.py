"""A job that fails right after a small op finished must not take that op's result back.

Found by CI: rank 1 of a 2-rank job saw its all-reduce complete and was killed; mccld's pid
check failed the job and poisoned rank 0's `completed` ticket before rank 0's completer
thread had read it, so rank 0 got PeerLostError for an all-reduce that had finished. The
failure record now carries the count of ops completed before the poison
(libmccl/csrc/opqueue/layout.h). Both halves run here in one process, the client queue
and the dispatcher (with no engine: one host), or a hand-written failure in its place.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import struct

import numpy as np
import pytest

from libmccl import _core
from mccl_common import shm

pytestmark = pytest.mark.timeout(60)

COMPLETED_OFF, ERROR_OFF, DATA_OFF = 64, 128, 4096   # libmccl/csrc/opqueue/layout.h
F32, SUM, PEER_LOST = 0, 0, 1   # mccl::ErrorKind::kPeerLost


def _queue(job: str):
    done: queue.Queue = queue.Queue()
    q = _core.FastQueue(shm.segment_name(job, 0, os.getpid(), 0), 4096, 0,
                        lambda op_id, err: done.put((op_id, err)))
    mem = mmap.mmap(q.fd, DATA_OFF + 4096)   # the queue's own descriptor, as mccld gets it handed over
    return q, done, mem


def _close(q, mem) -> None:
    q.close()
    q.unlink()
    mem.close()


def _fail_by_hand(mem: mmap.mmap, completed_before: int) -> None:
    """What mccld's Dispatcher::fail writes: the record, then the poison."""
    msg = b"[daemon] job 0000fa99: rank 1 (pid 1) on host h died"
    mem[ERROR_OFF:ERROR_OFF + 24] = struct.pack("<QiiII", completed_before, PEER_LOST, 1, len(msg), 0)
    mem[ERROR_OFF + 24 + 256:ERROR_OFF + 24 + 256 + len(msg)] = msg
    view = (ctypes.c_char * 128).from_buffer(mem)
    _core.Ticket.at(ctypes.addressof(view) + COMPLETED_OFF).poison()
    del view


def test_an_op_that_finished_before_the_poison_keeps_its_result():
    q, done, mem = _queue("0000fa99")
    try:
        a = np.ones(4, dtype=np.float32)
        q.submit(7, 1, _core.FAST_ALLREDUCE, F32, SUM, a.size, a.ctypes.data)
        mem[DATA_OFF:DATA_OFF + 16] = np.full(4, 2.0, dtype=np.float32).tobytes()  # mccld's result
        _fail_by_hand(mem, completed_before=1)        # ... and the job failed before `completed` was read
        op_id, err = done.get(timeout=10)
        assert (op_id, err) == (7, None)
        assert (a == 2.0).all(), "the finished op's result was not copied out"
        with pytest.raises(Exception, match="died"):  # the next op gets the job's verdict
            q.submit(8, 2, _core.FAST_ALLREDUCE, F32, SUM, a.size, a.ctypes.data)
    finally:
        _close(q, mem)


def test_an_op_the_failure_caught_mid_way_gets_the_error_and_no_partial_result():
    q, done, mem = _queue("0000fa9a")
    try:
        a = np.ones(4, dtype=np.float32)
        q.submit(7, 1, _core.FAST_ALLREDUCE, F32, SUM, a.size, a.ctypes.data)
        mem[DATA_OFF:DATA_OFF + 16] = np.full(4, 2.0, dtype=np.float32).tobytes()
        _fail_by_hand(mem, completed_before=0)
        op_id, err = done.get(timeout=10)
        assert op_id == 7 and err is not None and err[0] == PEER_LOST and "died" in err[1], err
        assert (a == 1.0).all(), "a failed op wrote a partial result back"
    finally:
        _close(q, mem)


def test_the_dispatcher_records_how_many_ops_it_completed_before_failing():
    q, done, mem = _queue("0000fa9b")
    d = _core.FastDispatcher("0000fa9b", [0], [q.name], [q.fd], 4096, 1, 1, 10.0, None, lambda *a: None)
    try:
        a = np.full(4, 3.0, dtype=np.float32)
        for n in (1, 2):
            q.submit(n, n, _core.FAST_ALLREDUCE, F32, SUM, a.size, a.ctypes.data)
            assert done.get(timeout=10) == (n, None)
        d.fail(PEER_LOST, "[daemon] job 0000fa9b: rank 1 died", 1, "")
        (recorded,) = struct.unpack_from("<Q", mem, ERROR_OFF)
        assert recorded == 2
        (word,) = struct.unpack_from("<Q", mem, COMPLETED_OFF)
        assert word == 2**64 - 1, "the dispatcher did not poison `completed`"
    finally:
        d.close()
        _close(q, mem)
