"""What mccld's unauthenticated /metrics tells whom (issue 24, item 7): by default it listens
on the fleet interface (the links' address), not on every interface, and figures that tell
when the host's user is away are exported only when opted in (MCCL_METRICS_PRESENCE=1)."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.daemon import running_daemon
from support.ports import free_port

from mccl_common.daemon_settings import load_config

FLEET_IF = "127.0.0.3"      # the daemon's "fleet interface"; 127.0.0.1 stands for any other one
PRESENCE = ("mccl_host_idle_seconds", "mccl_harvestable_seconds_per_night", "mccl_harvest_nights")


def _scrape(ip: str, port: int) -> set[str]:
    with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10.0) as r:
        return {s.name for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples}


def _away_for_an_hour(tmp_path):
    act = tmp_path / "activity"
    act.touch()
    os.utime(act, (time.time() - 3600, time.time() - 3600))
    return str(act)


@pytest.mark.timeout(60)
def test_metrics_bind_the_fleet_interface_and_hide_presence_by_default(tmp_path):
    """On b865314 /metrics listened on 0.0.0.0 (every interface: a café's Wi-Fi included) and
    published mccl_host_idle_seconds, i.e. how long the host's user has been away."""
    assert load_config(env={}).metrics_addr != "0.0.0.0"
    port = free_port()
    env = {"MCCL_LISTEN_ADDR": FLEET_IF, "MCCL_METRICS_PORT": str(port),
           "MCCL_ACTIVITY_FILE": _away_for_an_hour(tmp_path), "MCCL_IDLE_AFTER": "600", "MCCL_HARVEST_POLL": "0.1"}
    with running_daemon(**env) as (d, _):
        srv = next(s for s in d._servers if type(s).__name__ == "MetricsServer")
        assert srv.address == f"{FLEET_IF}:{port}"
        with pytest.raises(OSError):          # not on another interface
            socket.create_connection(("127.0.0.1", port), timeout=2.0).close()
        until = time.monotonic() + 20
        while "mccl_harvest_state" not in (names := _scrape(FLEET_IF, port)) and time.monotonic() < until:
            time.sleep(0.1)
        assert "mccl_harvest_state" in names and "mccl_uptime_seconds" in names
        assert not set(PRESENCE) & names, f"presence figures exported without opt-in: {set(PRESENCE) & names}"


@pytest.mark.timeout(60)
def test_presence_figures_are_there_when_opted_in(tmp_path):
    port = free_port()
    env = {"MCCL_LISTEN_ADDR": FLEET_IF, "MCCL_METRICS_PORT": str(port), "MCCL_METRICS_PRESENCE": "1",
           "MCCL_ACTIVITY_FILE": _away_for_an_hour(tmp_path), "MCCL_IDLE_AFTER": "600", "MCCL_HARVEST_POLL": "0.1"}
    with running_daemon(**env):
        until = time.monotonic() + 20
        while "mccl_host_idle_seconds" not in (names := _scrape(FLEET_IF, port)) and time.monotonic() < until:
            time.sleep(0.1)
        assert "mccl_host_idle_seconds" in names and "mccl_harvest_nights" in names
