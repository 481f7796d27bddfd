"""``mcclctl run`` against two real mccld processes on loopback (two emulated hosts, each with
its own host id, runtime dir and ports): the job runs one torchrun per host through the mccl
rendezvous and a real all-reduce, every output line comes back with its host's prefix, and
Ctrl-C stops every host's job and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.elastic import FLEET_KEY, PY, start_hosts

pytestmark = pytest.mark.timeout(180)

TRAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("mccl")
t = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} on {os.environ['MCCL_HOST_ID']}: sum {t[0].item()}")
dist.destroy_process_group()
"""

LONG = """
import sys, time, torch.distributed as dist
dist.init_process_group("mccl")
for i in range(600):
    print(f"step {i} rank {dist.get_rank()}", flush=True)
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    hosts = start_hosts(root, ["h1", "h2"])   # idle, under the loopback fleets' turn
    try:
        (root / "train.py").write_text(TRAIN)
        (root / "long.py").write_text(LONG)
        yield root, hosts.key, hosts.args
    finally:
        hosts.stop()


def _run(root: Path, key: Path, host_args: list[str], script: str, **popen) -> subprocess.Popen:
    cmd = [PY, "-m", "mcclctl", "run", "-n", "2", "--submit-key-file", str(key), "--env", "OMP_NUM_THREADS=1",
           *host_args]
    # The script by its full path: the check for leftovers looks for it in command lines.
    return subprocess.Popen(cmd + ["--", "python", str(root / script)], cwd=root, env={**os.environ, "MCCL_FLEET_KEY": FLEET_KEY},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_job_runs_on_two_leased_hosts_and_their_output_comes_back_prefixed(fleet):
    root, key, hosts = fleet
    proc = _run(root, key, hosts, "train.py")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    # The rendezvous decides which host gets rank 0.
    lines = sorted(out.splitlines())
    assert lines in (["[h1] rank 0/2 on h1: sum 3.0", "[h2] rank 1/2 on h2: sum 3.0"],
                     ["[h1] rank 1/2 on h1: sum 3.0", "[h2] rank 0/2 on h2: sum 3.0"]), (out, err)
    assert "finished: h1=0, h2=0" in err


def test_ctrl_c_stops_every_hosts_job_and_leaves_nothing_behind(fleet):
    root, key, hosts = fleet
    # As from a terminal: a suite started in the background (nohup ... &) hands its children
    # SIGINT ignored, and Python then never raises KeyboardInterrupt.
    proc = _run(root, key, hosts, "long.py", start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: set[str] = set()
    deadline = time.monotonic() + 90
    while seen != {"h1", "h2"} and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "] step " in line:
            seen.add(line[1:3])
    # What the checks below look for: the job's processes and its rendezvous anchor.
    assert seen == {"h1", "h2"} and _count(str(root / "long.py")) >= 2
    assert _count("libmccl.elastic.rdzv", under=root) >= 1
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)       # reading on: a closed pipe would be a second way out
    assert proc.returncode == 130, err
    assert "interrupted: every host's job was stopped" in err
    deadline = time.monotonic() + 30
    while _count(str(root / "long.py")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _count(str(root / "long.py")) == 0 and _count("libmccl.elastic.rdzv", under=root) == 0


def _count(pattern: str, under: Path | None = None) -> int:
    """Processes whose command line has ``pattern`` (and, with ``under``, whose working directory
    is there: other test workers run rendezvous anchors of their own, ci14 counted one)."""
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    pids = [int(p) for p in r.stdout.split() if int(p) != os.getpid()]
    if under is not None:
        pids = [p for p in pids if _cwd(p).startswith(str(under))]
    return len(pids)


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""   # gone, or not ours to read
