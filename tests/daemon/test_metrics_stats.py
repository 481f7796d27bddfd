"""DaemonStats: counting, histogram buckets, windows, expiry and thread safety."""

import json
import threading

import pytest

from mccld.report import stats as st


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.timeout(10)
def test_collective_histogram_and_op_totals():
    clock = FakeClock()
    s = st.DaemonStats(clock=clock)
    s.record_collective("job1", "allreduce", 1 << 20, 0.004, 4)   # le_1MiB, bucket 5e-3
    s.record_collective("job1", "allreduce", 1 << 20, 0.02, 4)    # bucket 0.025
    s.record_collective("job1", "allreduce", 100, 120.0, 4)       # le_4KiB, above top bound
    snap = s.snapshot()
    json.dumps(snap)  # the status endpoint ships it as JSON
    by_key = {(c["op"], c["size_bucket"]): c for c in snap["collectives"]}
    big = by_key[("allreduce", "le_1MiB")]
    assert big["count"] == 2
    assert big["sum_s"] == pytest.approx(0.024)
    bounds = snap["duration_buckets_s"]
    assert big["cumulative"][bounds.index(0.001)] == 0
    assert big["cumulative"][bounds.index(0.005)] == 1
    assert big["cumulative"][bounds.index(0.025)] == 2
    small = by_key[("allreduce", "le_4KiB")]
    assert small["count"] == 1 and small["cumulative"][-1] == 0  # only +Inf holds it
    op = snap["ops"]["allreduce"]
    assert op["count"] == 3
    assert op["bytes"] == 2 * (1 << 20) + 100
    assert op["bus_bytes"] == pytest.approx(1.5 * op["bytes"])
    assert snap["jobs"]["job1"]["ops"] == 3 and snap["jobs"]["job1"]["world"] == 4


@pytest.mark.timeout(10)
def test_size_buckets_are_inclusive_upper_bounds():
    assert st.size_bucket(0) == "le_4KiB"
    assert st.size_bucket(4096) == "le_4KiB"
    assert st.size_bucket(4097) == "le_64KiB"
    assert st.size_bucket(1 << 40) == "gt_256MiB"


@pytest.mark.timeout(10)
def test_bus_factor_matches_nccl_tests():
    assert st.bus_factor("allreduce", 4) == pytest.approx(1.5)
    assert st.bus_factor("allgather", 4) == pytest.approx(0.75)
    assert st.bus_factor("broadcast", 8) == 1.0
    assert st.bus_factor("allreduce", 1) == 0.0
    assert st.bus_factor("barrier", 4) == 0.0


@pytest.mark.timeout(10)
def test_busbw_window_forgets_old_activity():
    clock = FakeClock()
    s = st.DaemonStats(clock=clock)
    s.record_collective("j", "allreduce", 1000, 0.5, 2)   # bus 1000 B in 0.5 s
    s.record_collective("j", "allreduce", 3000, 0.5, 2)
    assert s.snapshot()["ops"]["allreduce"]["busbw_bytes_per_s"] == pytest.approx(4000.0)
    clock.t += st.BUSBW_WINDOW_S + 2
    snap = s.snapshot()
    assert snap["ops"]["allreduce"]["busbw_bytes_per_s"] is None
    assert snap["ops"]["allreduce"]["count"] == 2  # counters never forget


@pytest.mark.timeout(10)
def test_peers_errors_overlap_state():
    clock = FakeClock()
    s = st.DaemonStats(clock=clock)
    s.record_peer_traffic("10.0.0.2:29650", 100, 50)
    s.record_peer_traffic("10.0.0.2:29650", 1, 2)
    s.set_peer_up("10.0.0.2:29650", True)
    s.set_link_ceiling("10.0.0.2:29650", 9.4e9)
    s.set_peer_up("10.0.0.3:29650", False)
    s.record_error("PeerLostError")
    s.record_error("PeerLostError")
    s.record_overlap("job", 0, 0.2)
    s.record_overlap("job", 0, 0.6)
    s.set_attached(3)
    s.set_state("training")
    snap = s.snapshot()
    p = snap["peers"]["10.0.0.2:29650"]
    assert (p["sent_bytes"], p["received_bytes"], p["up"]) == (101, 52, True)
    assert p["ceiling_bits_per_s"] == 9.4e9
    assert snap["peers"]["10.0.0.3:29650"]["up"] is False
    assert snap["errors"] == {"PeerLostError": 2}
    (ov,) = snap["overlap"]
    assert (ov["job"], ov["rank"], ov["latest"], ov["samples"]) == ("job", 0, 0.6, 2)
    assert ov["mean"] == pytest.approx(0.4)
    assert snap["attached"] == 3 and snap["state"] == "training"
    s.record_balance("job", 1, 6.5, 5)
    s.record_balance("job", 1, 6.0, 4)          # the latest plan replaces the last
    assert s.snapshot()["balance"] == [{"job": "job", "rank": 1, "speed": 6.0, "share": 4}]
    clock.t += st.JOB_STALE_AFTER_S + 1
    assert s.snapshot()["overlap"] == [] and s.snapshot()["balance"] == []


