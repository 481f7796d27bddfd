"""mccld's launch endpoint (mccld/host/launcher.py) and its protocol (mccl_common/launch_protocol.py):
a lease starts a job, streams its output sealed, ends with its exit code, and a client that
cancels, vanishes or falls silent gets its job stopped; a wrong key, a malformed request, a
busy host or root without MCCL_LAUNCH_USER starts nothing."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from mccl_common.errors import AuthError, ConfigError, MCCLError, ProtocolError
from mccl_common.launch_protocol import LaunchRequest, Lease
from mccld.host.launcher import LaunchServer, torchrun_command

pytestmark = pytest.mark.timeout(60)

KEY = b"submit-key-" + b"s" * 16


def request(tmp_path: Path, **over) -> dict:
    base = {"job": "j1", "rdzv_endpoint": "10.0.0.1:29400", "nnodes": "2", "nproc_per_node": 1,
            "argv": ["python", "train.py", "--lr", "0.1"], "cwd": str(tmp_path)}
    base.update(over)
    return base


def script_command(code: str):
    """A command builder that runs ``code`` instead of torchrun (the request's argv is passed on)."""
    return lambda req: [sys.executable, "-c", code, *req.argv]


@pytest.fixture
def server(tmp_path):
    made = []

    def make(code: str = "print('hi')", state: str | None = "idle", **kw) -> LaunchServer:
        kw.setdefault("launch_user", "root" if os.geteuid() == 0 else "")
        srv = LaunchServer(KEY, "hostA", tmp_path, addr="127.0.0.1", port=0, harvest_state=(lambda: state),
                           command=script_command(code), **kw).start()
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


def lease(srv: LaunchServer, key: bytes = KEY) -> Lease:
    return Lease(f"127.0.0.1:{srv.port}", key, timeout_s=10.0)


def drain(lz: Lease) -> tuple[list[tuple[str, str]], int]:
    lines = []
    while True:
        event, data = lz.read()
        if event in ("out", "err"):
            lines.append((event, data))
        elif event == "exit":
            return lines, data["code"]


def test_a_lease_streams_the_jobs_output_and_ends_with_its_exit_code(server, tmp_path):
    srv = server("import sys, os; print('out', sys.argv[1:]); print('oops', file=sys.stderr); "
                 "print(os.environ['MCCL_HOST_ID'], os.environ['EXTRA']); sys.exit(3)")
    lz = lease(srv)
    started = lz.open(LaunchRequest.parse(request(tmp_path, env={"EXTRA": "x"})))
    assert started["host"] == "hostA" and started["pid"] > 0
    lines, code = drain(lz)
    lz.close()
    assert code == 3
    assert ("out", "out ['python', 'train.py', '--lr', '0.1']") in lines
    assert ("err", "oops") in lines and ("out", "hostA x") in lines
    deadline = time.monotonic() + 5
    while srv.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.running() == 0


@pytest.mark.parametrize("how", ["cancel", "disconnect", "silent"])
def test_a_lease_that_ends_stops_the_job_and_its_children(server, tmp_path, how):
    pidfile = tmp_path / "child.pid"
    # The job starts a grandchild, as torchrun starts workers: both must go.
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('ready', flush=True); time.sleep(60)")
    srv = server(code, lease_timeout_s=1.0)
    lz = lease(srv)
    job_pid = lz.open(LaunchRequest.parse(request(tmp_path)))["pid"]
    assert lz.read() == ("out", "ready")
    child = int(pidfile.read_text())
    assert srv.running() == 1
    if how == "cancel":
        lz.cancel()
    elif how == "disconnect":
        lz.close()
    # "silent": we keep the socket open and send no beats for longer than the lease timeout
    deadline = time.monotonic() + 20
    while (_alive(job_pid) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(job_pid) and not _alive(child)
    while srv.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.running() == 0
    lz.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead to us: its parent (the test process, for the job) has not reaped it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_wrong_submit_key_is_refused_and_nothing_runs(server, tmp_path):
    marker = tmp_path / "ran"
    srv = server(f"open({str(marker)!r}, 'w').write('x')")
    lz = lease(srv, key=b"another-key-" + b"k" * 16)
    with pytest.raises(AuthError, match="submit key"):
        lz.open(LaunchRequest.parse(request(tmp_path)))
    lz.close()
    time.sleep(0.3)
    assert not marker.exists() and srv.running() == 0


def test_the_fleet_key_alone_cannot_start_jobs(tmp_path, monkeypatch):
    from mccl_common.daemon_settings import DaemonConfig
    kf = tmp_path / "submit.key"
    kf.write_text("same-" + "k" * 32)
    kf.chmod(0o600)
    cfg = DaemonConfig(fleet_key="same-" + "k" * 32, submit_key_file=str(kf))
    with pytest.raises(ConfigError, match="equals the fleet key"):
        cfg.read_submit_key()


def _raw_request(srv: LaunchServer, body: str) -> dict:
    """Sends ``body`` sealed under the submit key, bypassing LaunchRequest's own checks, as a
    hostile client holding the key could; returns the first event, opened."""
    from mccl_common.launch_protocol import Channel
    from mccl_common.status_protocol import Conn
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        conn = Conn(s, "test")
        hello = conn.recv("hello")
        chan = Channel(KEY, hello["nonce"], hello["host"], "c1")
        conn.send(chan.seal_request(body))
        event, data = chan.open_event(conn.recv("answer"))
        return {"event": event, "data": data}


@pytest.mark.parametrize("body, why", [
    ("not json", "not JSON"),
    (json.dumps({"job": "a/b"}), "job"),
    (json.dumps({"job": "j", "rdzv_endpoint": "h:1", "nnodes": "3:2", "nproc_per_node": 1, "argv": ["x"],
                 "cwd": "/"}), "MAX is below MIN"),
    (json.dumps({"job": "j", "rdzv_endpoint": "h:1", "nnodes": "2", "nproc_per_node": 1, "argv": [],
                 "cwd": "/"}), "argv"),
    (json.dumps({"job": "j", "rdzv_endpoint": "h:1", "nnodes": "2", "nproc_per_node": 1, "argv": ["x"],
                 "cwd": "relative"}), "cwd"),
    (json.dumps({"job": "j", "rdzv_endpoint": "h:1", "nnodes": "2", "nproc_per_node": 1, "argv": ["x"],
                 "cwd": "/", "env": {"MCCL_HOST_ID": "spoof"}}), "MCCL_HOST_ID"),
    (json.dumps({"job": "j", "rdzv_endpoint": "h:1", "nnodes": "2", "nproc_per_node": True, "argv": ["x"],
                 "cwd": "/"}), "nproc_per_node"),
])
def test_a_malformed_request_is_refused_with_its_reason(server, tmp_path, body, why):
    marker = tmp_path / "ran"
    srv = server(f"open({str(marker)!r}, 'w').write('x')")
    answer = _raw_request(srv, body)
    assert answer["event"] == "refused" and answer["data"]["kind"] == "ProtocolError"
    assert why in answer["data"]["message"]
    assert not marker.exists() and srv.running() == 0


def test_a_busy_host_refuses_unless_asked_for_any_state(server, tmp_path):
    srv = server("print('ran')", state="busy")
    lz = lease(srv)
    with pytest.raises(MCCLError, match="hostA is busy, not harvestable"):
        lz.open(LaunchRequest.parse(request(tmp_path)))
    lz.close()
    lz = lease(srv)
    lz.open(LaunchRequest.parse(request(tmp_path, any_state=True)))
    assert drain(lz) == ([("out", "ran")], 0)
    lz.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the root rule applies to a daemon running as root")
def test_a_root_daemon_without_a_launch_user_starts_nothing(server, tmp_path):
    srv = server("print('ran')", launch_user="")
    lz = lease(srv)
    with pytest.raises(ConfigError, match="runs as root"):
        lz.open(LaunchRequest.parse(request(tmp_path)))
    lz.close()


def test_a_missing_working_directory_is_named(server, tmp_path):
    srv = server()
    lz = lease(srv)
    with pytest.raises(ConfigError, match="does not exist on hostA"):
        lz.open(LaunchRequest.parse(request(tmp_path, cwd=str(tmp_path / "nope"))))
    lz.close()


def test_torchrun_command_runs_python_programs_in_mcclds_interpreter(tmp_path):
    req = LaunchRequest.parse(request(tmp_path, nnodes="2:4", max_restarts=3))
    cmd = torchrun_command(req, python="/opt/py")
    assert cmd[:3] == ["/opt/py", "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--rdzv-backend") + 1] == "mccl" and cmd[cmd.index("--nnodes") + 1] == "2:4"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "is_host=0" and cmd[cmd.index("--max-restarts") + 1] == "3"
    assert cmd[-3:] == ["train.py", "--lr", "0.1"] and "--no-python" not in cmd
    mod = torchrun_command(LaunchRequest.parse(request(tmp_path, argv=["python3", "-m", "pkg.train", "x"])), "/p")
    assert mod[-3:] == ["--module", "pkg.train", "x"]
    exe = torchrun_command(LaunchRequest.parse(request(tmp_path, argv=["./run.sh", "a"])), "/p")
    assert exe[-3:] == ["--no-python", "./run.sh", "a"]


def test_a_forged_event_is_caught_by_the_client(tmp_path):
    """The server's events are sealed: a message altered on the way fails to open."""
    import base64
    from mccl_common.launch_protocol import PROTO, Channel
    from mccl_common.status_protocol import Conn
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        lz = Lease(f"127.0.0.1:{lst.getsockname()[1]}", KEY, timeout_s=5.0)
        s, _ = lst.accept()
        with s:
            conn = Conn(s, "fake")
            conn.send({"mccl_launch": PROTO, "nonce": "n1", "host": "fake"})
            import threading
            box = {}
            t = threading.Thread(target=lambda: box.setdefault("r", _expect_auth_error(lz, tmp_path)))
            t.start()
            req = conn.recv("request")
            msg = Channel(KEY, "n1", "fake", req["cnonce"]).seal_event("started", {"host": "fake", "pid": 1})
            sealed_box = bytearray(base64.b64decode(msg["box"]))
            sealed_box[len(sealed_box) // 2] ^= 1     # altered on the way
            msg["box"] = base64.b64encode(bytes(sealed_box)).decode()
            conn.send(msg)
            t.join(10)
        lz.close()
    assert box["r"] is True


def _expect_auth_error(lz: Lease, tmp_path) -> bool:
    try:
        lz.open(LaunchRequest.parse(request(tmp_path)))
    except AuthError:
        return True
    return False


def test_parse_rejects_what_the_wire_must_not_carry(tmp_path):
    with pytest.raises(ProtocolError, match="argv"):
        LaunchRequest.parse(request(tmp_path, argv=["a\0b"]))
    with pytest.raises(ProtocolError, match="env"):
        LaunchRequest.parse(request(tmp_path, env={f"V{i}": "x" for i in range(65)}))
    ok = LaunchRequest.parse(request(tmp_path, env={"A": "1"}))
    assert LaunchRequest.parse(ok.to_json()) == ok


def _request_of_body_size(tmp_path: Path, size: int) -> LaunchRequest:
    """A request whose JSON body is exactly ``size`` bytes, padded with environment variables."""
    from mccl_common.status_protocol import canon
    env: dict[str, str] = {}

    def length() -> int:
        return len(canon(LaunchRequest.parse(request(tmp_path, env=env)).to_json()))
    while length() < size:
        name = f"PAD{len(env)}"
        env[name] = ""
        env[name] = "x" * min(4000, size - length())
    assert length() == size
    return LaunchRequest.parse(request(tmp_path, env=env))


def test_the_largest_request_protocol_2_carried_still_fits_once_encrypted(server, tmp_path):
    """The pre-auth cap is on the base64 of the sealed request (4/3 of it, plus the tag): a body
    of MAX_REQUEST_BODY bytes (what fitted the 16 KiB line in clear) must still be read."""
    from mccl_common.launch_protocol import MAX_REQUEST_BODY
    srv = server("print('big ok')")
    lz = lease(srv)
    lz.open(_request_of_body_size(tmp_path, MAX_REQUEST_BODY))
    assert drain(lz) == ([("out", "big ok")], 0)
    lz.close()
    lz = lease(srv)
    with pytest.raises(ConfigError, match="shorten the command line"):
        lz.open(_request_of_body_size(tmp_path, MAX_REQUEST_BODY + 1))
    lz.close()
