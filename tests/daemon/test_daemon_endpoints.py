"""What mccld says of its own endpoints (what `mcclctl doctor` checks), MCCL_DISCOVERY=off, and
how long a finished job stays listed (with its age and how it ended)."""

from __future__ import annotations

import pytest

from mccl_common.daemon_settings import load_config
from mccl_common.errors import ConfigError
from mccl_common.netif import interface_of
from mccld.report.stats import DaemonStats
from mccld.report.status_server import merge_status
from support.daemon import running_daemon


@pytest.mark.timeout(60)
def test_a_loopback_daemon_with_discovery_off_runs_no_mdns_and_reports_its_endpoints():
    with running_daemon(MCCL_DISCOVERY="off") as (d, _env):
        # No zeroconf browser nor advertiser: nothing multicasts from a loopback daemon.
        assert d.fleet.fleet is None and d.fleet.advertiser is None
        ends = d.status_provider()["endpoints"]
        link_port = int(d.links.address.rsplit(":", 1)[1])
        assert ends == {"iface": interface_of("127.0.0.1"), "addr": "127.0.0.1", "link_port": link_port, "status_port": 0,
                        "metrics_port": 0, "metrics_addr": "", "launch_port": 0, "discovery": "off"}
        assert link_port > 0 and ends["iface"]      # "lo" on Linux, "lo0" on macOS: never empty


@pytest.mark.timeout(10)
def test_discovery_setting_is_checked():
    assert load_config(env={}).discovery == "mdns"
    with pytest.raises(ConfigError, match="MCCL_DISCOVERY.*mdns or off"):
        load_config(env={"MCCL_DISCOVERY": "zeroconf"})


@pytest.mark.timeout(10)
def test_a_finished_job_is_listed_as_ended_with_its_age_then_forgotten():
    now = [1000.0]
    stats = DaemonStats(clock=lambda: now[0])
    stats.record_collective("j1", "allreduce", 1024, 0.01, 2)
    now[0] += 60
    stats.end_job("j1", 2, failed=False, age_s=70.0)
    stats.end_job("j2", 4, failed=True, age_s=3.0)      # failed before its first collective
    now[0] += 30
    daemon = {"host": "h", "address": "", "jobs": [{"job": "j3", "ranks": [0], "world": 1, "state": "ready",
                                                    "age_s": 5.0}]}
    jobs = {j["job"]: j for j in merge_status(daemon, stats.snapshot(), tcp_text="")["jobs"]}
    assert jobs["j3"]["state"] == "ready"      # live: as the daemon says
    assert (jobs["j1"]["state"], jobs["j1"]["outcome"], jobs["j1"]["ended_s_ago"], jobs["j1"]["age_s"]) == \
        ("ended", "ok", 30.0, 100.0)
    assert (jobs["j2"]["state"], jobs["j2"]["outcome"], jobs["j2"]["world"]) == ("ended", "failed", 4)
    assert jobs["j1"]["ranks"] == [] and jobs["j1"]["collectives"] == 1
    now[0] += 301                               # JOB_STALE_AFTER_S past its end: gone
    assert merge_status({**daemon, "jobs": []}, stats.snapshot(), tcp_text="")["jobs"] == []
