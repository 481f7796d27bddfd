"""mccld needs nothing pyproject.toml does not declare (issue 36): numpy is no dependency of
the wheel, and mccld once imported it for its p2p and scratch buffers (the dev setup installs
numpy by hand, so nothing else would notice). It imports no torch either: the backend does,
the daemon never. scripts/wheel_check.py runs a job through mccld from an installed wheel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.modules["numpy"] = None          # an import of numpy now raises ImportError
import mccld.__main__, mccld.daemon, mccld.jobs.service, mccld.jobs.p2p, mccld.jobs.collectives, mcclctl.__main__
from mccld.jobs.rawbuf import RawBuffer
b = RawBuffer.of(b"abc")
assert b.tobytes() == b"abc" and b.nbytes == 3 and RawBuffer(0).addr != 0
print("torch" in sys.modules)
"""


@pytest.mark.timeout(60)
def test_mccld_and_mcclctl_import_without_numpy_or_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=50, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False", "mccld imported torch"
    assert "numpy" not in (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0]
