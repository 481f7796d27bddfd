"""Elastic runs end to end on loopback: real mcclds standing for hosts (each its own host id,
runtime dir, ports and activity file), ``mcclctl run`` of examples/elastic_train.py, and the
losses of the same script run without interruption to compare with."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.daemon import stop_process
from support.ranks import free_port

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
FLEET_KEY = "test-key-" + "x" * 32     # key_material refuses keys under 32 bytes
STEP_LINE = re.compile(r"step (\d+) loss ([0-9.]+) world (\d+)")
# mDNS names an mccld by its MCCL_HOST_ID machine-wide, whatever its fleet: a second mccld of
# h1 exits at start ("cannot advertise h1"), as one did when the suite's workers ran
# test_run_fleet.py beside an elastic test (ci10). These fleets keep the names h1, h2, h3 that
# their tests read in the jobs' output, so one such fleet runs at a time across the workers.
# job_pids looks across the machine too: test_elastic_fleet.py's namespaced h2 takes a turn.
_FLEET_LOCK = Path(tempfile.gettempdir()) / "mccl-test-loopback-fleet.lock"
_FLEET_LOCK_WAIT_S = 900.0   # the longest holder, a module of elastic runs, takes a few minutes


@contextlib.contextmanager
def loopback_fleet_turn():
    """Held while a loopback fleet of fixed host ids runs (see ``_FLEET_LOCK``)."""
    fd = os.open(_FLEET_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + _FLEET_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, \
                    f"another test's loopback fleet held {_FLEET_LOCK} for {_FLEET_LOCK_WAIT_S:.0f} s"
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)   # releases the lock


@dataclass
class Hosts:
    """mcclds on loopback; ``activity[name]`` is the file whose touch means "the user is back"."""
    root: Path
    key: Path
    procs: list = field(default_factory=list)
    args: list = field(default_factory=list)       # --host ADDR for each, for mcclctl
    activity: dict = field(default_factory=dict)
    turn: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)
        self.turn.close()


def start_hosts(root: Path, names: list[str], idle_after_s: float = 60.0) -> Hosts:
    key = root / "submit.key"
    key.write_text("submit-" + os.urandom(16).hex())
    key.chmod(0o600)
    hosts = Hosts(root, key)
    hosts.turn.enter_context(loopback_fleet_turn())
    old = time.time() - 7200            # nobody touched these hosts for two hours: idle
    try:
        for name in names:
            act = hosts.activity[name] = root / f"activity-{name}"
            act.touch()
            os.utime(act, (old, old))
            status = free_port()
            env = {**os.environ, "MCCL_RUNTIME_DIR": str(root / name), "MCCL_FLEET_KEY": FLEET_KEY,
                   "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": str(status),
                   "MCCL_METRICS_PORT": "0", "MCCL_LAUNCH_PORT": str(free_port()), "MCCL_HOST_ID": name,
                   "MCCL_SUBMIT_KEY_FILE": str(key), "MCCL_ACTIVITY_FILE": str(act),
                   "MCCL_IDLE_AFTER": str(idle_after_s), "MCCL_HARVEST_POLL": "0.25",
                   # python here is not executable by other users; a real mccld runs jobs as its service user
                   "MCCL_LAUNCH_USER": "root" if os.geteuid() == 0 else ""}
            with open(root / f"mccld-{name}.log", "w") as log:
                hosts.procs.append(subprocess.Popen([PY, "-m", "mccld"], env=env, stderr=log))
            hosts.args += ["--host", f"127.0.0.1:{status}"]
        deadline = time.monotonic() + 30
        for name in names:
            while not (root / name / "token").exists():
                assert time.monotonic() < deadline, \
                    f"mccld {name} did not start: {(root / f'mccld-{name}.log').read_text()[-2000:]}"
                time.sleep(0.1)
    except BaseException:
        hosts.stop()
        raise
    return hosts


def run_elastic(hosts: Hosts, ckpt: Path, steps: int, n_min: int, n_max: int, *extra: str,
                every: int = 50, step_time: float = 0.1, timeout_s: float = 60.0,
                ctl_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``mcclctl run`` of examples/elastic_train.py, its output (both streams) on stdout."""
    return subprocess.Popen(
        [PY, "-m", "mcclctl", "run", "--min", str(n_min), "--max", str(n_max), *hosts.args,
         "--submit-key-file", str(hosts.key), *ctl_args,
         "--env", "OMP_NUM_THREADS=1", "--env", "MCCL_RDZV_LAST_CALL=1", "--",
         "python", str(REPO / "examples" / "elastic_train.py"), "--steps", str(steps), "--ckpt", str(ckpt),
         "--every", str(every), "--step-time", str(step_time), "--timeout", str(timeout_s), *extra],
        cwd=hosts.root, env={**os.environ, "MCCL_FLEET_KEY": FLEET_KEY},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reference_losses(steps: int) -> dict[int, float]:
    """The same script's loss per step in one process with the whole global batch."""
    code = f"""
import sys; sys.path.insert(0, {str(REPO / 'examples')!r})
import torch, elastic_train as t
net = t.model(); opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
for s in range({steps}):
    x, y = t.batch(s, t.GLOBAL_BATCH, 0, 1); opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), y); loss.backward(); opt.step(); sched.step()
    print(s, f"{{loss.item():.6f}}")
"""
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    return {int(a): float(b) for a, b in (line.split() for line in out.splitlines())}


def steps_of(text: str) -> list[tuple[int, float, int]]:
    """(step, loss, world) of every step line, in order."""
    return [(int(a), float(b), int(w)) for a, b, w in STEP_LINE.findall(text)]


def job_pids(host: str, needle: str) -> list[int]:
    """Processes whose command line has ``needle`` and whose environment says MCCL_HOST_ID=host."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in cmd and f"MCCL_HOST_ID={host}".encode() in env:
            found.append(int(d.name))
    return found
