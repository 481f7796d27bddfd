"""Issue 13's leaving and joining host, end to end: ``mcclctl run --min 1 --max 2`` on two real
mcclds (loopback, each with its own activity file). Mid-run host h2's user "comes back" (its
activity file is touched): its mccld drains it, the job saves at the next step boundary, h2
leaves, the world re-forms on h1 alone and resumes from that step. The user goes again: h2 turns
idle (MCCL_IDLE_AFTER), mcclctl leases it again, and the job takes it in after its current step.
The loss curve must be the one of an uninterrupted run with the same global batch: every step
once, none repeated or skipped, the same losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.daemon import stop_process

pytestmark = pytest.mark.timeout(240)

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
FLEET_KEY = "test-key-" + "x" * 16
STEPS = 80
IDLE_AFTER_S = 3


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference_losses() -> dict[int, float]:
    """The same script's loss per step in one process with the whole global batch."""
    code = f"""
import sys; sys.path.insert(0, {str(REPO / 'examples')!r})
import torch, elastic_train as t
net = t.model(); opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
for s in range({STEPS}):
    x, y = t.batch(s, 64, 0, 1); opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), y); loss.backward(); opt.step(); sched.step()
    print(s, f"{{loss.item():.6f}}")
"""
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    return {int(a): float(b) for a, b in (line.split() for line in out.splitlines())}


def test_a_host_whose_user_returns_leaves_and_rejoins_when_idle_again(tmp_path):
    key = tmp_path / "submit.key"
    key.write_text("submit-" + os.urandom(16).hex())
    key.chmod(0o600)
    old = time.time() - 7200
    procs, hosts, activity, run = [], [], {}, None
    try:
        for i in (1, 2):
            act = activity[f"h{i}"] = tmp_path / f"activity-h{i}"
            act.touch()
            os.utime(act, (old, old))
            status = _free_port()
            env = {**os.environ, "MCCL_RUNTIME_DIR": str(tmp_path / f"h{i}"), "MCCL_FLEET_KEY": FLEET_KEY,
                   "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": str(status),
                   "MCCL_METRICS_PORT": "0", "MCCL_LAUNCH_PORT": str(_free_port()), "MCCL_HOST_ID": f"h{i}",
                   "MCCL_SUBMIT_KEY_FILE": str(key), "MCCL_ACTIVITY_FILE": str(act),
                   "MCCL_IDLE_AFTER": str(IDLE_AFTER_S), "MCCL_HARVEST_POLL": "0.25",
                   "MCCL_LAUNCH_USER": "root" if os.geteuid() == 0 else ""}
            procs.append(subprocess.Popen([PY, "-m", "mccld"], env=env, stderr=subprocess.DEVNULL))
            hosts += ["--host", f"127.0.0.1:{status}"]
        deadline = time.monotonic() + 30
        for i in (1, 2):
            while not (tmp_path / f"h{i}" / "token").exists():
                assert time.monotonic() < deadline, "mccld did not start"
                time.sleep(0.1)
        reference = _reference_losses()
        run = subprocess.Popen(
            [PY, "-m", "mcclctl", "run", "--min", "1", "--max", "2", *hosts, "--submit-key-file", str(key),
             "--recruit-every", "1", "--env", "OMP_NUM_THREADS=1", "--env", "MCCL_RDZV_LAST_CALL=1", "--",
             "python", str(REPO / "examples" / "elastic_train.py"), "--steps", str(STEPS),
             "--ckpt", str(tmp_path / "ckpt"), "--every", "50", "--step-time", "0.1"],
            cwd=tmp_path, env={**os.environ, "MCCL_FLEET_KEY": FLEET_KEY},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, touched, left_at, resumed_at, joined_at, regrown_at = [], None, None, None, None, None
        for line in run.stdout:
            lines.append(line.rstrip())
            m = re.search(r"step (\d+) loss [0-9.]+ world 2", line)
            if m and int(m.group(1)) >= 5 and touched is None:
                activity["h2"].touch()          # h2's user is back
                touched = time.monotonic()
            if "left after step" in line and left_at is None:
                left_at = time.monotonic()
            if "world 1 on h1: resumed" in line and resumed_at is None:
                resumed_at = time.monotonic()
            if "[mcclctl] joined" in line and joined_at is None:
                joined_at = time.monotonic()
            if joined_at and re.search(r"world 2 on h\d: resumed", line) and regrown_at is None:
                regrown_at = time.monotonic()
        rc = run.wait(timeout=60)
        text = "\n".join(lines)
        assert rc == 0, text
        assert touched and left_at and resumed_at and joined_at and regrown_at, text
        steps = [(int(a), float(b), int(w)) for a, b, w in re.findall(r"step (\d+) loss ([0-9.]+) world (\d)", text)]
        assert [s for s, _, _ in steps] == list(range(STEPS)), text       # each step once, in order
        worlds = [w for i, (_, _, w) in enumerate(steps) if i == 0 or steps[i - 1][2] != w]
        assert worlds == [2, 1, 2], text                                   # shrank, then grew back
        for s, loss, _ in steps:
            assert abs(loss - reference[s]) < 1e-4, (s, loss, reference[s])
        # The target: out within one step plus 5 s of the user's return.
        assert left_at - touched < 0.15 + 5.0, text
        print("\n".join(line for line in lines if "loss" not in line))
        print(f"left {left_at - touched:.2f} s after the activity; resumed {resumed_at - left_at:.2f} s later; "
              f"leased again {joined_at - touched:.2f} s after the activity; resumed with it "
              f"{regrown_at - joined_at:.2f} s after that")
    finally:
        if run is not None:
            stop_process(run)
            run.stdout.close()
        for p in procs:
            stop_process(p)
