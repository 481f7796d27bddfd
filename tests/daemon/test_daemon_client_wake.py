"""The daemon client's wake-up of its I/O thread never raises into the caller."""

from __future__ import annotations

import threading

import pytest

zmq = pytest.importorskip("zmq")

from libmccl.daemon.client import DaemonCommunicator  # noqa: E402


def test_wake_without_a_listening_io_thread_does_not_raise():
    # The state a teardown sees when the I/O thread has already closed its end: a PUSH with
    # no peer, where a non-blocking send raises zmq.Again (as it does once the queue is full).
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        with pytest.raises(zmq.Again):
            push.send(b"", zmq.NOBLOCK)  # what _wake met
        comm = DaemonCommunicator.__new__(DaemonCommunicator)
        comm._lock = threading.Lock()
        comm._wake_push = push
        comm._wake()  # must not raise
    finally:
        push.close(0)
        ctx.term()
