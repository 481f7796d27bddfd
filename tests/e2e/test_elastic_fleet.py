"""Issue 13's cable pulled mid-run, on an emulated fleet: three namespaces, an mccld each,
``mcclctl run --min 2 --max 3`` submitted from host 0 (found over mDNS). Host 2's link goes
down without a FIN or a reset: the others' collectives time out (--timeout 3), mcclctl hears
nothing from host 2's mccld and drops it, the rendezvous drops its silent torchrun, and the two
others resume from the last checkpoint and finish; host 2's mccld, cut off from its client,
stops its half of the job. Every step's loss is the uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.elastic import REPO, job_pids, loopback_fleet_turn, reference_losses, steps_of
from support.fleet import DaemonFleet, skip_unless_fleet

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(240)]

STEPS = 60
EVERY = 5


def test_a_cut_link_drops_the_host_and_the_others_finish_from_the_last_checkpoint(tmp_path):
    skip_unless_fleet()
    key = tmp_path / "submit.key"
    key.write_text("submit-key-" + "s" * 24)
    key.chmod(0o600)
    activity = tmp_path / "activity"
    activity.touch()
    old = time.time() - 7200
    os.utime(activity, (old, old))              # nobody touched these hosts for two hours: idle
    env = {"MCCL_SUBMIT_KEY_FILE": str(key), "MCCL_ACTIVITY_FILE": str(activity), "MCCL_HARVEST_POLL": "0.25",
           "MCCL_LAUNCH_USER": "root", "MCCL_STATUS_PORT": "29651"}   # the default: the fleet helper turns it off
    reference = reference_losses(STEPS)
    # Its hosts are h0..h2 running elastic_train.py, as the loopback elastic tests' are, and
    # job_pids finds a host's job by those two across the machine: one of them at a time.
    with loopback_fleet_turn(), DaemonFleet(3, extra_env=env) as df:
        ctl_env = {**df.env(0), "PYTHONPATH": str(REPO)}
        deadline = time.monotonic() + 45
        while True:     # the daemons announce themselves over mDNS and sample their activity first
            r = df.fleet.run(0, [sys.executable, "-m", "mcclctl", "capacity", "--json"], timeout=30, env=ctl_env)
            idle = json.loads(r.stdout)["harvestable"]["hosts"] if r.returncode == 0 else []
            if len(idle) == 3:
                break
            assert time.monotonic() < deadline, f"three idle hosts not found over mDNS: {r.stdout} {r.stderr}"
            time.sleep(1)
        run = df.fleet.popen(0, [sys.executable, "-m", "mcclctl", "run", "--min", "2", "--max", "3",
                                 "--submit-key-file", str(key), "--env", "OMP_NUM_THREADS=1",
                                 "--env", "MCCL_RDZV_LAST_CALL=1", "--",
                                 "python", str(REPO / "examples" / "elastic_train.py"), "--steps", str(STEPS),
                                 "--ckpt", str(tmp_path / "ckpt"), "--every", str(EVERY), "--step-time", "0.1",
                                 "--timeout", "3"],
                             env=ctl_env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        ns2 = df.fleet.hosts[2].ns
        lines, cut, resumed = [], None, None
        try:
            for line in run.stdout:
                lines.append(line.rstrip())
                s = steps_of(line)
                if cut is None and s and s[0][0] >= 10 and s[0][2] == 3:
                    subprocess.run(["ip", "-n", ns2, "link", "set", "eth0", "down"], check=True, timeout=10)
                    cut = time.monotonic()
                if cut and resumed is None and "world 2 on" in line and "resumed" in line:
                    resumed = time.monotonic()
            rc = run.wait(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(10)
            run.stdout.close()
        text = "\n".join(lines)
        assert rc == 0, text
        assert cut and resumed, text
        assert "[h2] [mcclctl] lost this host (no word from its mccld" in text, text
        steps = steps_of(text)
        assert sorted({s for s, _, _ in steps}) == list(range(STEPS)), text      # none skipped
        for s, loss, _ in steps:
            assert abs(loss - reference[s]) < 1e-4, (s, loss, reference[s])    # repeats are identical
        assert steps[-1][2] == 2, text
        # Host 2's mccld lost its client: it stops its half of the job by itself.
        deadline = time.monotonic() + 30
        while job_pids("h2", "elastic_train.py") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not job_pids("h2", "elastic_train.py"), df.log(2)[-3000:]
        print(f"the others resumed {resumed - cut:.1f} s after the cut")
