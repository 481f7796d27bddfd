"""Bugs the fuzzer (scripts/fuzz) found, each pinned by a direct test of the code that had it."""

from __future__ import annotations

import json
import os
import socket
import struct

import pytest

from support.daemon import one_rank_job, refused

from mccl_common import PROTO_VERSION, fd_handover, shm, status_protocol
from support.daemon import open_own_memory
from mccl_common.errors import ProtocolError
from mccld.net import auth

DEEP = b"[" * 20_000 + b"]" * 20_000        # deeper than json can parse, small enough for a socketpair
# A handshake frame is capped at 16 KiB (auth.MAX_HANDSHAKE_FRAME): nested as deep as fits in that.
DEEP_HANDSHAKE = b"[" * 8_000 + b"]" * 8_000


@pytest.mark.timeout(30)
def test_deeply_nested_link_handshake_frame_is_a_protocol_error():
    """Found on the link port: the RecursionError escaped the handshake thread, which died
    without closing the socket, so each such unauthenticated connection held an fd and
    was never answered."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", len(DEEP_HANDSHAKE)) + DEEP_HANDSHAKE)
        with pytest.raises(ProtocolError, match="nests too deep"):
            auth.recv_plain(b, "fuzzer")


@pytest.mark.timeout(30)
def test_deeply_nested_link_frame_after_the_handshake_is_a_protocol_error():
    """The same in a sealed frame: the link's reader thread died and the link stayed listed."""
    sender = auth.Session(b"k" * 32, b"a" * 32, b"b" * 32, initiator=True, peer="x")
    receiver = auth.Session(b"k" * 32, b"a" * 32, b"b" * 32, initiator=False, peer="fuzzer")
    frame = sender.seal({"type": "x"})
    deep = sender.seal_raw(b'{"type": "x", "deep": ' + DEEP + b"}")
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame + deep)
        assert receiver.open(b) == {"type": "x"}
        with pytest.raises(ProtocolError, match="nests too deep"):
            receiver.open(b)


@pytest.mark.timeout(30)
def test_deeply_nested_status_request_is_a_protocol_error():
    """On the status endpoint the RecursionError reached the catch-all and was logged as an
    unexpected failure with a traceback, for every such request."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(DEEP + b"\n")
        with pytest.raises(ProtocolError, match="not a JSON object"):
            status_protocol.Conn(b, "fuzzer").recv("request")


@pytest.mark.timeout(60)
def test_registering_a_segment_that_does_not_exist_is_a_protocol_error(raw):
    """Found on the attach socket: shm_open's FileNotFoundError reached the catch-all, so the
    client got "internal error" and the daemon logged a traceback for each such request."""
    d, c = raw
    seg = one_rank_job(c, d.host_id, "d44")
    try:
        missing = shm.segment_name("d44", 0, os.getpid(), 9)
        reply = c.call({"type": "register", "job": "d44", "rank": 0, "segment": missing, "nbytes": 4096})
        assert refused(reply, "'segment'", "names no segment handed over"), reply
    finally:
        seg.close()
        seg.unlink()


# Found while fuzzing (mccld died of SIGBUS at the next op); fixed by the size check before
# every op (shm.Segment.check_size); now segments are sealed memfds that cannot shrink at all.
@pytest.mark.timeout(90)
def test_a_client_shrinking_its_registered_segment_does_not_kill_mccld():
    import sys
    from pathlib import Path
    import zmq
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from fuzz.target import Daemon, Helper
    d, helper = Daemon.create(), Helper()
    socks, segs = [], []
    try:
        d.start()
        token = (d.rdir / "token").read_text().strip()
        hosts = [{"host_id": d.host_id, "link_addr": d.link_addr, "ranks": [0, 1]}]

        def call_all(msgs):
            for s, m in zip(socks, msgs):
                s.send(json.dumps({"v": PROTO_VERSION, "req": 1, **m}).encode())
            return [json.loads(s.recv()) if s.poll(20_000) else None for s in socks]

        for _ in range(2):
            socks.append(zmq.Context.instance().socket(zmq.DEALER))
            socks[-1].connect(f"ipc://{d.rdir}/mccld.sock")
        call_all([{"type": "hello", "token": token, "pid": helper.pid}] * 2)
        call_all([{"type": "join", "job": "abd", "rank": r, "size": 2, "timeout_s": 10.0, "opts": {}, "hosts": hosts}
                  for r in range(2)])
        segs = [shm.Segment(shm.segment_name("abd", r, helper.pid, 1), 1 << 20, create=True) for r in range(2)]
        for seg in segs:
            fd_handover.hand_over(d.rdir, seg.name, seg.handover_fd, os.geteuid())
            seg.handed_over()
        call_all([{"type": "register", "job": "abd", "rank": r, "segment": segs[r].name, "nbytes": 1 << 20}
                  for r in range(2)])
        fd = open_own_memory(segs[0].name)    # segments have no name now: the client's own mapping
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)           # sealed (mccl_common/shm.py): not even its client can
        finally:
            os.close(fd)
        replies = call_all([{"type": "op", "job": "abd", "rank": r, "seq": 1, "op": "allreduce",
                             "args": {"count": 1 << 18, "dtype": 0, "op": 0, "offset": 0, "segment": segs[r].name}}
                            for r in range(2)])
        assert d.alive(), f"mccld died (exit {d.proc.returncode})"
        assert all(r is not None for r in replies), replies
    finally:
        for s in socks:
            s.close(0)
        helper.kill()
        for seg in segs:
            seg.close()
            seg.unlink()
        d.cleanup()
