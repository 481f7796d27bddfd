"""Every dashboard query returns data from a real Prometheus scraping real exporters.

Two ranks of the real engine (threads, loopback) run an all-reduce loop with compute
overlapped; each rank feeds its own DaemonStats exactly as a daemon would (measured
durations, the engine's own byte counters, measured overlap, a real linktest ceiling)
and has its own MetricsServer. A real Prometheus scrapes both every second. Then:
every PromQL expression of every dashboard panel, with the dashboard's template
variables resolved through Prometheus, must return data; and the exported counters
must equal what the workload counted.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from support import prometheus as prometheus_util
from mccl_common.daemon_settings import load_config
from mccld.host.harvest import HISTORY_NAME, Harvester, recent_nights
from mccld.report.metrics import MetricsServer
from mccld.report.stats import DaemonStats
from mccld.report.status_server import StatusServer


core = pytest.importorskip("libmccl._core")
pytestmark = [
    pytest.mark.skipif(not hasattr(core, "Communicator"), reason="engine Communicator not built yet"),
    pytest.mark.skipif(not prometheus_util.available(), reason="prometheus is not installed"),
]

DASHBOARDS = prometheus_util.DASHBOARDS
JOB = "train-1"
KEY = b"grafana-test-fleet-key-0123456789"
SIZES = (1 << 10, 64 << 10, 1 << 20)        # bytes per all-reduce: three size classes
OP_TIMEOUT_S = 30.0
F32, SUM, MAX = 0, 0, 3   # mccl::DType / mccl::ReduceOp numbers (csrc/core/dtype.h: never renumbered)


class Rank:
    """One engine rank reporting into its own DaemonStats, as a daemon does."""

    def __init__(self, rank: int, listener, peers: list[str]):
        self.rank = rank
        self.stats = DaemonStats()
        self.done_at: dict[int, float] = {}
        self.listener = listener
        self.peers = peers
        self.comm = None
        self.ops = 0
        self.bytes = 0
        self.last = {"sent": 0, "received": 0}
        self.error: BaseException | None = None

    def on_complete(self, batch) -> None:
        now = time.monotonic()
        for op_id, _err, _info in batch:
            self.done_at[op_id] = now

    def connect(self) -> None:
        opts = core.Options()
        opts.timeout_s = OP_TIMEOUT_S
        opts.connect_timeout_s = OP_TIMEOUT_S
        self.comm = core.Communicator(self.rank, 2, 4242, self.listener, self.peers, opts, self.on_complete)
        peer = self.comm.peer_address(1 - self.rank)
        self.stats.set_peer_up(peer, True)
        self.stats.set_attached(1)
        self.stats.set_state("training")

    def step(self, nbytes: int) -> None:
        """One overlapped step: start the all-reduce, compute, then wait for it."""
        count = nbytes // 4
        buf = np.full(count, self.rank + 1, dtype=np.float32)
        start = time.monotonic()
        op = self.comm.allreduce(buf.ctypes.data, count, F32, SUM)
        a = np.random.default_rng(self.ops).random((96, 96))
        for _ in range(4):   # compute that communication can hide behind
            a = a @ a / 96.0
        computed = time.monotonic()
        self.comm.wait(op, OP_TIMEOUT_S)
        done = self.done_at.pop(op, time.monotonic())
        if not np.all(buf == 3.0):
            raise AssertionError(f"rank {self.rank}: all-reduce of {nbytes} bytes gave wrong data")
        total = max(done - start, 1e-9)
        exposed = max(0.0, done - computed)
        self.stats.record_collective(JOB, "allreduce", nbytes, total, 2)
        self.stats.record_overlap(JOB, self.rank, min(1.0, max(0.0, 1.0 - exposed / total)))
        self.ops += 1
        self.bytes += nbytes
        self.flush_traffic()

    def agree_to_stop(self, mine: bool) -> bool:
        flag = np.array([1.0 if mine else 0.0], dtype=np.float32)
        start = time.monotonic()
        self.comm.wait(self.comm.allreduce(flag.ctypes.data, 1, F32, MAX), OP_TIMEOUT_S)
        self.stats.record_collective(JOB, "allreduce", flag.nbytes, time.monotonic() - start, 2)
        self.ops += 1
        self.bytes += flag.nbytes
        self.flush_traffic()
        return bool(flag[0] > 0)

    def flush_traffic(self) -> None:
        s = self.comm.stats()
        per_peer = s["per_peer"][1 - self.rank]
        sent, received = per_peer["sent"], per_peer["received"]
        self.stats.record_peer_traffic(self.comm.peer_address(1 - self.rank),
                                       sent - self.last["sent"], received - self.last["received"])
        self.last = {"sent": sent, "received": received}


def start_harvester(r: Rank, tmp: Path) -> Harvester:
    """The rank's host harvest state, as a daemon keeps it: rank 0's user left an hour ago (so,
    with its job, it is leased), rank 1's is there; both have two nights of history."""
    act = tmp / f"activity{r.rank}"
    act.touch()
    if r.rank == 0:
        os.utime(act, (time.time() - 3600, time.time() - 3600))
    rdir = tmp / f"rt{r.rank}"
    rdir.mkdir()
    (older, _), (newer, _) = reversed(recent_nights(time.time(), 2))
    history = [(older, "busy"), (older + 10 * 3600, "idle"), (older + 18 * 3600, "busy"),
               (newer + 11 * 3600, "leased"), (newer + 20 * 3600, "busy")]
    (rdir / HISTORY_NAME).write_text("".join(json.dumps({"t": t, "state": s}) + "\n" for t, s in history))
    cfg = load_config(env={"MCCL_FLEET_KEY": KEY.decode(), "MCCL_IDLE_AFTER": "600",
                           "MCCL_ACTIVITY_FILE": str(act), "MCCL_HARVEST_POLL": "0.5"})
    return Harvester(cfg, rdir, lambda: 1, lambda snap, _changed: r.stats.set_harvest(snap)).start()


