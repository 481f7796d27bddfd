"""A one-minute soak (scripts/soak.py): DDP through mccld on two emulated hosts, every
step's gradients and every epoch's parameters checked, the daemons flat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.fleet
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_minute_soak_is_correct_and_flat(tmp_path):
    from mccl_common.errors import ConfigError
    from tools.fleet import check_prerequisites
    try:
        check_prerequisites()
    except ConfigError as e:
        pytest.skip(str(e))
    from support.ranks import run_command
    out = tmp_path / "soak.json"
    res = run_command([sys.executable, str(ROOT / "scripts/soak.py"), "--minutes", "1", "--interval", "5",
                       "--epoch-seconds", "15", "--json", str(out)], timeout_s=240)
    assert out.exists(), f"rc {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    s = json.loads(out.read_text())
    assert s["problems"] == [] and res.returncode == 0, s["problems"]
    assert s["checksum_mismatches"] == 0
    assert s["epochs"] >= 3 and s["steps"] > 100, s
    assert len(s["samples"]) >= 10, "the daemons were not sampled through the run"
