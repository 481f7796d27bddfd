"""mccl-bench end to end on loopback: a tiny sweep yields a complete, sane JSON result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from libmccl.bench.metrics import OPS, op_elements, parse_bytes, sweep_sizes
from libmccl.bench.sweep import BenchConfig, aggregate, compare
from libmccl.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mccl_works() -> bool:
    """Whether init_process_group('mccl') can work here: the glue imports and the engine has a Communicator."""
    code = ("import libmccl, libmccl._core as c; libmccl.register(); "
            "assert hasattr(c, 'Communicator') and hasattr(c, 'Options')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, cwd=ROOT)
    return res.returncode == 0


@pytest.mark.timeout(240)
def test_tiny_sweep_produces_valid_json(tmp_path):
    backends = ["gloo"] + (["mccl"] if _mccl_works() else [])
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, "-m", "libmccl.bench", "--ranks", "2", "--sizes", "4K,256K", "--backends", ",".join(backends),
         "--iters", "3", "--repeats", "3", "--ceiling-seconds", "1", "--timeout", "150", "--json", str(out)],
        capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "ceiling", "backends", "results", "comparison"}
    assert doc["meta"]["world"] == 2 and doc["meta"]["mode"] == "loopback"
    ceil = doc["ceiling"]
    assert ceil["tool"] in ("iperf3", "tcp-probe") and ceil["mean_bps"] > 0 and len(ceil["per_host_bps"]) == 2
    for b in backends:
        assert doc["backends"][b]["ok"], doc["backends"][b]
        rows = [r for r in doc["results"] if r["backend"] == b]
        assert {(r["op"], r["bytes"]) for r in rows} == {(op, s) for op in OPS for s in (4096, 262144)}
        for r in rows:
            assert r["time_us"] > 0 and r["busbw_GBps"] > 0 and r["algbw_GBps"] > 0
            assert r["busbw_pct_ceiling"] > 0 and r["cpu_s_per_wire_gb"] > 0
            assert r["iters"] == 3 and len(r["time_us_repeats"]) == 3
            assert min(r["time_us_repeats"]) <= r["time_us"] <= max(r["time_us_repeats"])
            # nccl-tests definitions at n=2
            factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}[r["op"]]
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
    if "mccl" in backends:
        assert len(doc["comparison"]) == len(OPS) * 2
        assert all(c["busbw_mccl_over_gloo"] > 0 and c["cpu_mccl_over_gloo"] > 0 for c in doc["comparison"])
    assert "# all_reduce" in res.stdout and "ring ceiling" in res.stdout


@pytest.mark.timeout(120)
def test_failing_backend_is_reported_not_faked(tmp_path):
    # Gloo cannot start on an interface that does not exist: the run must fail, say why,
    # and carry no numbers for that backend.
    out = tmp_path / "r.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="nosuchif0")
    res = subprocess.run(
        [sys.executable, "-m", "libmccl.bench", "--ranks", "2", "--sizes", "4K", "--backends", "gloo",
         "--ops", "all_reduce", "--ceiling-tool", "none", "--timeout", "60", "--json", str(out)],
        capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    assert res.returncode == 1, res.stdout[-1000:] + res.stderr[-1000:]
    doc = json.loads(out.read_text())
    assert doc["backends"]["gloo"]["ok"] is False and "nosuchif0" in doc["backends"]["gloo"]["error"]
    assert doc["results"] == [] and doc["ceiling"] is None
    assert "gloo: FAILED, no numbers" in res.stdout


@pytest.mark.timeout(10)
def test_metrics_conventions():
    assert OPS["all_reduce"].bus_factor(4) == pytest.approx(1.5)
    assert OPS["all_gather"].bus_factor(4) == pytest.approx(0.75)
    assert OPS["reduce_scatter"].wire_factor(8) == pytest.approx(7 / 8)
    assert OPS["broadcast"].bus_factor(8) == 1.0
    assert op_elements("all_gather", 4096, 3) == 1023
    assert op_elements("all_gather", 8, 4) == 0 and op_elements("all_reduce", 8, 4) == 2
    assert sweep_sizes(4 << 10, 256 << 20, 2)[-1] == 256 << 20 and len(sweep_sizes(4 << 10, 256 << 20, 2)) == 17
    assert parse_bytes("4K") == 4096 and parse_bytes("256MB") == 256 << 20 and parse_bytes("8") == 8
    with pytest.raises(ConfigError, match="repeats"):
        BenchConfig(ranks=2, sizes=[4096], repeats=2).validate()


@pytest.mark.timeout(10)
def test_aggregate_takes_slowest_rank_and_median():
    def doc(times, cpu):
        return {"results": [{"op": "all_reduce", "bytes": 1 << 20, "count": 1 << 18, "iters": 2,
                             "times_s": times, "cpu_s": cpu}]}
    rows = aggregate("gloo", [doc([1e-3, 3e-3, 2e-3], 0.01), doc([2e-3, 1e-3, 5e-3], 0.03)],
                     {"mean_bps": 8e9, "cpu_s_per_gb": 0.1})
    (r,) = rows
    assert r["time_us_repeats"] == pytest.approx([2000, 3000, 5000]) and r["time_us"] == pytest.approx(3000)
    assert r["algbw_GBps"] == pytest.approx((1 << 20) / 3e-3 / 1e9)
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n = 1 at n=2
    assert r["busbw_pct_ceiling"] == pytest.approx(100 * r["busbw_GBps"] / 1.0)
    # wire: (2(n-1)/n) * S per rank * n ranks * iters * repeats
    assert r["cpu_s_per_wire_gb"] == pytest.approx(0.04 / ((1 << 20) * 2 * 2 * 3 / 1e9))
    m = dict(r, backend="mccl", time_us=1500.0, busbw_GBps=2 * r["busbw_GBps"], cpu_s_per_wire_gb=0.05)
    g = dict(r, cpu_s_per_wire_gb=0.1)
    (c,) = compare([m, g], {"cpu_s_per_gb": 0.04})
    assert c["busbw_mccl_over_gloo"] == pytest.approx(2) and c["latency_gloo_over_mccl"] == pytest.approx(2)
    assert c["cpu_mccl_over_gloo"] == pytest.approx(0.5) and c["cpu_mccl_over_ceiling_tool"] == pytest.approx(1.25)


needs_fleet = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iperf3"),
                                 reason="the fleet needs root, iproute2 and iperf3")


@needs_fleet
@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_fleet_sweep_is_capped_by_the_link(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, "-m", "libmccl.bench", "--hosts", "2", "--rate", "200mbit", "--sizes", "4M",
         "--backends", "gloo", "--ops", "all_reduce", "--iters", "2", "--ceiling-seconds", "1",
         "--timeout", "150", "--json", str(out)], capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["mode"] == "fleet" and doc["meta"]["rate"] == "200mbit"
    assert 0.7 * 200e6 <= doc["ceiling"]["mean_bps"] <= 0.97 * 200e6
    (r,) = doc["results"]
    # A collective cannot beat the shaped link: busbw stays below the ceiling (+5% noise).
    assert 0 < r["busbw_Gbps"] * 1e9 <= 1.05 * doc["ceiling"]["mean_bps"]


@pytest.mark.timeout(60)
def test_bench_and_fleet_import_neither_zmq_nor_zeroconf():
    # The device runner has torch and the engine only; the bench must not need the daemon's deps.
    code = ("import sys, libmccl.bench.__main__, libmccl.bench.sweep, libmccl.bench.worker, libmccl.bench.plot, "
            "libmccl.fleet, libmccl.fleet_cli; bad = {'zmq', 'zeroconf', 'torch'} & set(sys.modules); "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-1000:]


@pytest.mark.timeout(60)
def test_builtin_probe_measures_a_loopback_ring(tmp_path):
    # The fallback for hosts without iperf3: same ring pattern, bytes and CPU from the probes.
    from libmccl.bench.ceiling import ring_ceiling
    from libmccl.bench.launch import LocalLauncher

    c = ring_ceiling(LocalLauncher(2), 1.0, str(tmp_path), tool="probe")
    assert c["tool"] == "tcp-probe" and len(c["per_host_bps"]) == 2
    assert c["min_bps"] > 1e8 and c["bytes"] > 0 and c["cpu_s_per_gb"] > 0
