"""The Prometheus collector and /metrics server render DaemonStats faithfully."""

import urllib.request

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mccld.report import stats as st
from mccld.report.metrics import MetricsServer, make_registry

PEER_A, PEER_B = "10.77.0.2:29650", "10.77.0.3:29650"


def populated() -> st.DaemonStats:
    s = st.DaemonStats()
    s.set_state("training")
    s.set_attached(2)
    for _ in range(3):
        s.record_collective("jobA", "allreduce", 8 << 20, 0.02, 4)   # le_16MiB, <= 0.025 s
    s.record_collective("jobA", "allgather", 1000, 0.0004, 4)        # le_4KiB, <= 5e-4 s
    s.record_peer_traffic(PEER_A, 1000, 2000)
    s.set_peer_up(PEER_A, True)
    s.set_peer_up(PEER_B, False)
    s.set_link_ceiling(PEER_A, 8e9)           # 1e9 bytes/s
    s.set_link_ceiling(PEER_B, 1e9)           # down: must not count as the ceiling
    s.record_error("PeerLostError")
    s.record_overlap("jobA", 1, 0.5)
    s.record_overlap("jobA", 1, 0.7)
    s.record_balance("jobA", 1, 12.5, 11)
    return s


def scrape_text(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} plus family types."""
    samples, types = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for smp in fam.samples:
            samples[(smp.name, frozenset(smp.labels.items()))] = smp.value
    return samples, types


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


@pytest.mark.timeout(10)
def test_collector_names_labels_values():
    s = populated()
    samples, types = scrape_text(generate_latest(make_registry(s, host="mac1")).decode())
    assert types["mccl_collective_duration_seconds"] == "histogram"
    for counter in ("mccl_peer_sent_bytes", "mccl_peer_received_bytes", "mccl_errors",
                    "mccl_collective_bytes", "mccl_collective_bus_bytes"):
        assert types[counter] == "counter"

    h = dict(op="allreduce", size_bucket="le_16MiB")
    assert value(samples, "mccl_collective_duration_seconds_count", **h) == 3
    assert value(samples, "mccl_collective_duration_seconds_sum", **h) == pytest.approx(0.06)
    assert value(samples, "mccl_collective_duration_seconds_bucket", le="0.01", **h) == 0
    assert value(samples, "mccl_collective_duration_seconds_bucket", le="0.025", **h) == 3
    assert value(samples, "mccl_collective_duration_seconds_bucket", le="+Inf", **h) == 3
    assert value(samples, "mccl_collective_duration_seconds_count",
                 op="allgather", size_bucket="le_4KiB") == 1

    assert value(samples, "mccl_collective_bytes_total", op="allreduce") == 3 * (8 << 20)
    # all-reduce on 4 ranks: bus bytes = 2(n-1)/n = 1.5 x buffer bytes
    busbw = 1.5 * (8 << 20) / 0.02
    assert value(samples, "mccl_busbw_bytes_per_second", op="allreduce") == pytest.approx(busbw)
    assert value(samples, "mccl_busbw_link_ratio", op="allreduce") == pytest.approx(busbw / 1e9)

    assert value(samples, "mccl_peer_sent_bytes_total", peer=PEER_A) == 1000
    assert value(samples, "mccl_peer_received_bytes_total", peer=PEER_A) == 2000
    assert value(samples, "mccl_peer_up", peer=PEER_A) == 1
    assert value(samples, "mccl_peer_up", peer=PEER_B) == 0
    assert value(samples, "mccl_link_ceiling_bytes_per_second", peer=PEER_A) == 1e9
    assert value(samples, "mccl_errors_total", kind="PeerLostError") == 1
    assert value(samples, "mccl_attached_processes") == 2
    assert value(samples, "mccl_host_state", state="training") == 1
    assert value(samples, "mccl_host_state", state="idle") == 0
    assert value(samples, "mccl_overlap_ratio", job_id="jobA", rank="1") == pytest.approx(0.7)
    assert value(samples, "mccl_overlap_ratio_mean", job_id="jobA", rank="1") == pytest.approx(0.6)
    assert value(samples, "mccl_rank_speed_samples_per_second", job_id="jobA", rank="1") == pytest.approx(12.5)
    assert value(samples, "mccl_rank_batch_share", job_id="jobA", rank="1") == 11
    assert value(samples, "mccl_job_world_size", job_id="jobA") == 4
    assert value(samples, "mccl_job_collectives_total", job_id="jobA") == 4
    assert value(samples, "mccl_job_bytes_total", job_id="jobA") == 3 * (8 << 20) + 1000
    assert value(samples, "mccl_errors_total", kind="CollectiveTimeout") == 0  # known kinds start at 0
    assert value(samples, "mccl_build_info", version=st.mccl_version(), hostname="mac1",
                 python=__import__("platform").python_version(),
                 system=__import__("platform").system()) == 1
    assert value(samples, "mccl_uptime_seconds") >= 0


@pytest.mark.timeout(10)
def test_collector_reads_live_state_at_each_scrape():
    s = st.DaemonStats()
    registry = make_registry(s)
    samples, _ = scrape_text(generate_latest(registry).decode())
    assert not any(name == "mccl_peer_up" for name, _ in samples)
    assert value(samples, "mccl_errors_total", kind="CollectiveTimeout") == 0
    s.set_peer_up(PEER_A, True)
    s.record_error("CollectiveTimeout")
    samples, _ = scrape_text(generate_latest(registry).decode())
    assert value(samples, "mccl_peer_up", peer=PEER_A) == 1
    assert value(samples, "mccl_errors_total", kind="CollectiveTimeout") == 1


@pytest.mark.timeout(10)
def test_data_socket_pool_is_read_at_each_scrape():
    pool = [{"host": "mac2", "idle": 2, "leased": 0, "ids": [1, 2], "uses": 4, "dialled": 2, "accepted": 0,
             "discarded": 0}]
    registry = make_registry(st.DaemonStats(), data_links=lambda: pool)
    samples, types = scrape_text(generate_latest(registry).decode())
    assert types["mccl_data_sockets"] == "gauge" and types["mccl_data_sockets_opened"] == "counter"
    assert value(samples, "mccl_data_sockets", peer_host="mac2", state="idle") == 2
    assert value(samples, "mccl_data_sockets_opened_total", peer_host="mac2", direction="dialled") == 2
    pool[0].update(idle=0, leased=2, discarded=1)  # a job took them; one earlier socket was dropped
    samples, _ = scrape_text(generate_latest(registry).decode())
    assert value(samples, "mccl_data_sockets", peer_host="mac2", state="leased") == 2
    assert value(samples, "mccl_data_sockets_discarded_total", peer_host="mac2") == 1


@pytest.mark.timeout(20)
def test_metrics_server_serves_and_stops():
    s = populated()
    server = MetricsServer(s, addr="127.0.0.1", port=0)
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            samples, _ = scrape_text(r.read().decode())
        assert value(samples, "mccl_attached_processes") == 2
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)


@pytest.mark.timeout(20)
def test_metrics_port_in_use_is_a_clear_config_error():
    from mccl_common.errors import ConfigError
    first = MetricsServer(st.DaemonStats(), addr="127.0.0.1", port=0)
    first.start()
    try:
        second = MetricsServer(st.DaemonStats(), addr="127.0.0.1", port=first.port)
        with pytest.raises(ConfigError, match="MCCL_METRICS_PORT"):
            second.start()
    finally:
        first.stop()