@pytest.mark.timeout(10)
def test_bad_input_is_refused_with_the_cause():
    s = st.DaemonStats()
    with pytest.raises(ValueError, match="outside"):
        s.record_overlap("j", 0, 1.5)
    with pytest.raises(ValueError, match="balance report"):
        s.record_balance("j", 0, float("nan"), 3)
    with pytest.raises(ValueError, match="state"):
        s.set_state("busy")
    with pytest.raises(ValueError, match="deltas"):
        s.record_peer_traffic("p", -1, 0)
    with pytest.raises(ValueError, match="positive"):
        s.set_link_ceiling("p", 0)


@pytest.mark.timeout(30)
def test_concurrent_writers_lose_nothing():
    s = st.DaemonStats()
    n_threads, n = 4, 5000

    def work(i):
        for _ in range(n):
            s.record_collective("j", "allreduce", 4096, 1e-4, 2)
            s.record_peer_traffic(f"peer{i % 2}", 3, 5)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    reader_snaps = [s.snapshot() for _ in range(20)]  # concurrent reads must not raise
    for t in threads:
        t.join(timeout=20)
    assert all(not t.is_alive() for t in threads)
    snap = s.snapshot()
    assert snap["ops"]["allreduce"]["count"] == n_threads * n
    assert sum(p["sent_bytes"] for p in snap["peers"].values()) == 3 * n_threads * n
    assert len(reader_snaps) == 20


@pytest.mark.timeout(10)
def test_peer_rates_average_over_the_window():
    clock = FakeClock()
    s = st.DaemonStats(clock=clock)
    clock.t += 100  # an old daemon: rates average over the full window
    s.record_peer_traffic("p", 5000, 1000)
    clock.t += 1
    s.record_peer_traffic("p", 5000, 1000)
    p = s.snapshot()["peers"]["p"]
    assert p["tx_bytes_per_s"] == pytest.approx(10000 / st.BUSBW_WINDOW_S)
    assert p["rx_bytes_per_s"] == pytest.approx(2000 / st.BUSBW_WINDOW_S)
    clock.t += st.BUSBW_WINDOW_S + 2
    p = s.snapshot()["peers"]["p"]
    assert p["tx_bytes_per_s"] == 0 and p["sent_bytes"] == 10000


@pytest.mark.timeout(10)
def test_bus_world_overrides_world_for_bus_bytes_only():
    s = st.DaemonStats()
    # 4 ranks on 2 hosts: only the 2-host all-reduce crosses the links (factor 1.0, not 1.5).
    s.record_collective("j", "allreduce", 1000, 0.5, 4, bus_world=2)
    snap = s.snapshot()
    assert snap["ops"]["allreduce"]["bus_bytes"] == pytest.approx(1000.0)
    assert snap["jobs"]["j"]["world"] == 4


@pytest.mark.timeout(10)
def test_finished_jobs_are_forgotten_even_when_nobody_reads_the_stats():
    """A daemon nobody scrapes runs job after job: its per-job entries must not pile up."""
    clock = FakeClock()
    s = st.DaemonStats(clock=clock)
    for i in range(1000):
        s.record_collective(f"job{i}", "allreduce", 1024, 0.001, 4)
        s.record_overlap(f"job{i}", 0, 0.5)
        clock.t += st.JOB_STALE_AFTER_S / 100       # a job every 3 s, each seen once
    assert len(s._jobs) <= 101 and len(s._overlap) <= 101
