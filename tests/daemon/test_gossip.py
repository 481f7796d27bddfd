"""Fleet-table gossip on loopback (mccld/net/gossip.py over real authenticated LinkManagers): seeds,
convergence, expiry, validation at the boundary, and what a hostile fleet member cannot do."""

from __future__ import annotations

import logging
import time

import pytest

from mccl_common import gossip_protocol as gp
from mccl_common.daemon_settings import load_config
from mccl_common.errors import ConfigError

from mccld.net import gossip as gossip_mod
from mccld.net.gossip import Gossip
from mccld.net.links import LinkManager

KEY = b"g" * 32
FLEET = "gt"
INTERVAL, TTL = 0.2, 2.0


class Node:
    """One daemon's links and gossip, nothing else."""

    def __init__(self, host_id: str, seeds: list[str] = (), key: bytes = KEY, ttl: float = TTL):
        self.host_id = host_id
        self.links = LinkManager(key, FLEET, host_id, "127.0.0.1", 0, 2.0, self._on_message)
        self.links.start()
        port = int(self.links.address.rpartition(":")[2])
        self.fields = {"proto": 1, "addresses": ["127.0.0.1"], "port": port, "status_port": 0, "metrics_port": 0,
                       "cores": 4, "memory": 1 << 30, "device": "cpu-x86_64", "state": "idle", "harvest": "busy",
                       "version": "0.1.0"}
        self.gossip = Gossip(FLEET, host_id, self.links, lambda: dict(self.fields),
                             [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in seeds], INTERVAL, ttl)

    def _on_message(self, peer: str, msg: dict) -> None:
        self.gossip.on_message(peer, msg)

    @property
    def addr(self) -> str:
        return self.links.address

    def start(self) -> "Node":
        self.gossip.start()
        return self

    def known(self) -> set[str]:
        return {r["host_id"] for r in self.gossip.rows()}

    def stop(self) -> None:
        self.gossip.stop()
        self.links.stop()


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(*args, **kw) -> Node:
        made.append(Node(*args, **kw))
        return made[-1]
    yield make
    for n in made:         # no gossip dials while the links go down
        n.gossip.stop()
    for n in made:
        n.stop()


# ---- settings and validation -------------------------------------------------------------------

def test_mccl_peers_parses_hosts_ports_and_names_and_names_the_bad_entry():
    cfg = load_config(env={"MCCL_PEERS": " 10.0.0.5, seeds.example.net:29700,b-2 ", "MCCL_PORT": "29650"})
    assert cfg.seeds() == [("10.0.0.5", 29650), ("seeds.example.net", 29700), ("b-2", 29650)]
    assert load_config(env={}).seeds() == []
    for bad, named in (("10.0.0.5,,b", "empty entry"), ("a:0", "'a:0'"), ("a:99999", "'a:99999'"),
                       ("a:x", "'a:x'"), ("300.1.2.3", "'300.1.2.3'"), ("bad_name!", "'bad_name!'"),
                       ("-lead.example", "'-lead.example'")):
        with pytest.raises(ConfigError, match=named):
            load_config(env={"MCCL_PEERS": bad})
    with pytest.raises(ConfigError, match="MCCL_GOSSIP_TTL"):
        load_config(env={"MCCL_GOSSIP_INTERVAL": "5", "MCCL_GOSSIP_TTL": "10"})


def _entry(host: str = "h1", **over) -> dict:
    return {"host_id": host, "incarnation": 1000, "counter": 1, "fleet": FLEET, "proto": 1,
            "addresses": ["10.1.0.2"], "port": 29650, "status_port": 29651, "metrics_port": 0, "cores": 8,
            "memory": 1 << 34, "device": "apple-silicon", "state": "idle", "harvest": "idle", "version": "0.1.0",
            **over}


@pytest.mark.parametrize("over", [
    {"host_id": "../etc"}, {"host_id": ""}, {"host_id": 7}, {"addresses": []}, {"addresses": ["10.1.0.2"] * 9},
    {"addresses": ["not-an-ip"]}, {"addresses": ["224.0.0.251"]}, {"addresses": ["0.0.0.0"]}, {"port": 0},
    {"port": 70000}, {"port": True}, {"counter": -1}, {"counter": 1.5}, {"incarnation": 10 ** 15},
    {"state": "evil"}, {"harvest": "x"}, {"device": "x" * 65}, {"version": "\n"}, {"fleet": "other"},
    {"memory": 1 << 61}, {"extra" + str(i): 0 for i in range(20)},
])
def test_a_malformed_entry_is_refused_naming_what(over):
    with pytest.raises(ValueError):
        gp.check_entry(_entry(**over), FLEET, now_ms=2000)


