"""mccld/net/topology.py: daemons measuring echo RTTs over their links and agreeing on switches.

The links are a fake that delivers each message on a thread of its own after a delay set per
pair of hosts (two switches: slow between them), as the link reader threads would."""

from __future__ import annotations

import threading
import time

import pytest

from mccld.net.topology import SwitchMap, fleet_peers

pytestmark = pytest.mark.timeout(60)

SWITCH = {"a0": 0, "a1": 0, "a2": 0, "b0": 1, "b1": 1}


class FakeLinks:
    maps: dict[str, SwitchMap] = {}

    def __init__(self, me: str):
        self.me = me

    def send(self, addr: str, msg: dict) -> None:
        peer = addr.split(":")[0]
        # One way. Far apart, so a loaded CI box (threads woken late by tens of ms) still shows
        # two classes: 0.5 ms against 6 ms once measured 10 and 18 ms beside two busy loops.
        delay = 0.001 if SWITCH[self.me] == SWITCH[peer] else 0.08

        def deliver():
            time.sleep(delay)
            self.maps[peer].on_message(self.me, msg)
        threading.Thread(target=deliver, daemon=True).start()

    def peers(self) -> list[dict]:
        return [{"host": h, "peer": f"{h}:1"} for h in SWITCH if h != self.me]

    def link_to(self, addr: str, quiet: bool = False):
        """LinkManager's way: the probes dial quietly (fleet tables hold hosts of other keys)."""
        assert quiet, "the topology's probes must dial quietly"
        links = self

        class _Link:
            def send(self, msg: dict) -> None:
                links.send(addr, msg)
        return _Link()


def test_daemons_agree_on_two_switches_and_show_their_rows(monkeypatch):
    import mccld.net.topology as topo
    monkeypatch.setattr(topo, "_TICK_S", 0.05)
    monkeypatch.setattr(topo, "_SETTLE_S", 0.1)
    monkeypatch.setattr(topo, "_GATHER_FAST_S", 0.2)
    maps = {h: SwitchMap(h, f"{h}:1", FakeLinks(h), lambda h=h: {p: f"{p}:1" for p in SWITCH if p != h})
            for h in SWITCH}
    FakeLinks.maps = maps
    for m in maps.values():
        m.start()
    try:
        deadline = time.monotonic() + 30
        while not all(m.switch() for m in maps.values()) or len({m.switch() for m in maps.values()}) != 2:
            assert time.monotonic() < deadline, {h: m.status() for h, m in maps.items()}
            time.sleep(0.1)
        time.sleep(0.5)  # every row gathered
        labels = {h: m.switch() for h, m in maps.items()}
        assert labels == {"a0": "sw-a0", "a1": "sw-a0", "a2": "sw-a0", "b0": "sw-b0", "b1": "sw-b0"}
        st = maps["a1"].status()
        assert st["source"] == "rtt" and st["configured"] is None and set(st["row"]) == set(SWITCH) - {"a1"}
        assert st["row"]["b0"] > 2 * st["row"]["a0"]
    finally:
        for m in maps.values():
            m.stop()


def test_a_configured_file_wins_and_a_host_it_omits_runs_flat(tmp_path):
    f = tmp_path / "topo"
    f.write_text("rack-a: a0 10.0.0.2\nrack-b: b0\n")
    assert SwitchMap("a0", "10.0.0.1:29650", None, dict, str(f)).switch() == "rack-a"
    assert SwitchMap("x", "10.0.0.2:29650", None, dict, str(f)).switch() == "rack-a"  # by its address
    lone = SwitchMap("zz", "10.0.0.9:29650", None, dict, str(f))
    assert lone.switch() == "" and lone.status()["source"] == "file"
    assert lone.status()["configured"] == {"rack-a": ["a0", "10.0.0.2"], "rack-b": ["b0"]}


def test_fleet_peers_are_the_other_daemons_by_link_address():
    rows = [{"host_id": "me", "addresses": ["10.0.0.1"], "port": 29650},
            {"host_id": "p", "addresses": ["10.0.0.2", "fe80::1"], "port": 29650, "source": "mdns"},
            {"host_id": "g", "addresses": ["10.1.0.7"], "port": 29650, "source": "gossip"},
            {"host_id": "q", "addresses": [], "port": 29650}]
    assert fleet_peers(rows, "me") == {"p": "10.0.0.2:29650", "g": "10.1.0.7:29650"}
    assert fleet_peers([], "me") == {}
