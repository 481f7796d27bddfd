"""mcclctl finds daemons in the local mccld's fleet table (gossip reaches every subnet) and asks
them all at once under one deadline: a hung host costs the deadline once, not per host."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from mccld.report.status_server import StatusServer
from mcclctl import targets

KEY = bytes(range(32))


class _Hung:
    """A status port that accepts and never answers, counting the connections it holds open at
    once: asks made in turn would never have two."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.02)
        self.port = self.sock.getsockname()[1]
        self.most_open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        held: list[socket.socket] = []
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
                held.append(c)
            except socket.timeout:
                pass
            for c in [c for c in held if select.select([c], [], [], 0)[0]]:
                try:
                    closed = not c.recv(4096, socket.MSG_PEEK)
                except OSError:
                    closed = True
                if closed:
                    held.remove(c)
                    c.close()
            self.most_open = max(self.most_open, len(held))
        for c in held:
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


def _server(host: str, table: list[dict] | None = None) -> StatusServer:
    srv = StatusServer(lambda: {"host": host, "address": "", "jobs": [], "links": [], "fleet_table": table or []},
                       KEY, "127.0.0.1", 0)
    srv.start()
    return srv


@pytest.mark.timeout(60)
def test_status_targets_come_from_the_local_daemons_table_and_a_hung_host_costs_one_deadline(monkeypatch):
    remote = [_server(f"far{i}") for i in range(3)]
    hung = _Hung()
    rows = [{"host_id": f"far{i}", "addresses": ["127.0.0.1"], "port": 29650, "status_port": s.port,
             "metrics_port": 0, "source": "gossip"} for i, s in enumerate(remote)]
    rows.append({"host_id": "hung", "addresses": ["127.0.0.1"], "port": 29650,
                 "status_port": hung.port, "metrics_port": 0, "source": "gossip"})
    local = _server("local", rows)
    try:
        monkeypatch.setenv("MCCL_LISTEN_ADDR", "127.0.0.1")
        monkeypatch.setenv("MCCL_STATUS_PORT", str(local.port))
        t0 = time.monotonic()
        found = targets.discover(30.0, KEY)     # no mDNS wait: the table answers
        assert time.monotonic() - t0 < 10.0
        assert [t.host for t in found] == ["far0", "far1", "far2", "hung"]
        assert found[0].status_addr == f"127.0.0.1:{remote[0].port}"

        # Each real host asked once, as mcclctl does, and the hung one ten times. Ten asks at once to
        # one real server were more unauthenticated connections from one address than its gate
        # allows (MCCL_MAX_UNAUTH_PER_PEER, 8): on a loaded machine the oldest were closed (ci25).
        # The deadline is each ask's, and the hung ones are open at once, so a generous one costs
        # the test one deadline; 1 s let a real server's answer miss it (ci23).
        replies = targets.fetch(found[:3] + [found[3]] * 10, KEY, "status", timeout_s=5.0)
        # The event, where a wall-clock bound (< 6 s) stood: the ten hung asks were all open at
        # once (in turn, at most one would be).
        assert hung.most_open == 10, f"{hung.most_open} hung asks in flight at once: they were waited for in turn"
        by_host = {}
        for r in replies:
            by_host.setdefault(r.target.host, set()).add(r.error is None)
        assert by_host == {"far0": {True}, "far1": {True}, "far2": {True}, "hung": {False}}, \
            [r.error for r in replies if r.error and r.target.host != "hung"]
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


def _row(host: str, fleet: str, port: int) -> dict:
    return {"host_id": host, "fleet": fleet, "addresses": ["127.0.0.1"], "port": 29650, "status_port": port,
            "metrics_port": 0, "source": "gossip"}


@pytest.mark.timeout(60)
def test_only_the_asked_fleet_is_shown_and_an_empty_one_names_the_others(monkeypatch, capsys, tmp_path):
    lab, studio = _server("lab1"), _server("studio1")
    local = _server("local", [_row("lab1", "lab", lab.port), _row("studio1", "studio", studio.port)])
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    # mDNS must not even be tried here: MCCL_DISCOVERY=off.
    monkeypatch.setattr("mccl_common.discovery.browse_fleet", lambda *a, **k: pytest.fail("mDNS browsed"))
    for name, value in (("MCCL_LISTEN_ADDR", "127.0.0.1"), ("MCCL_STATUS_PORT", str(local.port)),
                        ("MCCL_KEY_FILE", str(key_file)), ("MCCL_DISCOVERY", "off"), ("MCCL_FLEET", "lab")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MCCL_FLEET_KEY", raising=False)
    try:
        found = targets.find_fleet(30.0, KEY)
        assert (found.name, [t.host for t in found.targets], found.others) == ("lab", ["lab1"], {"studio": 1})
        assert [t.host for t in targets.discover(30.0, KEY, "studio")] == ["studio1"]

        from mcclctl.__main__ import main
        assert main(["status", "--fleet", "studio", "--json"]) == 0
        import json
        data = json.loads(capsys.readouterr().out)
        assert [d["host"] for d in data["daemons"]] == ["studio1"]
        assert data["fleet"] == {"name": "studio", "source": "this host's mccld", "daemons": 1, "reported": [],
                                 "other_fleets": {"lab": 1}}
        assert main(["jobs"]) == 0          # MCCL_FLEET=lab
        assert capsys.readouterr().out.splitlines()[0] == \
            "fleet lab: 1 daemon (from this host's mccld); other fleets seen: studio (1)"
        # A fleet nobody is in: exit 2 with an error naming it, and the fleets that are there.
        assert main(["status", "--fleet", "nope"]) == 2
        err = capsys.readouterr().err
        assert "no daemon of fleet 'nope' found" in err and "mDNS is off (MCCL_DISCOVERY=off)" in err
        assert "other fleets answered: lab (1), studio (1): pass --fleet NAME" in err
    finally:
        for s in (lab, studio, local):
            s.stop()