def test_messages_are_bounded_and_checked_whole():
    now = int(time.time() * 1000)
    good = gp.check_entry(_entry(), FLEET, now)
    assert good.link_addr == "10.1.0.2:29650" and good.key == (1000, 1)
    with pytest.raises(ValueError, match="at most"):
        gp.check_entries({"entries": [_entry(f"h{i}") for i in range(gp.MAX_ENTRIES_PER_MESSAGE + 1)]}, FLEET, now)
    with pytest.raises(ValueError, match="repeated"):
        gp.check_entries({"entries": [_entry(), _entry()]}, FLEET, now)
    with pytest.raises(ValueError):   # one bad entry refuses the message, not just itself
        gp.check_entries({"entries": [_entry("a"), _entry("b", port=-1)]}, FLEET, now)
    with pytest.raises(ValueError):
        gp.check_digest({"digest": [["h1", 1, 2, 3]]}, now)
    with pytest.raises(ValueError):
        gp.check_digest({"digest": {"h1": [1, 2]}}, now)
    assert gp.check_digest({"digest": [["h1", 5, 6]]}, now) == {"h1": (5, 6)}


# ---- convergence and expiry --------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_chain_of_seeds_gives_every_daemon_the_whole_fleet_and_a_dead_one_expires(nodes):
    first = nodes("n0")
    chain = [first]
    for i in range(1, 6):       # each knows only the one before it
        chain.append(nodes(f"n{i}", seeds=[chain[-1].addr]))
    for n in chain:
        n.start()
    everyone = {n.host_id for n in chain}
    wait_for(lambda: all(n.known() == everyone for n in chain), 20, "every node to know all six")
    rows = {r["host_id"]: r for r in chain[0].gossip.rows()}
    assert rows["n5"]["addresses"] == ["127.0.0.1"] and rows["n5"]["port"] == int(chain[5].addr.rpartition(":")[2])
    assert rows["n5"]["source"] == "gossip" and rows["n5"]["harvest"] == "busy"

    # The owner changes its state: the change travels (only the owner makes a new version).
    chain[5].fields["harvest"] = "idle"
    wait_for(lambda: {r["host_id"]: r for r in chain[0].gossip.rows()}["n5"]["harvest"] == "idle", 10,
             "n5's harvest state to reach n0")

    chain[3].stop()              # dies without a word: the others relay its last version only
    wait_for(lambda: all("n3" not in n.known() for n in chain if n is not chain[3]), 4 * TTL + 5,
             "n3 to expire everywhere")
    assert all(n.known() == everyone - {"n3"} for n in chain if n is not chain[3])


@pytest.mark.timeout(60)
def test_a_dead_seed_is_logged_once_at_warning_then_debug_and_retried_with_backoff(nodes, caplog):
    caplog.set_level(logging.DEBUG, logger="mccld.net.gossip")
    lone = nodes("lone", seeds=["127.0.0.1:9"]).start()    # port 9 (discard): nothing listens
    wait_for(lambda: sum("seed 127.0.0.1:9" in r.getMessage() for r in caplog.records) >= 3, 20,
             "three attempts on the dead seed")
    seed_logs = [r for r in caplog.records if "seed 127.0.0.1:9" in r.getMessage()]
    assert [r.levelno for r in seed_logs][:1] == [logging.WARNING]
    assert all(r.levelno == logging.DEBUG for r in seed_logs[1:])
    (seed,) = lone.gossip._seeds  # noqa: SLF001 - the backoff grows past the interval
    assert seed.failures >= 3 and seed.backoff > INTERVAL


# ---- the boundary: strangers and hostile members -----------------------------------------------

@pytest.mark.timeout(60)
def test_a_daemon_without_the_fleet_key_never_enters_a_table(nodes):
    a = nodes("a").start()
    b = nodes("b", seeds=[a.addr]).start()
    intruder = nodes("intruder", seeds=[a.addr, b.addr], key=b"x" * 32).start()
    wait_for(lambda: a.known() == {"a", "b"} and b.known() == {"a", "b"}, 15, "a and b to find each other")
    time.sleep(10 * INTERVAL)     # many rounds of the intruder trying
    assert a.known() == b.known() == {"a", "b"}
    assert intruder.known() == {"intruder"}


