"""p2p ops posted without a deadline (timeout_s=0): they outlive the communicator's
timeout, yet a dead peer, abort and shutdown still end them; ops with the default or
their own timeout still time out."""

from __future__ import annotations

import random
import select
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import AbortedError, CollectiveTimeout, ConfigError, PeerLostError
from support.engine import job_secret, make_options, ptr, ranks, run_ranks

pytestmark = pytest.mark.timeout(60)

# Rank 1 in its own process, so that it can die with its sockets closed by the kernel
# (no BYE, no ABORT): it prints its address, reads rank 0's, builds, says "ready", then
# exits without shutting down once told to.
PEER = r'''
import os, sys
from libmccl import _core
from mccl_common import jobkey
lst = _core.Listener("127.0.0.1", 0)
print(lst.address, flush=True)
addr0 = sys.stdin.readline().strip()
opts = _core.Options()
opts.timeout_s = 0.5
opts.connect_timeout_s = 20.0
opts.wire_security = _core.WireSecurity.aead
comm = _core.Communicator(1, 2, int(sys.argv[1]), lst, [addr0, lst.address], opts, None,
                          secret=jobkey.engine_secret("aead"))
print("ready", flush=True)
sys.stdin.readline()
os._exit(0)
'''


def _line(p: subprocess.Popen, timeout_s: float = 20.0) -> str:
    """The peer's next line, or a failure if it says nothing for ``timeout_s``."""
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    assert ready, f"the peer process said nothing for {timeout_s:.0f}s"
    return p.stdout.readline().strip()


def test_recv_without_deadline_outlives_the_timeout_then_completes():
    with ranks(2, opts=make_options(timeout_s=0.5)) as comms:
        got = np.zeros(64, np.uint8)
        op = comms[0].recv(ptr(got), got.nbytes, 1, 7, timeout_s=0)
        assert not comms[0].wait_for(op, 1.5), "a deadline-free recv ended before its message"
        sent = np.arange(64, dtype=np.uint8)
        comms[1].wait(comms[1].send(ptr(sent), sent.nbytes, 0, 7), 5)
        assert comms[0].wait_for(op, 5)
        assert np.array_equal(got, sent)
        # The communicator did not fail: collectives still run on it.
        run_ranks(comms, lambda r, c: c.wait(c.barrier(), 10))


def test_own_timeout_and_default_timeout_still_expire():
    with ranks(2, opts=make_options(timeout_s=30.0)) as comms:
        a = np.zeros(8, np.uint8)
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            comms[0].wait(comms[0].recv(ptr(a), 8, 1, 0, timeout_s=0.5), 10)
        assert time.monotonic() - t0 < 5.0 and info.value.peer_rank == 1
    with ranks(2, opts=make_options(timeout_s=0.5)) as comms:
        with pytest.raises(CollectiveTimeout):
            comms[0].wait(comms[0].recv(ptr(a), 8, 1, 0), 10)


def test_negative_timeout_is_refused():
    with ranks(2) as comms:
        a = np.zeros(8, np.uint8)
        for bad in (-1.0, float("nan")):
            with pytest.raises(ConfigError):
                comms[0].recv(ptr(a), 8, 1, 0, timeout_s=bad)
            with pytest.raises(ConfigError):
                comms[0].send(ptr(a), 8, 1, 0, timeout_s=bad)


def test_abort_and_shutdown_end_a_recv_without_deadline():
    with ranks(2) as comms:
        a = np.zeros(8, np.uint8)
        op = comms[0].recv(ptr(a), 8, 1, 0, timeout_s=0)
        threading.Timer(0.3, comms[0].abort, args=("test abort",)).start()
        with pytest.raises(AbortedError):
            comms[0].wait(op, 10)
    with ranks(2) as comms:
        a = np.zeros(8, np.uint8)
        op = comms[0].recv(ptr(a), 8, 1, 0, timeout_s=0)
        t0 = time.monotonic()
        comms[0].shutdown(0.3)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(AbortedError):
            comms[0].wait(op, 5)


def test_recv_without_deadline_fails_at_once_when_the_peer_dies():
    comm_id = random.getrandbits(63)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(comm_id)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        addr1 = _line(peer)
        lst = _core.Listener("127.0.0.1", 0)
        peer.stdin.write(lst.address + "\n")
        peer.stdin.flush()
        comm = _core.Communicator(0, 2, comm_id, lst, [lst.address, addr1], make_options(timeout_s=0.5), None,
                                  secret=job_secret())
        assert _line(peer) == "ready"
        a = np.zeros(8, np.uint8)
        op = comm.recv(ptr(a), 8, 1, 0, timeout_s=0)
        assert not comm.wait_for(op, 1.0)   # past the 0.5 s timeout, still waiting
        peer.stdin.write("die\n")
        peer.stdin.flush()
        # The event is the error: the wait's own bound would end it with a CollectiveTimeout
        # (10 s), the peer's death with PeerLostError naming it (no wall-clock bound needed).
        with pytest.raises(PeerLostError) as info:
            comm.wait(op, 10)
        assert info.value.peer_rank == 1
        comm.shutdown(1.0)
    finally:
        peer.kill()
        peer.wait(10)
