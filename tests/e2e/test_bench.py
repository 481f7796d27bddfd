"""mccl-bench end to end on loopback: a tiny sweep yields a complete, sane JSON result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tools.bench.metrics import OPS, op_elements, parse_bytes, sweep_sizes
from tools.bench.sweep import BenchConfig, aggregate, compare
from mccl_common.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mccl_works() -> bool:
    """Whether init_process_group('mccl') can work here: the glue imports and the engine has a Communicator."""
    code = ("import libmccl, libmccl._core as c; libmccl.register(); "
            "assert hasattr(c, 'Communicator') and hasattr(c, 'Options')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, cwd=ROOT)
    return res.returncode == 0


def _bench(out, *args: str, timeout: float = 220, env: dict | None = None) -> tuple[dict, str]:
    """Run mccl-bench to completion with --json OUT; its result and its stdout."""
    res = subprocess.run([sys.executable, "-m", "tools.bench", *args, "--json", str(out)], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {})))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(out.read_text()), res.stdout


@pytest.mark.timeout(240)
def test_tiny_sweep_produces_valid_json(tmp_path):
    backends = ["gloo"] + (["mccl"] if _mccl_works() else [])
    doc, stdout = _bench(tmp_path / "r.json", "--ranks", "2", "--sizes", "4K,256K", "--backends", ",".join(backends),
                         "--iters", "3", "--repeats", "3", "--ceiling-seconds", "1", "--timeout", "150")
    assert set(doc) == {"meta", "ceiling", "backends", "results", "comparison", "latency"}
    assert set(doc["latency"]) == set(backends) and all(v["median_us"] > 0 for v in doc["latency"].values())
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
    assert "# all_reduce" in stdout and "ring ceiling" in stdout


@pytest.mark.timeout(120)
def test_failing_backend_is_reported_not_faked(tmp_path):
    # Gloo cannot start on an interface that does not exist: the run must fail, say why,
    # and carry no numbers for that backend.
    out = tmp_path / "r.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="nosuchif0")
    res = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--ranks", "2", "--sizes", "4K", "--backends", "gloo",
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
    m = dict(r, series="mccl", time_us=1500.0, busbw_GBps=2 * r["busbw_GBps"], cpu_s_per_wire_gb=0.05)
    g = dict(r, cpu_s_per_wire_gb=0.1)
    (c,) = compare([m, g], {"cpu_s_per_gb": 0.04})
    assert c["busbw_mccl_over_gloo"] == pytest.approx(2) and c["latency_gloo_over_mccl"] == pytest.approx(2)
    assert c["cpu_mccl_over_gloo"] == pytest.approx(0.5) and c["cpu_mccl_over_ceiling_tool"] == pytest.approx(1.25)
    d = dict(m, series="mccl-daemon", time_us=3000.0, busbw_GBps=r["busbw_GBps"], cpu_s_per_wire_gb=0.1)
    (c,) = compare([m, d, g], {"cpu_s_per_gb": 0.04})
    assert c["busbw_daemon_over_in_process"] == pytest.approx(0.5) and c["time_daemon_over_in_process"] == 2
    assert c["busbw_daemon_over_gloo"] == pytest.approx(1) and c["busbw_mccl_over_gloo"] == pytest.approx(2)


@pytest.mark.timeout(10)
def test_busbw_counts_every_rank_of_every_host():
    # 4 hosts x 2 ranks: the daemon's hierarchical all_reduce is still counted for n = 8.
    cfg = BenchConfig(hosts=4, ranks_per_host=2, modes=["in-process", "daemon"], sizes=[1 << 20])
    assert cfg.world == 8 and cfg.n_hosts == 4
    assert [s.name for s in cfg.series()] == ["mccl", "mccl-daemon", "gloo"]
    doc = {"backend": "mccl", "mode": "daemon",
           "results": [{"op": "all_reduce", "bytes": 1 << 20, "count": 1 << 18, "iters": 1, "times_s": [1e-3] * 3,
                        "cpu_s": 0.0}]}
    (r,) = aggregate("mccl-daemon", [doc] * 8, None)
    assert r["busbw_GBps"] == pytest.approx((1 << 20) / 1e-3 / 1e9 * 2 * 7 / 8)
    assert (r["series"], r["backend"], r["mode"]) == ("mccl-daemon", "mccl", "daemon")
    with pytest.raises(ConfigError, match="ranks-per-host"):
        BenchConfig(ranks=3, ranks_per_host=2, sizes=[8]).validate()
    with pytest.raises(ConfigError, match="--mode"):
        BenchConfig(ranks=2, modes=["remote"], sizes=[8]).validate()


@pytest.mark.timeout(30)
def test_results_saved_before_the_daemon_mode_still_render():
    from tools.bench.report import markdown, render

    with open(os.path.join(ROOT, "docs", "results", "device-final", "n8-10gbit.json")) as f:
        old = json.load(f)
    assert "| all_reduce | 256M |" in markdown(old) and "mccl/gloo" in render(old)


needs_fleet = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iperf3"),
                                 reason="the fleet needs root, iproute2 and iperf3")


@needs_fleet
@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_fleet_sweep_is_capped_by_the_link(tmp_path):
    doc, _ = _bench(tmp_path / "r.json", "--hosts", "2", "--rate", "200mbit", "--sizes", "4M", "--backends", "gloo",
                    "--ops", "all_reduce", "--iters", "2", "--ceiling-seconds", "1", "--timeout", "150")
    assert doc["meta"]["mode"] == "fleet" and doc["meta"]["rate"] == "200mbit"
    assert 0.7 * 200e6 <= doc["ceiling"]["mean_bps"] <= 0.97 * 200e6
    (r,) = doc["results"]
    # A collective cannot beat the shaped link: busbw stays below the ceiling (+5% noise).
    assert 0 < r["busbw_Gbps"] * 1e9 <= 1.05 * doc["ceiling"]["mean_bps"]


@pytest.mark.timeout(60)
def test_bench_and_fleet_import_neither_zmq_nor_zeroconf():
    # The device runner has torch and the engine only; the bench must not need the daemon's deps.
    code = ("import sys, tools.bench.__main__, tools.bench.sweep, tools.bench.worker, tools.bench.plot, "
            "tools.fleet, tools.fleet_cli; bad = {'zmq', 'zeroconf', 'torch'} & set(sys.modules); "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-1000:]


@pytest.mark.timeout(60)
def test_builtin_probe_measures_a_loopback_ring(tmp_path):
    # The fallback for hosts without iperf3: same ring pattern, bytes and CPU from the probes.
    from tools.bench.ceiling import ring_ceiling
    from tools.bench.launch import LocalLauncher

    c = ring_ceiling(LocalLauncher(2), 1.0, str(tmp_path), tool="probe")
    assert c["tool"] == "tcp-probe" and len(c["per_host_bps"]) == 2
    assert c["min_bps"] > 1e8 and c["bytes"] > 0 and c["cpu_s_per_gb"] > 0


def _gone(pid: int) -> bool:
    from mccl_common.shm import pid_alive

    return not pid_alive(pid)


def _segments_of(pids: list[int]) -> list[str]:
    from mccl_common.shm import owner_pid

    return [n for n in os.listdir("/dev/shm") if n.startswith("mccl-") and owner_pid(n) in set(pids)]


def _without(tmp_path, module: str) -> dict:
    """The environment of processes that cannot import ``module`` (as on the device machine)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir(exist_ok=True)
    (shadow / f"{module}.py").write_text(f"raise ImportError('hidden by the test: no {module} here')\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p)}


def _daemon_run(tmp_path, where: list[str], env: dict | None = None, timeout: float = 250) -> dict:
    logs = tmp_path / "logs"
    doc, stdout = _bench(tmp_path / "r.json", *where, "--mode", "in-process,daemon", "--sizes", "4K,1M",
                         "--ops", "all_reduce,all_gather", "--iters", "2", "--latency-iters", "20",
                         "--ceiling-seconds", "1", "--timeout", "150", "--log-dir", str(logs), timeout=timeout, env=env)
    series = ["mccl", "mccl-daemon", "gloo"]
    assert list(doc["backends"]) == series and all(doc["backends"][s]["ok"] for s in series), doc["backends"]
    for s in series:
        got = {(r["op"], r["bytes"]) for r in doc["results"] if r["series"] == s}
        assert got == {(op, b) for op in ("all_reduce", "all_gather") for b in (4096, 1 << 20)}, (s, got)
        assert doc["latency"][s]["bytes"] == 8 and doc["latency"][s]["median_us"] > 0
    assert all(r["busbw_GBps"] > 0 and r["cpu_s_per_wire_gb"] > 0 for r in doc["results"])
    assert all(c["busbw_daemon_over_in_process"] > 0 for c in doc["comparison"])
    assert doc["latency"]["daemon_over_in_process"] > 0
    assert "mccl-daemon" in stdout and "daemon/in-proc" in stdout
    # The daemons freed everything themselves, and nothing of the run is left: no process,
    # runtime dir, key or segment (the logs stay in --log-dir).
    info = doc["backends"]["mccl-daemon"]
    assert info["cleaned_after"] == [] and len(info["pids"]["daemons"]) == doc["meta"]["hosts"]
    pids = info["pids"]["daemons"] + info["pids"]["ranks"]
    assert all(_gone(p) for p in pids) and _segments_of(pids) == []
    (daemons_dir,) = logs.glob("run-*/mccl-daemon/daemons")
    assert sorted(p.name for p in daemons_dir.iterdir()) == [f"mccld-h{h}.log" for h in range(doc["meta"]["hosts"])]
    return doc


@pytest.mark.skipif(not _mccl_works(), reason="the engine is not built")
@pytest.mark.timeout(300)
def test_daemon_mode_on_loopback_without_zeroconf(tmp_path):
    # Two daemons on loopback, one rank each; zeroconf hidden, as on the device machine:
    # jobs learn their peers through the rendezvous, so the daemons need no mDNS.
    doc = _daemon_run(tmp_path, ["--ranks", "2"], _without(tmp_path, "zeroconf"))
    assert doc["meta"]["world"] == 2 and doc["meta"]["hosts"] == 2
    (log,) = tmp_path.glob("logs/run-*/mccl-daemon/daemons/mccld-h0.log")
    assert "mccl_common.discovery cannot be imported" in log.read_text()


@pytest.mark.skipif(not _mccl_works(), reason="the engine is not built")
@pytest.mark.timeout(200)
def test_a_daemon_that_cannot_start_fails_its_series_only(tmp_path):
    # mccld without pyzmq exits at once: its series is reported failed with the daemon's own
    # words, the other series still run, and the run exits 1.
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--ranks", "2", "--mode", "in-process,daemon", "--backends", "mccl",
         "--sizes", "4K", "--ops", "all_reduce", "--latency-iters", "0", "--ceiling-tool", "none",
         "--timeout", "100", "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT,
        env=dict(os.environ, **_without(tmp_path, "zmq")))
    assert res.returncode == 1, res.stdout[-1000:] + res.stderr[-1000:]
    doc = json.loads(out.read_text())
    assert doc["backends"]["mccl"]["ok"] and not doc["backends"]["mccl-daemon"]["ok"]
    assert "mccld on host 0 exited" in doc["backends"]["mccl-daemon"]["error"] and "no zmq" in res.stdout
    assert {r["series"] for r in doc["results"]} == {"mccl"}


