"""``mcclctl run``'s per-run key (mccl_common/launch_protocol.run_key, mccld/host/launcher.py): each
leased host derives it from the submit key and the request's run nonce, writes it to a file
only the job's user can read, points the job's MCCL_JOB_KEY_FILE there and removes it with
the lease; a request cannot name a key file of its own."""

from __future__ import annotations

import os
import sys
import time

import pytest

from mccl_common.errors import ProtocolError
from mccl_common.launch_protocol import LaunchRequest, Lease, new_run_nonce, run_key
from mccld.host.launcher import LaunchServer

pytestmark = pytest.mark.timeout(60)

KEY = b"submit-key-" + b"s" * 24

# The job reports what it was given: the key file's path, mode and contents.
_REPORT = ("import os, stat; p = os.environ.get('MCCL_JOB_KEY_FILE', ''); "
           "print('path', p); print('mode', oct(stat.S_IMODE(os.stat(p).st_mode)) if p else '-'); "
           "print('dirmode', oct(stat.S_IMODE(os.stat(os.path.dirname(p)).st_mode)) if p else '-'); "
           "print('key', open(p).read().strip() if p else '-')")


@pytest.fixture
def srv(tmp_path):
    server = LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, harvest_state=lambda: "idle",
                          launch_user="root" if os.geteuid() == 0 else "",
                          command=lambda req: [sys.executable, "-c", _REPORT]).start()
    yield server
    server.stop()


def _run(server: LaunchServer, tmp_path, **over) -> dict[str, str]:
    body = {"job": "run1", "rdzv_endpoint": "10.0.0.1:29400", "nnodes": "2", "nproc_per_node": 1,
            "argv": ["python", "train.py"], "cwd": str(tmp_path), **over}
    lz = Lease(f"127.0.0.1:{server.port}", KEY, timeout_s=10.0)
    try:
        lz.open(LaunchRequest.parse(body))
        seen: dict[str, str] = {}
        while True:
            event, data = lz.read()
            if event == "out":
                k, _, v = data.partition(" ")
                seen[k] = v
            elif event == "exit":
                assert data["code"] == 0, seen
                return seen
    finally:
        lz.close()


def test_each_host_derives_the_same_run_key_and_only_the_job_reads_it(srv, tmp_path) -> None:
    nonce = new_run_nonce()
    seen = _run(srv, tmp_path, run_nonce=nonce)
    assert seen["key"] == run_key(KEY, "run1", nonce).hex()
    assert seen["mode"] == "0o600" and seen["dirmode"] == "0o700", seen
    assert seen["path"].startswith(str(tmp_path)), seen
    # Another run (another nonce) gets another key; the submit key itself never reaches the job.
    other = _run(srv, tmp_path, run_nonce=new_run_nonce())
    assert other["key"] != seen["key"] and KEY.hex() not in (seen["key"], other["key"])
    deadline = time.monotonic() + 10
    while os.path.exists(seen["path"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(seen["path"]) and not os.path.exists(os.path.dirname(seen["path"]))


def test_a_request_cannot_bring_its_own_key_file_or_a_bad_nonce(tmp_path) -> None:
    base = {"job": "j", "rdzv_endpoint": "h:1", "nnodes": "2", "nproc_per_node": 1, "argv": ["x"], "cwd": "/"}
    with pytest.raises(ProtocolError, match="MCCL_JOB_KEY_FILE is set by the daemon"):
        LaunchRequest.parse({**base, "env": {"MCCL_JOB_KEY_FILE": "/tmp/attacker.key"}})
    for bad in ("xyz", "AB" * 16, 7, "0" * 31):
        with pytest.raises(ProtocolError, match="run_nonce"):
            LaunchRequest.parse({**base, "run_nonce": bad})
    assert LaunchRequest.parse({**base, "run_nonce": "ab" * 16}).run_nonce == "ab" * 16