class Hostile:
    """An authenticated fleet member that writes whatever gossip it likes to one peer."""

    def __init__(self, target: Node):
        self.links = LinkManager(KEY, FLEET, "mallory", "127.0.0.1", 0, 2.0, lambda peer, msg: None)
        self.links.start()
        self.link = self.links.link_to(target.addr)

    def send(self, msg: dict) -> None:
        self.link.send(msg)

    def stop(self) -> None:
        self.links.stop()


@pytest.mark.timeout(60)
def test_a_member_cannot_take_over_another_hosts_entry_fill_the_table_or_refresh_the_dead(nodes, caplog,
                                                                                        monkeypatch):
    caplog.set_level(logging.DEBUG, logger="mccld.net.gossip")
    monkeypatch.setattr(gossip_mod, "MAX_NEW_PER_PEER", 20)
    victim = nodes("victim").start()
    witness = nodes("witness", seeds=[victim.addr]).start()
    wait_for(lambda: witness.known() == {"victim", "witness"}, 15, "witness to learn victim")
    mallory = Hostile(witness)
    try:
        now = int(time.time() * 1000)
        # 1. A forged, newer entry for the victim, pointing at an address of mallory's choosing.
        # A relay cannot tell it from the owner's (a shared key proves membership, not identity)...
        forged = _entry("victim", incarnation=now + 1000, counter=50, addresses=["192.0.2.66"])
        mallory.send({"type": gp.ENTRIES, "entries": [forged], "want": []})
        wait_for(lambda: any("never made" in r.getMessage() and r.levelno == logging.WARNING
                             for r in caplog.records), 15, "the victim to hear of the forged entry")
        # ...but the victim hears of it, refutes and outranks it; the witness ends with the truth.
        wait_for(lambda: {r["host_id"]: r for r in witness.gossip.rows()}["victim"]["addresses"] == ["127.0.0.1"],
                 15, "the victim's own entry to win back")
        assert any("never made" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
        # 2. An incarnation far in the future (it would outrank the owner for good): refused whole.
        mallory.send({"type": gp.ENTRIES, "want": [],
                      "entries": [_entry("victim", incarnation=now + 2 * gp.MAX_FUTURE_MS, addresses=["192.0.2.66"])]})
        # 3. A flood of invented hosts: one member introduces at most MAX_NEW_PER_PEER per TTL.
        for base in range(0, 100, 50):
            mallory.send({"type": gp.ENTRIES, "want": [],
                          "entries": [_entry(f"fake{i}", incarnation=now, addresses=["10.9.0.1"])
                                      for i in range(base, base + 50)]})
        # 4. Garbage: dropped, with a log naming the peer; the link and the gossip live on.
        mallory.send({"type": gp.ENTRIES, "entries": "lots", "want": []})
        mallory.send({"type": gp.DIGEST, "digest": [["x", "y", "z"]]})
        wait_for(lambda: any("malformed gossip_digest from peer mallory" in r.getMessage() for r in caplog.records),
                 10, "the malformed digest (sent last) to be logged")
        fakes = {h for h in witness.known() if h.startswith("fake")}
        assert len(fakes) == 20, f"{len(fakes)} invented hosts taken from one peer"
        assert {r["host_id"]: r for r in witness.gossip.rows()}["victim"]["addresses"] == ["127.0.0.1"]
        # 5. Re-sending the same (not newer) versions refreshes nothing: the invented hosts expire.
        deadline = time.monotonic() + 3 * TTL
        while time.monotonic() < deadline and any(h.startswith("fake") for h in witness.known()):
            mallory.send({"type": gp.ENTRIES, "want": [],
                          "entries": [_entry(f"fake{i}", incarnation=now, addresses=["10.9.0.1"]) for i in range(20)]})
            time.sleep(INTERVAL)
        assert not any(h.startswith("fake") for h in witness.known())
        assert {"victim", "witness"} <= witness.known()
    finally:
        mallory.stop()


@pytest.mark.timeout(60)
def test_mdns_seeing_a_host_leave_drops_it_at_once_and_its_next_heartbeat_brings_it_back(nodes):
    a = nodes("a", ttl=30.0).start()
    b = nodes("b", seeds=[a.addr], ttl=30.0).start()
    wait_for(lambda: "b" in a.known(), 15, "a to learn b")
    a.gossip.forget("b")          # what mccld does when mDNS reports b gone
    assert "b" not in a.known()
    wait_for(lambda: "b" in a.known(), 15, "b's next heartbeat to bring it back")   # it was alive after all
    b.stop()
    a.gossip.forget("b")
    time.sleep(10 * INTERVAL)     # nobody relays b's last version back in
    assert "b" not in a.known()