@pytest.mark.skipif(not _mccl_works(), reason="the engine is not built")
@pytest.mark.timeout(300)
def test_ddp_workload_times_a_step_per_series(tmp_path):
    doc, stdout = _bench(tmp_path / "r.json", "--ranks", "2", "--mode", "in-process,daemon", "--workload", "ddp",
                         "--ddp-width", "256", "--ddp-steps", "3", "--latency-iters", "0", "--ceiling-seconds", "1",
                         "--timeout", "150", timeout=280)
    steps = doc["ddp"]
    assert list(steps) == ["mccl", "mccl-daemon", "gloo"] and doc["results"] == []
    # 3 layers of 256x256 weights + biases, float32
    assert all(v["grad_bytes"] == 3 * (256 * 256 + 256) * 4 and v["steps"] == 3 for v in steps.values())
    assert all(v["step_ms"] > 0 and v["compute_ms"] > 0 and v["wire_floor_ms"] > 0 for v in steps.values())
    assert steps["mccl-daemon"]["step_over_in_process"] > 0 and "step_over_gloo" not in steps["gloo"]
    assert "DDP step" in stdout
    # Copies a step, per direction (libmccl/devices/copy_stats.py): mccl's series only; in process no
    # copy goes through a segment, and CPU tensors are not staged from a device.
    copies = {k: v["copies_per_step"]["ddp"] for k, v in steps.items() if "copies_per_step" in v}
    assert set(copies) == {"mccl", "mccl-daemon"}
    assert copies["mccl"]["host_to_segment"]["copies"] == 0 == copies["mccl"]["device_to_host"]["copies"]
    assert copies["mccl-daemon"]["device_to_host"]["copies"] == 0
    assert "copies a DDP step" in stdout


