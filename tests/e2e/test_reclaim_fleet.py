"""Issue 25, as a new user meets it: a harvested host goes back to its user within the reclaim
grace, whatever the job. Three real mcclds on loopback (each its own host id, runtime dir,
ports and activity file), ``mcclctl run`` of examples/count_steps.py (a plain script: one
all-reduce per step, its own step checkpoint, no libmccl.elastic) or examples/elastic_train.py.
Mid-job one host's activity file is touched: its user is back. Its job processes must drop to
background priority before the grace ends (within about a second on an idle machine: the
activity is sampled every second while a job runs; each test prints it. A bound of one second
failed at 1.03 s beside the rest of the suite on 2 cores, so the event asserted is "lowered
before the grace ran out") and be
gone within MCCL_RECLAIM_GRACE + 10 s; the job finishes on the others."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest

from support.daemon import stop_process
from support.elastic import FLEET_KEY, PY, job_pids, run_elastic, start_hosts, steps_of
from support.reclaim import COUNT_LINE, SCRIPT, Watch, run_plain

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")]

GRACE_S = 5.0


@pytest.fixture
def grace(monkeypatch):
    # Inherited by the mcclds start_hosts starts.
    monkeypatch.setenv("MCCL_RECLAIM_GRACE", str(GRACE_S))
    return GRACE_S


def _finish(run, hosts, watch: Watch | None = None) -> None:
    if watch is not None:
        watch.stop()
    if run is not None:
        stop_process(run)
        run.stdout.close()
    hosts.stop()


def _capacity(hosts, name: str) -> dict:
    """``mcclctl capacity --json``'s harvest object of host ``name``."""
    out = subprocess.run([PY, "-m", "mcclctl", "capacity", "--json", *hosts.args], capture_output=True, text=True,
                         env={**os.environ, "MCCL_FLEET_KEY": FLEET_KEY}, timeout=60)
    for d in json.loads(out.stdout)["daemons"]:
        if d["capacity"] and d["capacity"].get("host") == name:
            return d["capacity"]["harvest"]
    raise AssertionError(f"no capacity of {name}: {out.stdout}{out.stderr}")


def _report(watch: Watch) -> str:
    return watch.report()


def test_a_plain_script_is_removed_from_a_reclaimed_host_and_finishes_on_the_others(tmp_path, grace):
    hosts = start_hosts(tmp_path, ["h1", "h2", "h3"])
    run, watch = None, Watch("h3", str(SCRIPT))
    try:
        run = run_plain(hosts, 2, 3, 80, tmp_path / "ckpt.json")
        lines = []
        for line in run.stdout:
            lines.append(line.rstrip())
            m = COUNT_LINE.search(line)
            if m and m.group(2) == "3" and int(m.group(1)) >= 12 and watch.touched is None:
                watch.touch(hosts.activity["h3"])
        rc = run.wait(timeout=60)
        watch.stop()
        text = "\n".join(lines)
        assert rc == 0, text
        assert watch.touched and watch.lowered and watch.gone, text
        assert watch.lowered - watch.touched < grace, _report(watch) + "\n" + text
        assert watch.gone - watch.touched <= grace + 10.0, _report(watch) + "\n" + text
        assert "[h3] [mcclctl] reclaimed" in text and "DONE" in text, text
        counted = [(int(s), int(w)) for s, w in COUNT_LINE.findall(text)]
        assert counted[-1] == (79, 2), text             # the run ended in the smaller world
        assert {s for s, _ in counted} == set(range(80)), text
        # What the user and the fleet's operator see afterwards: how long the hand-back took.
        h3 = _capacity(hosts, "h3")
        assert h3["state"] == "busy" and h3["last_reclaim"]["how"] == "removed", h3
        assert h3["last_reclaim"]["seconds"] <= grace + 10.0, h3
        print(_report(watch))
    finally:
        _finish(run, hosts, watch)


