"""mccld as a service user: a daemon running as one user serves the processes of the members
of its MCCL_ATTACH_GROUP (packaging/, docs/service.md) and nobody else."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest

from mccl_common import attach_protocol as protocol
from mccl_common import daemon_settings, shm
from mccl_common.daemon_settings import load_config, runtime_dir
from mccl_common.errors import ConfigError
from mccld.attach import AttachServer, local_request


def _own_group() -> str:
    return grp.getgrgid(os.getegid()).gr_name


@pytest.mark.timeout(10)
def test_attach_group_opens_the_runtime_dir_to_the_group_only(tmp_path):
    target = tmp_path / "rt"
    cfg = load_config(env={"MCCL_RUNTIME_DIR": str(target), "MCCL_ATTACH_GROUP": _own_group()})
    st = runtime_dir(cfg, create=True).stat()
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == os.getegid()
    # Without the setting the same directory goes back to private.
    runtime_dir(load_config(env={"MCCL_RUNTIME_DIR": str(target)}), create=True)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


@pytest.mark.timeout(10)
def test_unknown_attach_group_is_a_config_error(tmp_path):
    cfg = load_config(env={"MCCL_RUNTIME_DIR": str(tmp_path / "rt"), "MCCL_ATTACH_GROUP": "no-such-group-mccl"})
    with pytest.raises(ConfigError, match="names no group"):
        runtime_dir(cfg, create=True)


@pytest.mark.timeout(10)
def test_client_falls_back_to_the_service_runtime_dir(tmp_path, monkeypatch):
    service, own = tmp_path / "service", tmp_path / "own"
    service.mkdir()
    monkeypatch.setattr(daemon_settings, "SERVICE_RUNTIME_DIR", str(service))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(own))
    monkeypatch.setattr(os, "geteuid", lambda: 4242)   # not root: root's default is /run/mccl itself
    cfg = load_config(env={})
    assert runtime_dir(cfg, create=False) == own / "mccl"          # no service daemon: our own dir
    (service / protocol.SOCKET_NAME).touch()
    assert runtime_dir(cfg, create=False) == service
    (own / "mccl").mkdir(parents=True, mode=0o700)
    os.chown(own / "mccl", 4242, -1)                               # the (pretend) user's own dir
    (own / "mccl" / protocol.SOCKET_NAME).touch()
    assert runtime_dir(cfg, create=False) == own / "mccl"          # a daemon of our own wins
    explicit = load_config(env={"MCCL_RUNTIME_DIR": str(tmp_path / "x")})
    assert runtime_dir(explicit, create=False) == tmp_path / "x"   # an explicit setting is never overridden


@pytest.mark.timeout(20)
def test_attach_endpoint_modes_with_a_group(tmp_path):
    rdir = runtime_dir(load_config(env={"MCCL_RUNTIME_DIR": str(tmp_path / "rt"),
                                        "MCCL_ATTACH_GROUP": _own_group()}), create=True)
    (rdir / (protocol.TOKEN_NAME + ".tmp")).write_text("stale")   # an old .tmp must not lend its mode
    (rdir / (protocol.TOKEN_NAME + ".tmp")).chmod(0o666)
    server = AttachServer(rdir, lambda ident, msg: {"ok": True, "status": {"served": True}}, group=os.getegid())
    server.start()
    try:
        token = (rdir / protocol.TOKEN_NAME).stat()
        sock = (rdir / protocol.SOCKET_NAME).stat()
        assert stat.S_IMODE(token.st_mode) == 0o640 and token.st_gid == os.getegid()
        assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_gid == os.getegid()
        assert local_request(rdir, {"type": "status"})["status"] == {"served": True}
    finally:
        server.stop()


@pytest.mark.timeout(10)
def test_segments_are_never_shared_with_the_group():
    """A service user's mccld gets each segment's descriptor from its client (fd_handover.py):
    nothing in /dev/shm is opened to the attach group, whose other members could read it."""
    seg = shm.Segment(shm.segment_name("5e41ce00", 0, os.getpid(), 1), 4096, create=True)
    try:
        assert not Path("/dev/shm", seg.name).exists()
        assert stat.S_IMODE(os.fstat(seg.handover_fd).st_mode) & 0o077 == 0
    finally:
        seg.close()


@pytest.mark.timeout(10)
def test_unlink_of_another_users_segment_is_not_an_error(monkeypatch):
    def refused(name):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(shm._posixshmem, "shm_unlink", refused)
    assert shm.unlink("mccl-5e41ce00-0-1-1") is False
