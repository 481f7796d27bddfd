"""Attacker tests for launched jobs (mccld/host/launch_identity.py): a job that `mcclctl run` starts
runs code its submitter chose, so it must not get mccld's keys through its environment, nor run
as a user who can read mccld's key files."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

import pytest

from mccl_common.errors import ConfigError
from mccl_common.launch_protocol import LaunchRequest, Lease
from mccld.host import launch_identity
from mccld.host.launcher import LaunchServer

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="starts jobs as another user: needs root")]

KEY = b"submit-key-" + b"s" * 32
NOBODY = pwd.getpwnam("nobody")
SECRET = "fleet-" + "f" * 40


def _request() -> dict:
    return {"job": "j1", "rdzv_endpoint": "10.0.0.1:29400", "nnodes": "1", "nproc_per_node": 1,
            "argv": ["python", "train.py"], "cwd": "/", "env": {"FROM_SUBMITTER": "yes"}}


def _run(srv: LaunchServer) -> tuple[list[str], int]:
    lz = Lease(f"127.0.0.1:{srv.port}", KEY, timeout_s=10.0)
    try:
        lz.open(LaunchRequest.parse(_request()))
        lines = []
        while True:
            event, data = lz.read()
            if event in ("out", "err"):
                lines.append(data)
            elif event == "exit":
                return lines, data["code"]
    finally:
        lz.close()


@pytest.fixture
def key_file():
    fd, path = tempfile.mkstemp(prefix="mccl-fleet-key-")
    os.write(fd, b"0" * 64)
    os.close(fd)
    os.chmod(path, 0o600)
    try:
        yield Path(path)
    finally:
        os.unlink(path)


def _server(tmp_path: Path, key_file: Path, user: str) -> LaunchServer:
    # /bin/sh, readable by any user, stands in for torchrun: it reports who runs it and with what.
    return LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, launch_user=user,
                        harvest_state=lambda: "idle", command=lambda req: ["/bin/sh", "-c", "id -u; env"],
                        secret_files=(key_file,)).start()


def test_a_launched_job_gets_no_fleet_key_nor_key_paths_and_runs_as_the_launch_user(tmp_path, key_file,
                                                                                     monkeypatch):
    monkeypatch.setenv("MCCL_FLEET_KEY", SECRET)
    monkeypatch.setenv("MCCL_KEY_FILE", str(key_file))
    monkeypatch.setenv("MCCL_SUBMIT_KEY_FILE", "/etc/mccl/submit.key")
    monkeypatch.setenv("MCCL_PIPELINE_BYTES", "65536")   # an engine setting the job's libmccl reads
    srv = _server(tmp_path, key_file, "nobody")
    try:
        lines, code = _run(srv)
    finally:
        srv.stop()
    assert code == 0, lines
    assert lines[0] == str(NOBODY.pw_uid), f"the job ran as uid {lines[0]}"
    env = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    leaked = sorted(k for k, v in env.items() if SECRET in v or str(key_file) in v or "submit.key" in v)
    assert not leaked and "MCCL_FLEET_KEY" not in env, f"the job got mccld's secrets: {leaked}"
    assert env["FROM_SUBMITTER"] == "yes" and env["MCCL_HOST_ID"] == "hostA" and env["USER"] == "nobody"
    assert env.get("MCCL_PIPELINE_BYTES") == "65536" and "PATH" in env


def test_a_job_never_runs_as_a_user_who_can_read_the_fleet_key(tmp_path, key_file):
    os.chown(key_file, NOBODY.pw_uid, NOBODY.pw_gid)      # a key file the launch user owns
    marker = Path(tempfile.mkdtemp(prefix="mccl-lu-")) / "ran"
    srv = LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, launch_user="nobody",
                       harvest_state=lambda: "idle", command=lambda req: ["/bin/sh", "-c", f"touch {marker}"],
                       secret_files=(key_file,)).start()
    try:
        with pytest.raises(ConfigError, match=rf"as nobody: that user can read mccld's key file {key_file}"):
            _run(srv)
    finally:
        srv.stop()
        assert not marker.exists(), "the job ran"
        marker.parent.rmdir()


def test_jobs_never_run_as_mcclds_own_user_unless_named(monkeypatch, key_file):
    monkeypatch.setattr(os, "geteuid", lambda: NOBODY.pw_uid)      # a personal, non-root mccld
    with pytest.raises(ConfigError, match="as mccld's own user nobody: they could read its fleet key"):
        launch_identity.launch_user("", (key_file,), "hostA")
    assert launch_identity.launch_user("nobody", (key_file,), "hostA").pw_uid == NOBODY.pw_uid


def test_root_only_when_named():
    with pytest.raises(ConfigError, match="runs as root"):
        launch_identity.launch_user("", (), "hostA")
    assert launch_identity.launch_user("root", (), "hostA").pw_uid == 0
