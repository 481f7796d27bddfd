"""Dashboards against real daemons: a training job through mccld on an emulated fleet.

Three hosts (network namespaces) each run mccld. A 4-rank job runs on hosts 1 and 2
(two ranks each, MCCL_DAEMON clients, all-reduce with compute overlapped); host 0 runs
only its daemon and a real Prometheus scraping all three daemons every second. Every
PromQL expression of every dashboard panel must return data, and the daemons' counters
(read back through Prometheus) must agree with what the ranks did.

Run as a script, this file is one rank of that job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support import prometheus as prometheus_util

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
COMM_ID = 0x0b5e
JOB = f"{COMM_ID:08x}"                      # the daemon's job id for this communicator
SIZES = (4 << 10, 256 << 10, 2 << 20)       # bytes: three size classes
F32, SUM, MAX = 0, 0, 3                     # csrc/core/dtype.h numbering (never renumbered)
STEP_TIMEOUT_S = 30.0


def _rank_main(rank: int, world: int, stop_file: str, max_s: float) -> int:
    """One rank: overlapped all-reduce steps until told to stop; prints what it did."""
    import datetime

    import numpy as np
    import torch.distributed as dist

    from libmccl.daemon.client import DaemonCommunicator

    done_at: dict[int, float] = {}

    def on_complete(batch):
        now = time.monotonic()
        for op_id, _err, _info in batch:
            done_at[op_id] = now

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    comm = DaemonCommunicator(rank, world, COMM_ID, store, None, on_complete, 60.0)
    ops, nbytes, ratios, step = 0, 0, [], 0
    deadline = time.monotonic() + max_s
    flag = np.zeros(1, dtype=np.float32)
    while True:
        if step % 10 == 0:
            # Ranks must stop after the same collective, so they agree on it: MAX of flags.
            flag[0] = float(os.path.exists(stop_file) or time.monotonic() > deadline)
            comm.wait(comm.allreduce(flag.ctypes.data, 1, F32, MAX), STEP_TIMEOUT_S)
            ops, nbytes = ops + 1, nbytes + flag.nbytes
            if flag[0] > 0:
                break
        step += 1
        size = SIZES[step % len(SIZES)]
        buf = np.full(size // 4, rank + 1, dtype=np.float32)
        start = time.monotonic()
        op = comm.allreduce(buf.ctypes.data, buf.size, F32, SUM)
        a = np.random.default_rng(ops).random((96, 96))
        for _ in range(4):
            a = a @ a / 96.0
        computed = time.monotonic()
        comm.wait(op, STEP_TIMEOUT_S)
        done = done_at.pop(op, time.monotonic())
        if not np.all(buf == world * (world + 1) / 2):
            print(f"rank {rank}: wrong all-reduce result", file=sys.stderr)
            return 1
        total = max(done - start, 1e-9)
        ratios.append(min(1.0, max(0.0, 1.0 - max(0.0, done - computed) / total)))
        ops += 1
        nbytes += size
        if len(ratios) % 20 == 0:  # as a training loop would, every few steps
            comm.report_overlap(sum(ratios[-20:]) / 20)
        time.sleep(0.005)
    comm.shutdown(10)
    print(json.dumps({"rank": rank, "ops": ops, "bytes": nbytes}))
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))


needs_fleet = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="the fleet needs root and iproute2")


@needs_fleet
@pytest.mark.fleet
@pytest.mark.skipif(not prometheus_util.available(), reason="prometheus is not installed")
@pytest.mark.timeout(280)
def test_dashboards_have_data_from_daemons_running_a_job():
    from tools.fleet import Fleet

    work = Path(tempfile.mkdtemp(prefix="mccl-graf-fleet-"))
    fleet_name = f"gd{os.getpid()}"
    key = "grafana-daemon-test-key-" + "g" * 20
    logs, ranks = [], []
    fleet = Fleet(3, rate="2gbit")

    activity = work / "activity"        # the hosts' users left an hour ago (namespaces share one kernel,
    activity.touch()                    # so no OS idle source tells them apart)
    os.utime(activity, (time.time() - 3600, time.time() - 3600))

    def env(i: int) -> dict[str, str]:
        return {"MCCL_FLEET_KEY": key, "MCCL_FLEET": fleet_name, "MCCL_IFACE": "eth0",
                "MCCL_HOST_ID": f"host{i}", "MCCL_RUNTIME_DIR": str(work / f"rt{i}"),
                "MCCL_CLIENT_CHECK_INTERVAL": "0.1", "PYTHONPATH": str(REPO),
                "MCCL_ACTIVITY_FILE": str(activity), "MCCL_HARVEST_POLL": "0.5",
                # the dashboards' user-presence panels are fed only where the fleet opts in
                "MCCL_METRICS_PRESENCE": "1"}
    try:
        for i in range(3):
            seed_harvest_history(work / f"rt{i}")
        fleet.start()
        for i in range(3):
            log = open(work / f"mccld{i}.log", "w")
            logs.append(log)
            fleet.popen(i, [PY, "-m", "mccld"], env=env(i), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not all((work / f"rt{i}" / "token").exists() for i in range(3)):
            assert time.monotonic() < deadline, "mccld did not start"
            time.sleep(0.2)

        # The link test gives host1 a ceiling for its link to host2 (busbw % of goodput).
        lt = fleet.run(1, [PY, "-m", "mcclctl", "linktest", "host1", fleet.hosts[2].addr, "--seconds", "1"],
                       timeout=STEP_TIMEOUT_S, env=env(1))
        assert lt.returncode == 0, lt.stdout + lt.stderr

        stop_file = work / "stop"
        placement = [1, 1, 2, 2]
        master = {"MASTER_ADDR": fleet.hosts[1].addr, "MASTER_PORT": "29710", "OMP_NUM_THREADS": "1",
                  # this file runs as each rank's script: its imports of ``support`` need tests/
                  "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)}
        for r, h in enumerate(placement):
            ranks.append(fleet.popen(h, [PY, __file__, str(r), str(len(placement)), str(stop_file), "150"],
                                     env={**env(h), **master}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True))

        targets = {f"{h.addr}:29652": {"host": f"host{i}"} for i, h in enumerate(fleet.hosts)}
        with prometheus_util.PrometheusServer(targets, exec_prefix=fleet.exec_argv(0, [])) as prom:
            prom.wait_for(f'mccl_overlap_ratio{{job_id="{JOB}"}}', timeout_s=90)
            prom.wait_for('sum(rate(mccl_peer_sent_bytes_total[10s])) > 0', timeout_s=30)
            time.sleep(3)
            # No user comes back in this run: the hand-back quantiles have series but no value.
            failures = prometheus_util.failing_dashboard_queries(
                prom, prometheus_util.DASHBOARDS, series_only=("Hand-back to the user (reclaim latency)",))
            assert not failures, "\n".join(failures)
            for expr in FIGURES:  # shown with -s: what the dashboards display for this run
                print(expr, "=>", [(r["metric"], r["value"][1]) for r in prom.query(expr)])

            # mcclctl links sees the job's sockets to host2 (control link + engine stripes).
            links = fleet.run(0, [PY, "-m", "mcclctl", "links", "--json", "--host", fleet.hosts[1].addr],
                              timeout=STEP_TIMEOUT_S, env=env(0))
            assert links.returncode == 0, links.stdout + links.stderr
            (entry,) = json.loads(links.stdout)
            to2 = [link for link in entry["links"] if link["peer"].startswith(fleet.hosts[2].addr + ":")]
            assert to2 and to2[0]["up"] is True, entry
            assert to2[0]["sockets"] >= 2 and isinstance(to2[0]["retransmits"], int), to2
            assert to2[0]["sent_bytes"] > 0, to2

            stop_file.touch()
            results = {}
            for p in ranks:
                out, _ = p.communicate(timeout=STEP_TIMEOUT_S + 30)
                assert p.returncode == 0, out[-3000:]
                res = json.loads(out.strip().splitlines()[-1])
                results[res["rank"]] = res
            check_daemon_counters(prom, fleet, placement, results)
    except BaseException:
        for i in range(len(logs)):
            sys.stderr.write(f"--- mccld{i}.log\n{(work / f'mccld{i}.log').read_text()[-3000:]}\n")
        raise
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        fleet.stop()
        for log in logs:
            log.close()
        shutil.rmtree(work, ignore_errors=True)


FIGURES = (
    'max by (instance, op) (mccl_busbw_bytes_per_second)',
    'max by (instance, op) (mccl_busbw_link_ratio)',
    'mccl_link_ceiling_bytes_per_second * 8',
    'histogram_quantile(0.5, sum by (le, size_bucket) (rate(mccl_collective_duration_seconds_bucket'
    '{op="allreduce"}[10s])))',
    'mccl_overlap_ratio',
)


def seed_harvest_history(rdir: Path) -> None:
    """Past nights harvested 22:00-07:00, in the history file a daemon keeps in its runtime
    dir (mccld/host/harvest.py): what a daemon running for a few days would have, for the panels of
    harvestable hours per night."""
    import datetime
    from mccld.host.harvest import HISTORY_NAME
    rdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    today = datetime.datetime.now().replace(hour=0, minute=0, second=0, microsecond=0)
    # From a noon on: a night counts once the history covers it from its start (noon to noon).
    lines = [json.dumps({"t": (today - datetime.timedelta(days=4, hours=-12)).timestamp(), "state": "busy"})]
    for back in (4, 3, 2, 1):
        start = today - datetime.timedelta(days=back) + datetime.timedelta(hours=22)
        end = start + datetime.timedelta(hours=9)
        lines += [json.dumps({"t": start.timestamp(), "state": "idle"}),
                  json.dumps({"t": end.timestamp(), "state": "busy"})]
    (rdir / HISTORY_NAME).write_text("\n".join(lines) + "\n")


def check_daemon_counters(prom, fleet, placement: list[int], results: dict) -> None:
    ops = {results[r]["ops"] for r in results}
    assert len(ops) == 1, f"ranks disagree on the number of collectives: {results}"
    (n_ops,) = ops
    n_bytes = results[0]["bytes"]
    for h in sorted(set(placement)):
        inst = f'instance="{fleet.hosts[h].addr}:29652"'
        # One daemon-level collective per job collective, whatever the local rank count.
        got = prom.value_when(f'mccl_job_collectives_total{{{inst}, job_id="{JOB}"}}', n_ops)
        assert got == n_ops, f"host{h}: daemon counted {got} collectives, ranks did {n_ops}"
        got = prom.value_when(f'mccl_job_bytes_total{{{inst}, job_id="{JOB}"}}', n_bytes)
        assert got == n_bytes, f"host{h}: daemon counted {got} bytes, ranks reduced {n_bytes}"
    # The link between the two job hosts: what one daemon sent, the other received.
    a, b = fleet.hosts[1], fleet.hosts[2]
    sent = prom.value_when(f'sum(mccl_peer_sent_bytes_total{{instance="{a.addr}:29652"}})', -1, timeout_s=3)
    recv = prom.value_when(f'sum(mccl_peer_received_bytes_total{{instance="{b.addr}:29652"}})', sent)
    assert sent and sent > 0 and recv == sent, f"host1 sent {sent} bytes to host2, host2 received {recv}"
