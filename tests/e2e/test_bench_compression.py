"""tools.bench --compression: each mccl mode runs once per MCCL_COMPRESSION value, the report
gives each over off, and the correctness check takes the codec's error (not bit-exactness)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mccl_common.errors import ConfigError
from tools.bench.sweep import BenchConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(240)
def test_compression_series_on_loopback(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "tools.bench", "--ranks", "2", "--backends", "mccl",
                          "--ops", "all_reduce,reduce_scatter", "--sizes", "4K,1M", "--compression", "off,int8",
                          "--iters", "3", "--repeats", "3", "--ceiling-seconds", "1", "--latency-iters", "0",
                          "--timeout", "150", "--json", str(out)],
                         capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["backends"]["mccl"]["ok"] and doc["backends"]["mccl-int8"]["ok"], doc["backends"]
    rows = {(r["series"], r["op"], r["bytes"]) for r in doc["results"]}
    assert {("mccl-int8", op, s) for op in ("all_reduce", "reduce_scatter") for s in (4096, 1 << 20)} <= rows
    assert all(c["busbw_int8_over_off"] > 0 for c in doc["comparison"])


def test_compression_values_are_checked():
    with pytest.raises(ConfigError, match="--compression"):
        BenchConfig(ranks=2, compression=["zip"], sizes=[4096]).validate()
    names = [s.name for s in BenchConfig(ranks=2, compression=["off", "bf16"], backends=["mccl", "gloo"]).series()]
    assert names == ["mccl", "mccl-bf16", "gloo"]
    # Through mccld too (it compresses what crosses hosts; docs/compression.md).
    cfg = BenchConfig(ranks=2, modes=["in-process", "daemon"], compression=["off", "int8"], sizes=[4096],
                      backends=["mccl"])
    cfg.validate()
    assert [s.name for s in cfg.series()] == ["mccl", "mccl-int8", "mccl-daemon", "mccl-daemon-int8"]
