"""mccl_common/topology.py: the MCCL_TOPOLOGY file and switches inferred from RTTs."""

from __future__ import annotations

import random

import pytest

from mccl_common import topology
from mccl_common.errors import ConfigError


def test_the_file_names_each_hosts_switch():
    t = topology.parse("# studio\n\nrack-a: studio-01 studio-02 10.0.1.7   # top row\n"
                       "rack-b: studio-17, studio-18\nrack_c.2:studio-30\n")
    assert t.switches == {"rack-a": ("studio-01", "studio-02", "10.0.1.7"),
                          "rack-b": ("studio-17", "studio-18"), "rack_c.2": ("studio-30",)}
    assert t.switch_of("nope", "10.0.1.7") == "rack-a"
    assert t.switch_of("studio-18") == "rack-b"
    assert t.switch_of("studio-99") is None


@pytest.mark.parametrize("text,line,words", [
    ("rack-a: h1\nrack b: h2\n", 2, "expected `SWITCH: HOST"),
    ("rack-a h1 h2\n", 1, "expected `SWITCH: HOST"),
    ("rack-a: h1\n\nrack-b: h1\n", 3, "already on a switch at line 1"),
    ("rack-a: h1\nrack-a: h2\n", 2, "listed twice"),
    ("rack-a:\n", 1, "has no hosts"),
    ("rack-a: h1 h/2\n", 1, "is not a host id"),
    ("rack-a: h1 'x'\n", 1, "is not a host id"),
])
def test_bad_lines_are_config_errors_naming_the_line(text, line, words):
    with pytest.raises(ConfigError) as e:
        topology.parse(text, "MCCL_TOPOLOGY=/etc/t")
    assert f"MCCL_TOPOLOGY=/etc/t line {line}" in str(e.value) and words in str(e.value)


