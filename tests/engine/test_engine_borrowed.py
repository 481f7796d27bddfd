"""Communicators built on sockets the caller already connected (what mccld does with its
pooled, authenticated data sockets): collectives work, a clean shutdown leaves the
sockets reusable by the next communicator, an abort leaves them unclean, and a frame of
an old communicator on a reused socket is refused loudly. Ranks are threads."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from libmccl import _core
from mccl_common.errors import MCCLError, ProtocolError

from support.engine import DT, SUM, fd_count, ptr, run_threads
from support.borrowed import Mesh, allreduce_check


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tcp", [True, False], ids=["loopback", "socketpair"])
def test_collectives_on_handed_in_sockets_then_a_second_communicator_on_the_same_ones(tcp):
    with Mesh(3, tcp=tcp) as mesh:
        fds_before = fd_count()
        comms = mesh.build()
        allreduce_check(comms, 1 << 20)      # 4 MB: striped over both sockets of each peer
        clean = run_threads(3, lambda r: comms[r].shutdown(5.0))
        assert clean == [True] * 3
        assert all(c.released_clean() for c in comms)
        del comms
        assert fd_count() == fds_before, "the engine leaked its dups of the borrowed sockets"
        # The caller's sockets are still open and at a frame boundary: a new communicator
        # (new id) runs on them as if they were fresh.
        comms = mesh.build()
        allreduce_check(comms, 3)
        assert run_threads(3, lambda r: comms[r].shutdown(5.0)) == [True] * 3


@pytest.mark.timeout(60)
def test_a_message_nobody_received_does_not_spoil_the_sockets():
    with Mesh(2) as mesh:
        comms = mesh.build()
        for c in comms:
            c.alpha_beta()  # the start's own exchanges are over (some of them arrive early too)
        early = comms[1].stats()["unexpected_messages"]
        x = np.arange(1000, dtype=np.float32)
        comms[0].wait(comms[0].send(ptr(x), x.nbytes, 1, 5), 10)   # eager; rank 1 never receives it
        time.sleep(0.2)
        assert comms[1].stats()["unexpected_messages"] == early + 1
        assert run_threads(2, lambda r: comms[r].shutdown(5.0)) == [True, True]
        comms = mesh.build()
        allreduce_check(comms, 5)
        assert run_threads(2, lambda r: comms[r].shutdown(5.0)) == [True, True]


@pytest.mark.timeout(60)
def test_abort_leaves_the_sockets_unclean():
    with Mesh(2) as mesh:
        comms = mesh.build()
        allreduce_check(comms, 8)
        comms[0].abort("test abort")
        with pytest.raises(MCCLError):
            a = np.zeros(4, dtype=np.float32)
            comms[1].wait(comms[1].allreduce(ptr(a), 4, DT[a.dtype], SUM), 10)
        assert run_threads(2, lambda r: comms[r].shutdown(2.0)) == [False, False]
        # An aborted engine shuts the shared sockets down: their owner sees EOF and drops them.
        for s in mesh.socks[1][0]:
            s.settimeout(5)
            try:
                while s.recv(1 << 16):   # the ABORT frame, then EOF (a timeout would raise)
                    pass
            except ConnectionResetError:
                pass                     # or a reset: unread bytes were dropped at the close


@pytest.mark.timeout(60)
def test_a_peer_that_never_shuts_down_leaves_the_sockets_unclean():
    with Mesh(2) as mesh:
        comms = mesh.build()
        allreduce_check(comms, 8)
        t0 = time.monotonic()
        assert comms[0].shutdown(0.5) is False     # rank 1 never sends its BYE
        assert time.monotonic() - t0 < 5
        assert comms[1].shutdown(2.0) is False     # ...and rank 0 shut the sockets down


@pytest.mark.timeout(60)
def test_hello_of_another_communicator_is_refused():
    with Mesh(2) as mesh:
        with pytest.raises(MCCLError, match="communicator id mismatch"):
            mesh.build(comm_ids=[11, 12], connect_timeout_s=3.0)


def stale_frame(comm_id: int) -> bytes:
    """A well-formed 72-byte collective frame header of communicator ``comm_id`` (frame.cc
    layout, protocol 2), signed as an 8-byte broadcast from root 0 (op_signature.cc)."""
    signature = struct.pack("<HQBBiI", 2, 8, 0, 0, 0, 0)
    return struct.pack("<IHHQQIQQQ", 0x4C43434D, 2, 1, comm_id, 0, 0, 0, 8, 8) + signature


@pytest.mark.timeout(60)
def test_stale_frame_of_an_old_communicator_is_rejected_loudly():
    # Bare frames: sealed ones never get this far, since a frame of the earlier job fails the
    # new keys' check (tests/engine/test_engine_wire_security.py injects such frames).
    with Mesh(2) as mesh:
        first = mesh.build(comm_ids=[7, 7], wire_security=_core.WireSecurity.off)
        assert run_threads(2, lambda r: first[r].shutdown(5.0)) == [True, True]
        comms = mesh.build(comm_ids=[8, 8], wire_security=_core.WireSecurity.off)
        # A leftover writer of communicator 7 (a process of the earlier job) writes to the
        # socket the new communicator now uses.
        mesh.socks[0][1][0].sendall(stale_frame(7) + b"\0" * 8)
        a = np.zeros(2, dtype=np.float32)
        with pytest.raises(ProtocolError, match="stale frame .* communicator 7, this socket now serves "
                                                "communicator 8"):
            comms[1].wait(comms[1].allreduce(ptr(a), 2, DT[a.dtype], SUM), 10)
        assert comms[1].shutdown(1.0) is False
        comms[0].shutdown(1.0)