@pytest.mark.skipif(not _mccl_works(), reason="the engine is not built")
@pytest.mark.timeout(300)
def test_ddp_variants_time_the_step_without_communication_and_staged(tmp_path):
    doc, stdout = _bench(tmp_path / "r.json", "--ranks", "2", "--workload", "ddp", "--ddp-width", "128",
                         "--ddp-steps", "3", "--ddp-variants", "ddp,nocomm,staged", "--latency-iters", "0",
                         "--ceiling-seconds", "1", "--timeout", "150", timeout=280)
    steps = doc["ddp"]
    assert list(steps) == ["mccl", "gloo"]
    for v in steps.values():
        assert v["step_ms"] > 0 and v["nocomm_ms"] > 0 and v["staged_ms"] > 0 and v["step_over_nocomm"] > 0
    # Same weights, same data, same steps: the backends' final parameters agree.
    assert steps["mccl"]["params_match_gloo"] is True
    assert "communication removed" in stdout and "parameters match gloo's" in stdout


def test_params_close_compares_fingerprints() -> None:
    from tools.bench.ddp import params_close

    a = {"fingerprint": {"sum": 10.0, "head": [1.0, 2.0, 3.0]}}
    assert params_close(a, {"fingerprint": {"sum": 10.0 + 1e-7, "head": [1.0, 2.0 + 1e-6, 3.0]}})
    assert not params_close(a, {"fingerprint": {"sum": 10.0, "head": [1.0, 2.1, 3.0]}})
    assert not params_close(a, {"fingerprint": {"sum": 11.0, "head": [1.0, 2.0, 3.0]}})
    assert not params_close(a, {})