def test_an_elastic_script_still_leaves_at_its_step_boundary_without_a_restart(tmp_path, grace):
    hosts = start_hosts(tmp_path, ["h1", "h2", "h3"])
    run, watch = None, Watch("h3", "elastic_train.py")
    try:
        run = run_elastic(hosts, tmp_path / "ckpt", 40, 2, 3)
        lines = []
        for line in run.stdout:
            lines.append(line.rstrip())
            m = re.search(r"step (\d+) loss [0-9.]+ world 3", line)
            if m and int(m.group(1)) >= 5 and watch.touched is None:
                watch.touch(hosts.activity["h3"])
        rc = run.wait(timeout=60)
        watch.stop()
        text = "\n".join(lines)
        assert rc == 0, text
        assert "left after step" in text and "reclaimed" not in text, text
        assert "re-forming in place" in text and "exitcode: 75" not in text, text
        assert [s for s, _, _ in steps_of(text)] == list(range(40)), text
        assert watch.lowered is not None and watch.lowered - watch.touched < grace, _report(watch)
        print(_report(watch))
    finally:
        _finish(run, hosts, watch)


def _worker_started(host: str) -> bool:
    """A process of the job on ``host`` that is not torchrun itself: a worker."""
    for pid in job_pids(host, str(SCRIPT)):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"torch.distributed.run" not in cmd:
            return True
    return False


def test_a_user_back_during_start_up_gets_the_host_back_and_the_job_runs_on_the_others(tmp_path, grace):
    hosts = start_hosts(tmp_path, ["h1", "h2", "h3"])
    run, watch = None, Watch("h3", str(SCRIPT))
    try:
        run = run_plain(hosts, 2, 3, 40, tmp_path / "ckpt.json")
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(line.rstrip() for line in run.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        # h3's worker started: the job is starting up, its workers importing torch and meeting
        # in init_process_group. Not earlier: a host reclaimed in the moment torchrun's agents
        # assign the workers' ranks
        # (after the round formed, before the workers start) makes the other agents fail on
        # its missing rank table (torch's DistStoreError, no re-rendezvous): a known gap
        # (docs/harvesting.md), seen once in five suite runs (7 Dec).
        while not _worker_started("h3"):
            assert time.monotonic() < deadline and run.poll() is None, "\n".join(out)
            time.sleep(0.05)
        watch.touch(hosts.activity["h3"])
        try:
            rc = run.wait(timeout=200)
        except subprocess.TimeoutExpired:
            stop_process(run)
            rc = None
        reader.join(timeout=30)
        watch.stop()
        text = "\n".join(out)
        assert rc == 0, text
        assert watch.gone is not None and watch.gone - watch.touched <= grace + 10.0, text
        assert watch.lowered is not None and watch.lowered - watch.touched < grace, _report(watch)
        assert "DONE" in text and COUNT_LINE.findall(text)[-1] == ("39", "2"), text
        # Whether h3 left before or after the first round formed, no worker waited out
        # init_process_group's timeout for its address: the others restart theirs when h3's
        # keep-alives stop (libmccl/elastic/rdzv.py, "host(s) of this round left").
        assert "Timed out after" not in text, text
        print(_report(watch))
    finally:
        _finish(run, hosts, watch)


def test_a_job_of_exactly_min_hosts_ends_saying_why_instead_of_hanging(tmp_path, grace):
    hosts = start_hosts(tmp_path, ["h1", "h2"])
    run, watch = None, Watch("h2", str(SCRIPT))
    try:
        run = run_plain(hosts, 2, 2, 400, tmp_path / "ckpt.json")
        lines = []
        for line in run.stdout:
            lines.append(line.rstrip())
            m = COUNT_LINE.search(line)
            if m and int(m.group(1)) >= 5 and watch.touched is None:
                watch.touch(hosts.activity["h2"])
        rc = run.wait(timeout=60)
        ended = time.monotonic()
        text = "\n".join(lines)
        assert rc == 1, text
        assert "was handed back to its user" in text and "needs at least 2 (--min)" in text, text
        assert ended - watch.touched <= grace + 10.0 + 15.0, text      # + the other host's cancel
        deadline = time.monotonic() + 30
        while (job_pids("h1", str(SCRIPT)) or job_pids("h2", str(SCRIPT))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not job_pids("h1", str(SCRIPT)) and not job_pids("h2", str(SCRIPT))
    finally:
        _finish(run, hosts, watch)
