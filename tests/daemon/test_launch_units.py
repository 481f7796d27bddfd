"""Launched jobs outside mccld's service sandbox (mccld/host/job_unit.py, job_exec.py): when mccld
runs under systemd each job is a transient unit of its own; elsewhere it is mccld's child. This
machine has no systemd (PID 1 is not systemd), so the decision and the command lines are checked
here, and the unit path runs end to end through stand-in systemd-run/systemctl scripts; the
child path runs for real. Either way the job writes in its working directory."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mccl_common.errors import ConfigError
from mccl_common.launch_protocol import LaunchRequest, Lease
from mccld.host import job_unit
from mccld.host.launcher import LaunchServer

pytestmark = pytest.mark.timeout(60)

KEY = b"submit-key-" + b"u" * 16
WRITER = ("import os, sys; open('saved.txt', 'w').write(os.getcwd() + ' ' + os.environ['MCCL_HOST_ID']); "
          "print('wrote', flush=True)")


def test_jobs_run_as_units_only_when_mccld_is_a_systemd_service(tmp_path):
    booted = tmp_path / "run-systemd-system"
    found = {"systemd-run": "/usr/bin/systemd-run", "systemctl": "/usr/bin/systemctl"}
    service = {"INVOCATION_ID": "0123abcd", "SYSTEMD_EXEC_PID": "4242"}     # what systemd gives mccld
    assert job_unit.choose("auto", {}, booted, found.get, pid=4242) == "direct"         # no systemd at all
    booted.mkdir()
    assert job_unit.choose("auto", {}, booted, found.get, pid=4242) == "direct"         # systemd, no service
    assert job_unit.choose("auto", service, booted, found.get, pid=4242) == "systemd"   # mccld.service
    # A process started from inside some other service (a CI runner's test run) inherits its
    # INVOCATION_ID but is not that service's own process: its jobs stay its children.
    assert job_unit.choose("auto", service, booted, found.get, pid=5000) == "direct"
    assert job_unit.under_systemd({"INVOCATION_ID": "x"}, booted, pid=5000, ppid=1) is True     # systemd < 248
    assert job_unit.under_systemd({"INVOCATION_ID": "x"}, booted, pid=5000, ppid=4999) is False
    assert job_unit.choose("direct", service, booted, found.get, pid=4242) == "direct"
    assert job_unit.choose("systemd", {}, booted, found.get) == "systemd"
    with pytest.raises(ConfigError, match="systemd-run or systemctl is not on PATH.*MCCL_LAUNCH_VIA=direct"):
        job_unit.choose("auto", service, booted, {}.get, pid=4242)
    with pytest.raises(ConfigError, match="MCCL_LAUNCH_VIA='unit'"):
        job_unit.choose("unit", service, booted, found.get)
    booted.rmdir()
    with pytest.raises(ConfigError, match="systemd is not the init system"):
        job_unit.choose("systemd", service, booted, found.get)
    assert job_unit.under_systemd(service, booted, pid=4242) is False
    assert job_unit.choose("auto") == "direct"          # this machine: PID 1 is not systemd


def test_the_systemd_run_command_lines():
    argv = ["/opt/py/bin/python", "-m", "torch.distributed.run", "train.py"]
    user = job_unit.systemd_run_command("mccl-job-j1-1.service", argv, "/srv/work", Path("/run/mccl/x/env.json"),
                                        user=True, stop_grace_s=10.0, python="/opt/mccl/venv/bin/python")
    assert user == ["systemd-run", "--user", "--unit", "mccl-job-j1-1.service", "--pipe", "--wait", "--collect",
                    "--quiet", "--working-directory", "/srv/work",
                    "--description", "MCCL job started by mccld (mccl-job-j1-1.service)",
                    "--property", "KillMode=control-group", "--property", "KillSignal=SIGTERM",
                    "--property", "SendSIGKILL=yes", "--property", "TimeoutStopSec=10",
                    "--", "/opt/mccl/venv/bin/python", "-m", "mccld.host.job_exec", "/run/mccl/x/env.json", "--",
                    *argv]
    system = job_unit.systemd_run_command("u.service", argv, "/srv/work", Path("/e"), user=False, uid=1001,
                                          gid=1002, groups=[1002, 27], python="py")
    assert "--user" not in system
    at = system.index("--")
    assert system[at - 6:at] == ["--uid", "1001", "--gid", "1002", "--property", "SupplementaryGroups=1002 27"]
    # Nothing of the job's environment is on the command line: ps shows it to every user.
    assert not [a for a in user + system if "=" in a and not a.startswith(
        ("KillMode", "KillSignal", "SendSIGKILL", "TimeoutStopSec", "SupplementaryGroups"))]
    assert job_unit.unit_name("run 1/ü", 7) == "mccl-job-run_1__-7.service"
    assert job_unit.manager_env(1000, {"PATH": "/bin"})["DBUS_SESSION_BUS_ADDRESS"] == "unix:path=/run/user/1000/bus"
    assert "XDG_RUNTIME_DIR" not in job_unit.manager_env(0, {"PATH": "/bin"})


def test_a_unit_tree_reads_the_units_cgroup_and_signals_through_systemctl(tmp_path, monkeypatch):
    cg = tmp_path / "user.slice/app.slice/mccl-job-j-1.service"
    cg.mkdir(parents=True)
    (cg / "cgroup.procs").write_text("4242\n4250\n")
    calls = []

    def fake(user, *args):
        calls.append((user, args))
        out = {"ControlGroup": "/user.slice/app.slice/mccl-job-j-1.service", "MainPID": "4242"}
        return subprocess.CompletedProcess(args, 0, out.get(args[2], "") + "\n" if args[0] == "show" else "", "")
    monkeypatch.setattr(job_unit, "_systemctl", fake)
    tree = job_unit.UnitTree("mccl-job-j-1.service", True, cgroup_root=tmp_path)
    assert tree.scan() == [4242, 4250] and tree.alive() == [4242, 4250] and tree.root == 4242
    assert tree.signal(signal.SIGKILL) == 2
    assert calls[-1] == (True, ("kill", "--signal", "SIGKILL", "mccl-job-j-1.service"))


def test_job_exec_runs_the_command_with_exactly_the_jobs_environment(tmp_path):
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps({"PATH": os.environ["PATH"], "ONLY": "this"}))
    res = subprocess.run([sys.executable, "-m", "mccld.host.job_exec", str(env_file), "--", sys.executable, "-c",
                          "import os; print(sorted(k for k in os.environ if k != 'LC_CTYPE'))"],
                         capture_output=True, text=True, timeout=30, env={**os.environ, "LEAK": "x"})
    assert res.returncode == 0 and res.stdout.strip() == "['ONLY', 'PATH']", res.stderr
    env_file.write_text("[1]")
    res = subprocess.run([sys.executable, "-m", "mccld.host.job_exec", str(env_file), "--", "true"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "not a JSON object of strings" in res.stderr


def _lease_and_drain(srv: LaunchServer, cwd: Path) -> tuple[list, int]:
    lz = Lease(f"127.0.0.1:{srv.port}", KEY, timeout_s=10.0)
    lz.open(LaunchRequest.parse({"job": "w1", "rdzv_endpoint": "10.0.0.1:29400", "nnodes": "1",
                                 "nproc_per_node": 1, "argv": ["python", "train.py"], "cwd": str(cwd)}))
    lines = []
    while True:
        event, data = lz.read()
        if event in ("out", "err"):
            lines.append((event, data))
        elif event == "exit":
            lz.close()
            return lines, data["code"]


def _server(tmp_path: Path, **kw) -> LaunchServer:
    return LaunchServer(KEY, "hostW", tmp_path / "rt", addr="127.0.0.1", port=0,
                        launch_user="root" if os.geteuid() == 0 else os.environ.get("USER") or
                        __import__("pwd").getpwuid(os.geteuid()).pw_name,
                        command=lambda req: [sys.executable, "-c", WRITER], **kw).start()


def test_a_job_started_as_mcclds_child_writes_in_its_working_directory(tmp_path):
    (tmp_path / "rt").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    srv = _server(tmp_path)
    try:
        lines, code = _lease_and_drain(srv, work)
    finally:
        srv.stop()
    assert code == 0 and ("out", "wrote") in lines
    assert (work / "saved.txt").read_text() == f"{work} hostW"


STAND_IN_RUN = r'''#!{python}
# Stands in for systemd-run: records its argv, then runs what follows "--" in --working-directory.
import json, os, sys
args = sys.argv[1:]
open({log!r}, "a").write(json.dumps(args) + "\n")
cwd = args[args.index("--working-directory") + 1]
cmd = args[args.index("--") + 1:]
os.chdir(cwd)
os.execv(cmd[0], cmd)
'''
STAND_IN_CTL = r'''#!{python}
import json, sys
open({log!r}, "a").write(json.dumps(sys.argv[1:]) + "\n")
'''


def test_a_job_started_as_a_unit_writes_in_its_working_directory(tmp_path, monkeypatch):
    """The launcher's unit path end to end, systemd-run and systemctl replaced by stand-ins."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    for name, text in (("systemd-run", STAND_IN_RUN), ("systemctl", STAND_IN_CTL)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable, log=str(log)))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / "rt").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    srv = _server(tmp_path, via="systemd")
    try:
        lines, code = _lease_and_drain(srv, work)
    finally:
        srv.stop()
    assert code == 0 and ("out", "wrote") in lines, lines
    assert (work / "saved.txt").read_text() == f"{work} hostW"
    run, stop = [json.loads(line) for line in log.read_text().splitlines()]
    unit = run[run.index("--unit") + 1]
    assert unit == "mccl-job-w1-1.service" and run[run.index("--working-directory") + 1] == str(work)
    assert ("--user" in run) == (os.geteuid() != 0)
    assert stop == [*(["--user"] if os.geteuid() != 0 else []), "stop", unit]   # the lease's end stops the unit
    assert list((tmp_path / "rt").glob("*.job")) == []       # its environment file went with the lease
