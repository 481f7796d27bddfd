"""Where a job that `mcclctl run` starts runs: as mccld's child, or as a systemd unit of its own.

Under systemd (packaging/linux/mccld.service) mccld runs in a sandbox: ProtectSystem=strict,
ProtectHome=read-only and PrivateTmp=yes hold for every process of its unit. A job started as
mccld's child would inherit them and could not save a checkpoint in its working directory or
home. So when mccld runs as a systemd service, each job runs as a transient service of its own
(``systemd-run``), outside mccld's unit and its sandbox: under the system manager when mccld is
root (systemd then switches to the job's user), else under the user manager of mccld's user
(``--user``; ``loginctl enable-linger`` keeps one running for a service account, and
packaging/linux/install.sh sets it when it sets up launching). Elsewhere (macOS, a shell, a
container) the job is mccld's child, as before.

``systemd-run --pipe --wait`` hands the job our pipes and returns its exit code, so the lease
streams output and reports the code exactly as for a child; stopping the job stops its unit,
which signals every process in the unit's cgroup, the workers torchrun started in sessions of
their own included. The job's environment goes through a 0600 file read by ``job_exec`` inside
the unit, never through systemd-run's arguments (``ps`` shows those to every user).

NOT VERIFIED UNDER SYSTEMD HERE: the development VM has no systemd (PID 1 is not systemd), so
the decision and the command lines below are tested, the job's own start through them is not.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from mccl_common.errors import ConfigError

log = logging.getLogger(__name__)

VIAS = ("auto", "direct", "systemd")
SYSTEMCTL_TIMEOUT_S = 10.0     # one systemctl call; a hung bus must not hold a lease forever
_UNIT_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def under_systemd(env: dict[str, str] | os._Environ = os.environ,
                  booted: Path = Path("/run/systemd/system"), pid: int | None = None,
                  ppid: int | None = None) -> bool:
    """Whether this process is a systemd service's own process: systemd is the init system
    (/run/systemd/system), set INVOCATION_ID for the unit, and exec'd us (SYSTEMD_EXEC_PID is our
    pid; before systemd 248, which lacks it: our parent is PID 1). A process merely started from
    inside some service (a CI runner's test run inherits its INVOCATION_ID) is not one."""
    if not env.get("INVOCATION_ID") or not booted.is_dir():
        return False
    pid = os.getpid() if pid is None else pid
    exec_pid = env.get("SYSTEMD_EXEC_PID", "")
    if exec_pid:
        return exec_pid == str(pid)
    return (os.getppid() if ppid is None else ppid) == 1


def choose(setting: str, env: dict[str, str] | os._Environ = os.environ,
           booted: Path = Path("/run/systemd/system"), which=shutil.which, pid: int | None = None) -> str:
    """"systemd" or "direct" for MCCL_LAUNCH_VIA=``setting``; ConfigError when "systemd" is asked
    for where it cannot work (no systemd, no systemd-run)."""
    if setting not in VIAS:
        raise ConfigError(f"[launch] MCCL_LAUNCH_VIA={setting!r}: use one of {', '.join(VIAS)}")
    if setting == "direct":
        return "direct"
    if setting == "auto" and not under_systemd(env, booted, pid):
        return "direct"
    if not booted.is_dir():
        raise ConfigError("[launch] MCCL_LAUNCH_VIA=systemd, but systemd is not the init system here; "
                          "use auto or direct")
    if which("systemd-run") is None or which("systemctl") is None:
        raise ConfigError("[launch] jobs are to run as systemd units (mccld is a systemd service, or "
                          "MCCL_LAUNCH_VIA=systemd), but systemd-run or systemctl is not on PATH; install "
                          "systemd's tools, or set MCCL_LAUNCH_VIA=direct (jobs then share mccld's sandbox)")
    return "systemd"


def unit_name(job: str, lease: int) -> str:
    """A transient unit's name for one lease: unique on this host, only characters units allow."""
    return f"mccl-job-{_UNIT_UNSAFE.sub('_', job)[:64]}-{lease}.service"


def user_manager(euid: int | None = None) -> bool:
    """True when jobs go to the user manager of mccld's user (mccld is not root)."""
    return (os.geteuid() if euid is None else euid) != 0


def manager_env(euid: int | None = None, base: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The environment systemd-run and systemctl need to find the manager: for the user manager,
    its runtime dir and bus (a service has no login session that would set them)."""
    env = {"PATH": base.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": base.get("LANG", "C.UTF-8")}
    uid = os.geteuid() if euid is None else euid
    if uid != 0:
        rdir = f"/run/user/{uid}"
        env["XDG_RUNTIME_DIR"] = rdir
        env["DBUS_SESSION_BUS_ADDRESS"] = f"unix:path={rdir}/bus"
    return env


def systemd_run_command(unit: str, argv: list[str], cwd: str, env_file: Path, *, user: bool,
                        uid: int | None = None, gid: int | None = None, groups: list[int] = (),
                        stop_grace_s: float = 10.0, python: str = sys.executable) -> list[str]:
    """The systemd-run line that runs ``argv`` in ``cwd`` as unit ``unit``, its environment
    exactly the one in ``env_file`` (read by job_exec inside the unit). ``user``: the user
    manager of mccld's user; else the system manager, running it as ``uid``/``gid``."""
    cmd = ["systemd-run", *(["--user"] if user else []), "--unit", unit, "--pipe", "--wait", "--collect",
           "--quiet", "--working-directory", cwd,
           "--description", f"MCCL job started by mccld ({unit})",
           # Stopping the unit signals every process in its cgroup (workers in sessions of their own
           # too): SIGTERM, then SIGKILL after the grace, as for a job that is mccld's child.
           "--property", "KillMode=control-group", "--property", "KillSignal=SIGTERM",
           "--property", "SendSIGKILL=yes", "--property", f"TimeoutStopSec={max(1, round(stop_grace_s))}"]
    if not user:
        if uid is None:
            raise ValueError("the system manager needs the job's uid")
        cmd += ["--uid", str(uid), "--gid", str(gid if gid is not None else uid)]
        if groups:
            cmd += ["--property", "SupplementaryGroups=" + " ".join(str(g) for g in groups)]
    return cmd + ["--", python, "-m", "mccld.host.job_exec", str(env_file), "--", *argv]


def write_env(job_dir: Path, env: dict[str, str], uid: int | None, gid: int | None) -> Path:
    """The job's environment as a JSON file only the job's user can read (its ``--env`` values may
    be secrets: they stay out of every command line)."""
    path = job_dir / "env.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(env, fh)
    if uid is not None:
        os.chown(path, uid, gid if gid is not None else -1)
    return path


def _systemctl(user: bool, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *(["--user"] if user else []), *args], capture_output=True, text=True,
                          timeout=SYSTEMCTL_TIMEOUT_S, env=manager_env(), check=False)


def stop(unit: str, user: bool) -> None:
    """Stop the unit (SIGTERM to its cgroup, SIGKILL after its TimeoutStopSec); a unit already
    gone is fine. Bounded: systemctl waits for the stop, so the timeout covers the grace."""
    try:
        res = subprocess.run(["systemctl", *(["--user"] if user else []), "stop", unit], capture_output=True,
                             text=True, timeout=SYSTEMCTL_TIMEOUT_S + 30.0, env=manager_env(), check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("[launch] cannot stop job unit %s: %s", unit, e)
        return
    if res.returncode != 0 and "not loaded" not in res.stderr:
        log.warning("[launch] systemctl stop %s: %s", unit, res.stderr.strip()[-300:])


class UnitTree:
    """A job unit's processes, for background priority and the reclaim deadline: the same
    ``scan``/``signal``/``alive``/``root`` as proctree.JobTree, read from the unit's cgroup."""

    def __init__(self, unit: str, user: bool, cgroup_root: Path = Path("/sys/fs/cgroup")):
        self.unit, self.user, self._cgroup_root = unit, user, cgroup_root

    def _show(self, prop: str) -> str:
        try:
            return _systemctl(self.user, "show", "--property", prop, "--value", self.unit).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    @property
    def root(self) -> int:
        main = self._show("MainPID")
        return int(main) if main.isdigit() else 0

    def scan(self) -> list[int]:
        cgroup = self._show("ControlGroup")
        if not cgroup:
            return []
        try:
            text = (self._cgroup_root / cgroup.lstrip("/") / "cgroup.procs").read_text()
        except OSError:
            return []
        return sorted(int(p) for p in text.split() if p.isdigit())

    def signal(self, sig: int) -> int:
        pids = self.scan()
        if pids:
            try:
                _systemctl(self.user, "kill", "--signal", signal.Signals(sig).name, self.unit)
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("[launch] cannot signal job unit %s: %s", self.unit, e)
                return 0
        return len(pids)

    def alive(self) -> list[int]:
        return self.scan()