def test_an_empty_or_unreadable_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="names no switch"):
        topology.parse("# nothing\n")
    with pytest.raises(ConfigError, match="cannot read"):
        topology.load(str(tmp_path / "missing"))
    (tmp_path / "bin").write_bytes(b"rack: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        topology.load(str(tmp_path / "bin"))
    (tmp_path / "ok").write_text("a: h1\nb: h2\n")
    assert topology.load(str(tmp_path / "ok")).hosts() == {"h1": "a", "h2": "b"}


def test_switch_ids_number_switches_by_name_the_same_way_everywhere():
    assert topology.switch_ids(["b", "a", "b", "c"]) == [1, 0, 1, 2]
    assert topology.switch_ids(["a", "a"]) == []  # one switch: nothing to group


def matrix(switches: list[list[str]], near: float, far: float, noise: float, seed: int,
           sample: float = 1.0, samples: int = 3) -> dict:
    """RTTs between every pair (or a sampled share), each the smallest of `samples` noisy
    measurements; noise only ever adds time (queues), up to `noise` x the base."""
    rnd = random.Random(seed)
    where = {h: i for i, s in enumerate(switches) for h in s}
    hosts = sorted(where)
    out = {}
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            if rnd.random() > sample:
                continue
            base = near if where[a] == where[b] else far
            out[(a, b) if rnd.random() < 0.5 else (b, a)] = min(
                base * (1 + noise * rnd.random() ** 3) for _ in range(samples))
    return out


def as_sets(groups: dict) -> set:
    return {frozenset(v) for v in groups.values()}


@pytest.mark.parametrize("seed", range(5))
def test_two_switches_are_found_through_noise(seed):
    sw = [[f"a{i}" for i in range(5)], [f"b{i}" for i in range(3)]]
    rtt = matrix(sw, near=80e-6, far=400e-6, noise=2.0, seed=seed, samples=3)
    groups = topology.cluster_by_rtt([h for s in sw for h in s], rtt)
    assert as_sets(groups) == {frozenset(s) for s in sw}
    assert set(groups) == {"sw-a0", "sw-b0"}  # named after their first host


def test_a_few_inflated_intra_switch_pairs_split_nothing():
    sw = [[f"a{i}" for i in range(6)], [f"b{i}" for i in range(6)]]
    rtt = matrix(sw, near=100e-6, far=1e-3, noise=0.2, seed=1)
    rtt[("a0", "a1")] = 3e-3  # a pair measured during a burst, slower than the uplink
    rtt[("b2", "b5")] = 2e-3
    assert as_sets(topology.cluster_by_rtt(sorted(h for s in sw for h in s), rtt)) == {frozenset(s) for s in sw}


@pytest.mark.parametrize("seed", range(3))
def test_many_switches_from_each_hosts_sample_at_200_hosts(seed):
    sw = [[f"h{s:02d}-{i:02d}" for i in range(25)] for s in range(8)]
    full = matrix(sw, near=60e-6, far=300e-6, noise=1.0, seed=seed)
    hosts = [h for s in sw for h in s]

    def rtt_of(a, b):
        return full.get((a, b), full.get((b, a)))

    rtt = {}
    for h in hosts:
        for peer, v in topology.measure_row(h, hosts, lambda p, h=h: rtt_of(h, p)).items():
            rtt[(h, peer)] = v
    assert len(rtt) == 48 * len(hosts) and len(rtt) < 0.5 * len(full)  # bounded: a sample
    groups = topology.cluster_by_rtt(hosts, rtt)
    assert as_sets(groups) == {frozenset(s) for s in sw}


def test_up_to_49_hosts_every_pair_is_measured_so_tiny_switches_are_found():
    sw = [[f"a{i}" for i in range(20)], ["solo"], ["p0", "p1"], [f"c{i}" for i in range(10)]]
    full = matrix(sw, near=60e-6, far=300e-6, noise=1.0, seed=5)
    hosts = [h for s in sw for h in s]
    rtt = {}
    for h in hosts:
        row = topology.measure_row(h, hosts, lambda p, h=h: full.get((h, p), full.get((p, h))))
        rtt.update({(h, p): v for p, v in row.items()})
    assert as_sets(topology.cluster_by_rtt(hosts, rtt)) == {frozenset(s) for s in sw}


def test_the_probe_order_is_a_fixed_shuffle_of_the_others():
    hosts = [f"h{i}" for i in range(50)]
    a = topology.probe_order("h3", hosts)
    assert a == topology.probe_order("h3", list(reversed(hosts))) and sorted(a) == sorted(set(hosts) - {"h3"})
    assert a != topology.probe_order("h4", hosts)


def test_one_switch_when_no_clear_gap():
    hosts = [f"h{i}" for i in range(8)]
    rnd = random.Random(0)
    rtt = {(a, b): 100e-6 * (1 + 0.3 * rnd.random()) for i, a in enumerate(hosts) for b in hosts[i + 1:]}
    assert topology.cluster_by_rtt(hosts, rtt) == {"sw-h0": hosts}
    # A factor of 1.2 is not a switch hop.
    rtt2 = matrix([hosts[:4], hosts[4:]], near=100e-6, far=120e-6, noise=0.0, seed=0)
    assert len(topology.cluster_by_rtt(hosts, rtt2)) == 1
    assert topology.cluster_by_rtt(hosts, {}) == {"sw-h0": hosts}


def test_the_answer_depends_on_the_measurements_only():
    sw = [["x1", "x2", "x3"], ["y1", "y2"], ["z1", "z2", "z3", "z4"]]
    rtt = matrix(sw, near=50e-6, far=500e-6, noise=0.5, seed=9)
    hosts = [h for s in sw for h in s]
    shuffled = dict(sorted(rtt.items(), key=lambda kv: random.Random(1).random()))
    a = topology.cluster_by_rtt(hosts, rtt)
    b = topology.cluster_by_rtt(list(reversed(hosts)), shuffled)
    assert a == b and as_sets(a) == {frozenset(s) for s in sw}
    summary = topology.rtt_summary(hosts, rtt)
    assert summary["pairs_measured"] == len(rtt) and summary["near_rtt_s"] < summary["far_rtt_s"]


def test_the_fleet_view_joins_the_daemons_rows_or_shows_their_file():
    sw = [["h0", "h1", "h2"], ["h3", "h4"]]
    full = matrix(sw, near=1e-3, far=10e-3, noise=0.5, seed=2)
    hosts = [h for s in sw for h in s]
    reports = {}
    for h in hosts:
        row = topology.measure_row(h, hosts, lambda p, h=h: full.get((h, p), full.get((p, h))))
        reports[h] = {"source": "rtt", "switch": "sw-h0" if h in sw[0] else "", "row": row}
    reports["h5"] = None  # unreachable
    view = topology.fleet_view(reports)
    assert view["source"] == "rtt" and as_sets(view["switches"]) == {frozenset(s) for s in sw}
    assert view["daemons"]["h0"] == "sw-h0" and view["daemons"]["h3"] == ""
    assert view["rtt"]["far_rtt_s"] > 5 * view["rtt"]["near_rtt_s"]
    configured = {"a": ["h0", "h1"], "b": ["h2"]}
    files = {h: {"source": "file", "switch": s, "configured": configured, "row": {}}
             for s, hs in configured.items() for h in hs}
    assert topology.fleet_view(files)["switches"] == configured and topology.fleet_view(files)["source"] == "file"
    assert topology.fleet_view({**files, "h9": {"source": "rtt", "row": {}}})["source"] == "mixed"
