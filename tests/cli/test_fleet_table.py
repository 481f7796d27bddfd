"""mcclctl finds daemons in the local mccld's fleet table (gossip reaches every subnet) and asks
them all at once under one deadline: a hung host costs the deadline once, not per host."""

from __future__ import annotations

import socket
import time

import pytest

from mccld.report.status_server import StatusServer
from mcclctl import targets

KEY = bytes(range(32))


def _server(host: str, table: list[dict] | None = None) -> StatusServer:
    srv = StatusServer(lambda: {"host": host, "address": "", "jobs": [], "links": [], "fleet_table": table or []},
                       KEY, "127.0.0.1", 0)
    srv.start()
    return srv


@pytest.mark.timeout(60)
def test_status_targets_come_from_the_local_daemons_table_and_a_hung_host_costs_one_deadline(monkeypatch):
    remote = [_server(f"far{i}") for i in range(3)]
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)           # connects complete in the backlog; nothing ever answers
    rows = [{"host_id": f"far{i}", "addresses": ["127.0.0.1"], "port": 29650, "status_port": s.port,
             "metrics_port": 0, "source": "gossip"} for i, s in enumerate(remote)]
    rows.append({"host_id": "hung", "addresses": ["127.0.0.1"], "port": 29650,
                 "status_port": hung.getsockname()[1], "metrics_port": 0, "source": "gossip"})
    local = _server("local", rows)
    try:
        monkeypatch.setenv("MCCL_LISTEN_ADDR", "127.0.0.1")
        monkeypatch.setenv("MCCL_STATUS_PORT", str(local.port))
        t0 = time.monotonic()
        found = targets.discover(30.0, KEY)     # no mDNS wait: the table answers
        assert time.monotonic() - t0 < 10.0
        assert [t.host for t in found] == ["far0", "far1", "far2", "hung"]
        assert found[0].status_addr == f"127.0.0.1:{remote[0].port}"

        t0 = time.monotonic()
        replies = targets.fetch(found * 10, KEY, "status", timeout_s=1.0)    # 40 asks, 10 of them hung
        took = time.monotonic() - t0
        assert took < 1.0 + 5.0, f"{took:.1f} s: hung hosts were waited for in turn"
        by_host = {}
        for r in replies:
            by_host.setdefault(r.target.host, set()).add(r.error is None)
        assert by_host == {"far0": {True}, "far1": {True}, "far2": {True}, "hung": {False}}
        assert all("DaemonUnavailableError" in r.error for r in replies if r.target.host == "hung")
    finally:
        hung.close()
        for s in remote + [local]:
            s.stop()


def test_without_a_key_or_a_local_daemon_discovery_falls_back_to_mdns(monkeypatch):
    seen = []
    monkeypatch.setattr("mccl_common.discovery.browse_fleet",
                        lambda timeout_s, fleet=None: seen.append(timeout_s) or
                        [{"host_id": "lan1", "addresses": ["10.0.0.9"], "status_port": 29651, "metrics_port": 0}])
    monkeypatch.setenv("MCCL_LISTEN_ADDR", "127.0.0.1")
    monkeypatch.setenv("MCCL_STATUS_PORT", "9")          # nothing answers there
    assert [t.host for t in targets.discover(0.5, None)] == ["lan1"] and seen == [0.5]
    assert [t.host for t in targets.discover(0.5, KEY)] == ["lan1"] and seen == [0.5, 0.5]