def run_ranks(ranks: list[Rank], stop: threading.Event) -> list[threading.Thread]:
    def loop(r: Rank) -> None:
        try:
            i = 0
            while True:
                # Both ranks must stop after the same collective: every 10 steps they
                # all-reduce (MAX) their stop flags and stop together.
                if i % 10 == 0 and r.agree_to_stop(stop.is_set()):
                    return
                r.step(SIZES[i % len(SIZES)])
                i += 1
        except BaseException as e:  # surfaced by the test, not lost in a thread
            r.error = e
            stop.set()

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    return threads


@pytest.mark.timeout(240)
def test_every_dashboard_query_returns_data_and_counters_match_the_workload(tmp_path):
    assert DASHBOARDS, "no dashboards found in grafana/dashboards"
    listeners = [core.Listener("127.0.0.1", 0) for _ in range(2)]
    peers = [lst.address for lst in listeners]
    ranks = [Rank(r, listeners[r], peers) for r in range(2)]
    threads = [threading.Thread(target=r.connect) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=OP_TIMEOUT_S + 5)
    assert all(r.comm is not None for r in ranks), "engine mesh did not come up"

    # A real link test on loopback gives rank 0 a ceiling for its link to rank 1.
    status = [StatusServer(lambda r=r: {"host": f"rank{r.rank}", "address": peers[r.rank]}, KEY,
                           "127.0.0.1", 0, stats=r.stats) for r in ranks]
    metrics = [MetricsServer(r.stats, "127.0.0.1", 0, host=f"rank{r.rank}", presence=True) for r in ranks]
    stop = threading.Event()
    workers: list[threading.Thread] = []
    harvesters: list[Harvester] = []
    try:
        harvesters = [start_harvester(r, tmp_path) for r in ranks]
        # Each host was handed back to its user once: rank 0's job left, rank 1's was removed.
        ranks[0].stats.record_reclaim(3.5, "left")
        ranks[1].stats.record_reclaim(64.0, "removed")
        for s in status + metrics:
            s.start()
        from mccld.report.status_server import query
        for a, b in ((0, 1), (1, 0)):
            query(f"127.0.0.1:{status[a].port}", KEY, "linktest",
                  {"target": f"127.0.0.1:{status[b].port}", "seconds": 0.5}, timeout_s=20)
        targets = {f"127.0.0.1:{m.port}": {"host": f"rank{i}"} for i, m in enumerate(metrics)}
        with prometheus_util.PrometheusServer(targets) as prom:
            workers = run_ranks(ranks, stop)
            try:
                prom.wait_for("sum(mccl_collective_duration_seconds_count) > 0", timeout_s=30)
            finally:
                for r in ranks:
                    assert r.error is None, f"rank {r.rank} failed: {r.error!r}"
            time.sleep(5)  # several scrapes, so rate() over the window has points

            failures = prometheus_util.failing_dashboard_queries(prom, DASHBOARDS)
            assert not failures, "\n".join(failures)

            stop.set()
            for t in workers:
                t.join(timeout=OP_TIMEOUT_S + 5)
            for r in ranks:
                assert r.error is None, f"rank {r.rank} failed: {r.error!r}"
                r.flush_traffic()
            check_counters_match(prom, ranks, metrics)
            harvested = prom.value_when('sum(mccl_harvest_state{state="leased"})', 1.0)
            assert harvested == 1.0, f"rank 0 should be leased: {harvested}"
            # Both hosts: night 1 idle 8 h, night 2 leased 9 h.
            assert prom.value_when("max(mccl_harvestable_seconds_per_night)", 8.5 * 3600) == 8.5 * 3600
    finally:
        for h in harvesters:
            h.stop()
        stop.set()
        for t in workers:
            t.join(timeout=OP_TIMEOUT_S + 5)
        for s in status + metrics:
            s.stop()
        for r in ranks:
            if r.comm is not None:
                r.comm.shutdown(10.0)


def check_counters_match(prom, ranks: list[Rank], metrics: list[MetricsServer]) -> None:
    """After the workload stopped, Prometheus holds exactly what the workload counted."""
    for r, m in zip(ranks, metrics):
        inst = f'instance="127.0.0.1:{m.port}"'
        engine = r.comm.stats()
        peer = r.comm.peer_address(1 - r.rank)
        expected = {
            f"sum(mccl_collective_duration_seconds_count{{{inst}}})": r.ops,
            f'mccl_job_collectives_total{{{inst}, job_id="{JOB}"}}': r.ops,
            f'mccl_peer_sent_bytes_total{{{inst}, peer="{peer}"}}': engine["per_peer"][1 - r.rank]["sent"],
            f'mccl_peer_received_bytes_total{{{inst}, peer="{peer}"}}':
                engine["per_peer"][1 - r.rank]["received"],
            f'sum(mccl_collective_bytes_total{{{inst}}})': r.bytes,
        }
        assert engine["ops_completed"] >= r.ops
        for expr, want in expected.items():
            got = prom.value_when(expr, want)
            assert got == want, f"rank {r.rank}: {expr} = {got}, workload counted {want}"

# The autouse leak check (conftest._no_leaks) is off for this module: a real Prometheus and mccld run across the test; their threads and fds are torn down after the check.
pytestmark = [*pytestmark, pytest.mark.leaks_ok]
