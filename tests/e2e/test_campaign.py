"""The short fault campaign (scripts/faults/campaign.py) in both modes, as CI runs it.

Issue 11 asks for >= 100 trials per mode in CI. A trial mostly waits: out a 2 s timeout, and
in daemon mode the daemons' 2 s verdict grace as well (about 4 s a trial), so the trials run
as campaigns side by side (``--shards``): two in-process and four daemon campaigns, each on its
own fleet, took 2 min together on this 2-core VM (one and two took 3.8 min in CI).
Fixed seeds: a failure replays with ``--mode M --seed S --trials 1``; each test below
asserts one target on a mode's summary.

Every target here is an event: each survivor raised the fault's named error (not a
fallback's timeout), named the culprit, before the hang deadline; nothing corrupted, leaked
or grew. How soon after the fault the errors came (the campaign's ``late``, against the
timeout + 3 s) is a latency, measured and reported by the campaign (``detect_s`` per kind)
but not asserted in CI: on a 2-core machine beside the rest of the suite a SIGSTOPped
mccld's ranks once answered 5.12 s after the fault against 5.0 s. Their detection is the
client's ZeroMQ heartbeat (1 s interval, 3 s timeout: up to ~4 s by design), so the bound
left one second for scheduling; the hang deadline (the timeout + 13 s) keeps the "nothing
hangs" promise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.fleet import skip_unless_fleet

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 100
RUNS = (("inproc", 2), ("daemon", 4))    # (mode, campaigns side by side: --shards)
RUN_TIMEOUT_S = 840
MODES = sorted(mode for mode, _ in RUNS)

pytestmark = [pytest.mark.fleet, pytest.mark.slow]




@pytest.fixture(scope="module")
def summaries(tmp_path_factory) -> dict[str, dict]:
    """Both modes at once: their trials mostly wait out timeouts, so six campaigns share two cores well."""
    skip_unless_fleet()
    out = tmp_path_factory.mktemp("campaign")
    procs = {}
    for mode, shards in RUNS:
        procs[mode] = subprocess.Popen([sys.executable, str(ROOT / "scripts/faults/campaign.py"), "--mode", mode,
                                        "--trials", str(TRIALS), "--seed", "1", "--shards", str(shards),
                                        "--json", str(out / f"{mode}.json")],
                                       stdout=open(out / f"{mode}.log", "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True)
    try:
        for p in procs.values():
            p.wait(RUN_TIMEOUT_S)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)    # each campaign's Fleet tears down on the way out
                p.wait(60)
    found = {}
    for mode in procs:
        log = (out / f"{mode}.log").read_text()
        assert (out / f"{mode}.json").exists(), f"the {mode} campaign wrote no summary:\n{log[-4000:]}"
        found[mode] = {**json.loads((out / f"{mode}.json").read_text()), "_output": log[-8000:]}
    return found


@pytest.fixture(params=MODES)
def summary(request, summaries) -> dict:
    return summaries[request.param]


def _failures(s: dict, category: str) -> str:
    return f"{category} in {s['mode']} mode: {s['total']}\n{s['_output']}"


@pytest.mark.timeout(900)
def test_every_trial_ran_and_no_rank_hung(summary):
    assert summary["total"]["trials"] == TRIALS and summary["total"]["setup"] == 0, _failures(summary, "setup")
    assert summary["total"]["hangs"] == 0, _failures(summary, "hangs")
    assert len(summary["kinds"]) >= 4, summary["kinds"]


@pytest.mark.timeout(900)
def test_no_result_was_wrong(summary):
    assert summary["total"]["corrupted"] == 0, _failures(summary, "corrupted")


@pytest.mark.timeout(900)
def test_every_survivor_raised_the_named_error_of_its_fault(summary):
    assert summary["total"]["wrong_errors"] == 0, _failures(summary, "wrong errors")


@pytest.mark.timeout(900)
def test_nothing_leaked(summary):
    assert summary["total"]["leaks"] == 0 and not summary["namespaces_left"], _failures(summary, "leaks")


@pytest.mark.timeout(900)
def test_daemons_give_back_a_failed_jobs_threads_and_fds(summary):
    assert summary["total"]["daemon_growth"] == 0, _failures(summary, "daemon growth")