@needs_fleet
@pytest.mark.fleet
@pytest.mark.skipif(not _mccl_works(), reason="the engine is not built")
@pytest.mark.timeout(300)
def test_daemon_mode_on_two_namespace_hosts_with_two_ranks_each(tmp_path):
    doc = _daemon_run(tmp_path, ["--hosts", "2", "--ranks-per-host", "2", "--rate", "1gbit"], timeout=280)
    assert doc["meta"]["world"] == 4 and doc["meta"]["hosts"] == 2 and doc["ceiling"]["tool"] == "iperf3"


@pytest.mark.timeout(120)
def test_daemons_are_stopped_and_swept_whatever_happened(tmp_path):
    # A rank's segment still there at the end (its daemon never heard of it): stop() unlinks
    # it, says so, and leaves no daemon, runtime dir or key behind. The rank stays alive
    # until then, so no other developer's daemon sweeps the segment first.
    from tools.bench.daemons import HostDaemons
    from tools.bench.launch import LocalLauncher

    d = HostDaemons(LocalLauncher(1), str(tmp_path)).start()
    rank = d.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        seg = f"/dev/shm/mccl-b0b-0-{rank.pid}-0"
        open(seg, "wb").close()
        daemon = d.procs[0]
    finally:
        cleaned = d.stop()
        rank.kill()
        rank.wait(10)
    assert cleaned == [f"shared-memory segment {os.path.basename(seg)}"] and not os.path.exists(seg)
    assert daemon.returncode == 0 and not os.path.exists(d.runtime_dir(0)) and not os.path.exists(d.key_file)
    assert d.stop() == []  # idempotent


@pytest.mark.timeout(120)
def test_daemons_die_with_a_killed_benchmark(tmp_path):
    # Even SIGKILL of the benchmark (no finally runs) stops its daemons: they get SIGTERM.
    code = ("import sys, time; from tools.bench.daemons import HostDaemons; "
            "from tools.bench.launch import LocalLauncher; "
            f"d = HostDaemons(LocalLauncher(2), {str(tmp_path)!r}).start(); "
            "print(d.dir, *[p.pid for p in d.procs], flush=True); time.sleep(120)")
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        runtime, *pids = bench.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2, "the daemons did not start"
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
    # What a killed benchmark cannot remove itself: its runtime dirs and key (no secret of anyone else's).
    shutil.rmtree(runtime, ignore_errors=True)
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in pids)
