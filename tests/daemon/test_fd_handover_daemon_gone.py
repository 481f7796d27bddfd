"""A mccld killed while a client hands it a segment: the client's error says the daemon is
gone (DaemonUnavailableError, as every other path of a dead mccld does), not that it sent a
malformed frame. Seen in CI's daemon-kill fault campaign (7 Dec): one rank of four raised
"[fd-handover] connection closed inside a frame" where the others raised DaemonUnavailableError."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from mccl_common import attach_protocol, fd_handover
from mccl_common.errors import DaemonUnavailableError, ProtocolError

pytestmark = pytest.mark.timeout(30)


def _listener(rdir, answer: bytes | None):
    """mccld.fds that accepts one hand-over, then answers ``answer`` (None: nothing) and closes."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(rdir / attach_protocol.HANDOVER_NAME))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1024, 1)
            for fd in fds:
                os.close(fd)
            if answer is not None:
                conn.sendall(answer)
        finally:
            conn.close()
            srv.close()

    t = threading.Thread(target=serve, name="fake-mccld-fds")
    t.start()
    return t


def _hand_over(rdir):
    r, w = os.pipe()
    try:
        fd_handover.hand_over(rdir, "mccl-test-0-1-0", r, os.geteuid(), timeout_s=10)
    finally:
        os.close(r)
        os.close(w)


def test_a_daemon_gone_before_its_answer_is_daemon_unavailable(tmp_path):
    t = _listener(tmp_path, None)
    with pytest.raises(DaemonUnavailableError, match=r"closed the connection while segment mccl-test-0-1-0.*"
                                                      r"crashed or was stopped"):
        _hand_over(tmp_path)
    t.join(10)


def test_half_an_answer_is_still_a_protocol_error(tmp_path):
    t = _listener(tmp_path, fd_handover.encode({"ok": True})[:5])
    with pytest.raises(ProtocolError, match=r"closed inside a frame"):
        _hand_over(tmp_path)
    t.join(10)
