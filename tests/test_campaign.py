"""The short fault campaign (scripts/faults/campaign.py) in both modes, as CI runs it.

One module-scoped run per mode (>= 100 trials, a fixed seed so a failure replays with
``--seed``); each test below asserts one of the brief's targets on its summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 100
SEEDS = {"inproc": 1, "daemon": 1}
RUN_TIMEOUT_S = {"inproc": 420, "daemon": 840}

pytestmark = [pytest.mark.fleet, pytest.mark.slow]


def _skip_unless_fleet() -> None:
    from libmccl.errors import ConfigError
    from libmccl.fleet import check_prerequisites
    try:
        check_prerequisites()
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=sorted(SEEDS))
def summary(request, tmp_path_factory) -> dict:
    _skip_unless_fleet()
    mode = request.param
    out = tmp_path_factory.mktemp(f"campaign-{mode}") / "summary.json"
    from conftest import run_command
    res = run_command([sys.executable, str(ROOT / "scripts/faults/campaign.py"), "--mode", mode,
                       "--trials", str(TRIALS), "--seed", str(SEEDS[mode]), "--json", str(out)],
                      timeout_s=RUN_TIMEOUT_S[mode])
    assert out.exists(), f"the campaign wrote no summary (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    s = json.loads(out.read_text())
    s["_output"] = res.stdout[-6000:]
    return s


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
def test_every_survivor_raised_its_error_within_the_timeout_plus_3s(summary):
    assert summary["total"]["late"] == 0, _failures(summary, "late")


@pytest.mark.timeout(900)
def test_every_survivor_raised_the_named_error_of_its_fault(summary, request):
    if summary["mode"] == "daemon":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "mccld: after a link down every rank gets the engine's bare '[engine] Timed out after 2.0 s "
            "waiting for op #N; it is still running' (the daemon's engine.wait gives up at the op's own "
            "timeout), naming neither the silent host nor its ranks")))
    assert summary["total"]["wrong_errors"] == 0, _failures(summary, "wrong errors")


@pytest.mark.timeout(900)
def test_nothing_leaked(summary):
    assert summary["total"]["leaks"] == 0 and not summary["namespaces_left"], _failures(summary, "leaks")


@pytest.mark.timeout(900)
def test_daemons_give_back_a_failed_jobs_threads_and_fds(summary, request):
    if summary["mode"] == "daemon":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "mccld keeps about 3 threads and 8 pipe fds after each failed two-host job (measured by the "
            "campaign; clean jobs give theirs back, scripts/soak.py); cause not found yet")))
    assert summary["total"]["daemon_growth"] == 0, _failures(summary, "daemon growth")
