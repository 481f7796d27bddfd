"""A flood of mDNS announcements (issue 24, item 5): anyone on the LAN may announce as many
``_mccl._tcp`` services as it likes; the daemon's resolve queue and fleet table stay bounded.
The announcements reach the table as zeroconf hands them over (``_on_service``), resolved by
a stand-in for zeroconf that answers every name, as a flooding host would."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from zeroconf import ServiceInfo, ServiceStateChange

from mccl_common import discovery

FLOOD = 20_000
BOUND = 4096          # what any sane bound must stay under (the module's are 1024)


class _AnswersEverything:
    """Resolves any name to a daemon of our fleet, as a host forging announcements makes it."""

    def get_service_info(self, service_type: str, name: str, timeout: int) -> ServiceInfo:
        host = name.split(".")[0]
        return ServiceInfo(service_type, name, addresses=[socket.inet_aton("10.9.9.9")], port=29650,
                           properties={"fleet": "f", "host": host, "proto": "1"}, server=f"{host}.local.")


@pytest.mark.timeout(180)
def test_a_flood_of_announcements_keeps_the_queue_and_the_table_bounded(caplog):
    """On b865314 both were unbounded: 20,000 forged names queued 20,000 resolutions and the
    table grew to 20,000 hosts (each a dict and a log line)."""
    caplog.set_level(logging.DEBUG, logger="mccl_common.discovery")
    table = discovery.FleetTable("f")
    table.zc = _AnswersEverything()
    for i in range(FLOOD):
        table._on_service(None, discovery.SERVICE_TYPE, f"forged{i}.{discovery.SERVICE_TYPE}",
                          ServiceStateChange.Added)
        if i % 2 == 0:   # zeroconf reports updates of a name too: each waits once
            table._on_service(None, discovery.SERVICE_TYPE, f"forged{i}.{discovery.SERVICE_TYPE}",
                              ServiceStateChange.Updated)
    assert table._todo.qsize() <= BOUND, f"{table._todo.qsize()} announcements wait to be resolved"
    resolver = threading.Thread(target=table._resolve_loop, daemon=True)
    resolver.start()
    try:
        until = time.monotonic() + 120
        while table._todo.qsize() and time.monotonic() < until:
            time.sleep(0.05)
        time.sleep(0.2)
        assert len(table.entries()) <= BOUND, f"the fleet table holds {len(table.entries())} hosts"
        # More forged names while the table is full: still bounded, and logged at WARNING once.
        for i in range(FLOOD, FLOOD + 2000):
            table._on_service(None, discovery.SERVICE_TYPE, f"forged{i}.{discovery.SERVICE_TYPE}",
                              ServiceStateChange.Added)
        until = time.monotonic() + 60
        while table._todo.qsize() and time.monotonic() < until:
            time.sleep(0.05)
        time.sleep(0.2)
        assert len(table.entries()) <= BOUND
        flood_warnings = [r for r in caplog.records if r.levelname == "WARNING" and "floods" in r.getMessage()]
        assert len(flood_warnings) == 1, [r.getMessage() for r in flood_warnings]
    finally:
        table._stop.set()
        resolver.join(10)
