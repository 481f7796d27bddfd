"""Which address a rank listens on (libmccl/listen_addr.py): settings first, then the
route to MASTER_ADDR, the route to the store's host, the host name, the default route,
and loopback last; and the check that refuses a table mixing loopback with real
addresses. The same between emulated hosts: test_rendezvous_fleet.py."""

from __future__ import annotations

import datetime
import logging
import socket
import subprocess
import threading
import time

import pytest

from libmccl import listen_addr as la
from mccl_common.errors import ConfigError
from mccl_common.settings import EngineConfig

pytestmark = pytest.mark.timeout(30)


def test_settings_and_master_addr_take_precedence() -> None:
    assert la.choose_bind_address(EngineConfig(bind_addr="10.1.2.3", socket_ifname="lo"), "x") == "10.1.2.3"
    assert la.choose_bind_address(EngineConfig(socket_ifname="lo"), None) == "127.0.0.1"
    # The route to a loopback MASTER_ADDR is loopback: every rank is on this host.
    assert la.choose_bind_address(EngineConfig(), "127.0.0.1", _StoreWithHost("10.9.9.9")) == "127.0.0.1"
    with pytest.raises(ConfigError, match="cannot be dialled"):
        la.choose_bind_address(EngineConfig(bind_addr="0.0.0.0"), None)
    with pytest.raises(ConfigError, match="MCCL_SOCKET_IFNAME='mccl-nope0'"):
        la.choose_bind_address(EngineConfig(socket_ifname="mccl-nope0"), None)


class _StoreWithHost:
    def __init__(self, host: str) -> None:
        self.host = host


@pytest.fixture
def guesses(monkeypatch):
    """Replace the machine-dependent lookups: routes per target, host name, default route."""
    state = {"routes": {}, "hostname": None, "default": None, "calls": []}

    def routed(target: str):
        state["calls"].append(target)
        return state["routes"].get(target)

    monkeypatch.setattr(la, "routed_address", routed)
    monkeypatch.setattr(la, "hostname_address", lambda: state["hostname"])
    monkeypatch.setattr(la, "default_route_address", lambda: state["default"])
    return state


def test_each_guess_falls_through_to_the_next(guesses, caplog) -> None:
    guesses.update(routes={"master": "10.0.0.1", "storehost": "10.0.0.2"}, hostname="10.0.0.3", default="10.0.0.4")
    store = _StoreWithHost("storehost")
    assert la.choose_bind_address(EngineConfig(), "master", store) == "10.0.0.1"
    assert la.choose_bind_address(EngineConfig(), None, store) == "10.0.0.2"
    assert la.choose_bind_address(EngineConfig(), "unroutable", store) == "10.0.0.2"
    assert la.choose_bind_address(EngineConfig(), None, None) == "10.0.0.3"
    guesses["hostname"] = None
    assert la.choose_bind_address(EngineConfig(), None, _StoreWithHost("unroutable")) == "10.0.0.4"
    guesses["default"] = None
    with caplog.at_level(logging.WARNING, logger="libmccl.listen_addr"):
        assert la.choose_bind_address(EngineConfig(), None, None) == "127.0.0.1"
    assert "MCCL_SOCKET_IFNAME" in caplog.text and "only ranks on this host" in caplog.text


def test_settings_skip_every_guess(guesses) -> None:
    guesses.update(routes={"master": "10.0.0.1"}, hostname="10.0.0.3", default="10.0.0.4")
    assert la.choose_bind_address(EngineConfig(bind_addr="10.5.5.5"), "master", _StoreWithHost("master")) == "10.5.5.5"
    assert guesses["calls"] == []


def test_store_host_is_found_under_torch_prefix_stores() -> None:
    import torch.distributed as dist

    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    assert la.store_host(dist.PrefixStore("a/", dist.PrefixStore("b/", tcp))) == "127.0.0.1"
    assert la.store_host(dist.PrefixStore("a/", dist.HashStore())) is None
    assert la.store_host(None) is None
    # A TCPStore on loopback means every rank reaches it from this host: loopback is right.
    assert la.choose_bind_address(EngineConfig(), None, dist.PrefixStore("a/", tcp)) == "127.0.0.1"


def test_a_wildcard_target_says_nothing_about_the_peers() -> None:
    assert la.routed_address("0.0.0.0") is None
    assert la.routed_address("127.0.0.1") == "127.0.0.1"
    assert la.routed_address("no-such-host.invalid") is None


def test_the_host_name_counts_only_as_a_real_address_of_this_host(monkeypatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "here")
    for resolved in ("127.0.1.1", "0.0.0.0", "203.0.113.7"):  # loopback, wildcard, another machine's
        monkeypatch.setattr(la, "_resolve", lambda host, timeout_s, ip=resolved: ip)
        assert la.hostname_address() is None, resolved
    monkeypatch.setattr(la, "_resolve", lambda host, timeout_s: None)
    assert la.hostname_address() is None


def test_the_host_name_address_is_used_when_it_is_this_hosts(monkeypatch) -> None:
    mine = la.routed_address("192.0.2.1")  # TEST-NET: only picks a route, sends nothing
    if mine is None or la.is_loopback(mine):
        pytest.skip("this host has no non-loopback IPv4 address to resolve its name to")
    monkeypatch.setattr(la, "_resolve", lambda host, timeout_s: mine)
    assert la.hostname_address() == mine


_PROC_NET_ROUTE = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth9\t00000000\t010200C0\t0002\t0\t0\t0\t00000000\t0\t0\t0
wlan0\t00000000\t0100A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0
eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0
"""


def test_default_route_picks_the_lowest_metric_route_that_is_up() -> None:
    assert la.pick_default_route(_PROC_NET_ROUTE) == "eth0"  # eth9's route is not up (no RTF_UP)
    assert la.pick_default_route(_PROC_NET_ROUTE.splitlines()[0] + "\n" + _PROC_NET_ROUTE.splitlines()[4]) is None
    assert la.pick_default_route("") is None


def test_default_route_on_macos_reads_route_get(monkeypatch) -> None:
    out = "   route to: default\ndestination: default\n    gateway: 192.168.1.1\n  interface: en7\n      flags: <UP>\n"
    seen = {}

    def fake_run(argv, **kw):
        seen.update(argv=argv, timeout=kw.get("timeout"))
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(la.sys, "platform", "darwin")
    monkeypatch.setattr(la.subprocess, "run", fake_run)
    monkeypatch.setattr(la, "_interface_ipv4", lambda ifname: {"en7": "192.168.1.20"}[ifname])
    assert la.default_route_address() == "192.168.1.20"
    assert seen == {"argv": ["route", "-n", "get", "default"], "timeout": la._ROUTE_TIMEOUT_S}


def test_default_route_address_of_this_host() -> None:
    ifname = la._default_route_ifname_linux()
    if ifname is None:
        pytest.skip("this host has no IPv4 default route")
    assert la.default_route_address() == la.interface_address(ifname)


def test_is_loopback() -> None:
    for addr in ("127.0.0.1:5", "127.0.1.1", "localhost:80", "[::1]:7", "::1"):
        assert la.is_loopback(addr), addr
    for addr in ("10.0.0.1:5", "192.0.2.2", "node7:80", "[fe80::1]:7"):
        assert not la.is_loopback(addr), addr


def test_a_table_on_one_side_passes() -> None:
    la.check_no_loopback_mix(["127.0.0.1:1", "127.0.0.1:2"], 0, "[t] g")
    la.check_no_loopback_mix(["10.0.0.1:1", "10.0.0.2:2"], 1, "[t] g")
    la.check_no_loopback_mix([], 0, "[t] g")


def test_a_mixed_table_names_both_addresses_and_the_fix() -> None:
    table = ["10.0.0.1:1", "127.0.0.1:2", "10.0.0.3:3", "127.0.0.1:4"]
    with pytest.raises(ConfigError) as info:
        la.check_no_loopback_mix(table, 3, "[t] g")
    msg = str(info.value)
    assert msg.startswith("[t] g: rank 3 listens on loopback 127.0.0.1:4 but rank 0 publishes 10.0.0.1:1 "), msg
    assert "loopback on ranks 1, 3, other addresses on ranks 0, 2; seen by rank 3" in msg
    assert "MCCL_SOCKET_IFNAME" in msg and "MCCL_BIND_ADDR" in msg
    with pytest.raises(ConfigError, match=r"rank 1's mccld listens on loopback 127.0.0.1:2 but rank 2's mccld "
                                          r"publishes 10.0.0.3:3 .*restart it"):
        la.check_no_loopback_mix(table, 2, "[d] job", "restart it", of="'s mccld")


def test_a_stalled_resolver_does_not_hang_group_creation(monkeypatch) -> None:
    release = threading.Event()

    def stuck(host: str) -> str:
        release.wait(20)
        return "10.9.9.9"

    monkeypatch.setattr(socket, "gethostbyname", stuck)
    monkeypatch.setattr(la, "_RESOLVE_TIMEOUT_S", 0.3)
    started = time.monotonic()
    try:
        assert la._resolve("slow.example", 0.3) is None
        assert la._resolve("10.1.2.3", 0.3) == "10.1.2.3"  # literals skip the resolver
        # Every guess that resolves (MASTER_ADDR, store host, host name) gives up in time,
        # and the default route, which resolves nothing, decides.
        picked = la.choose_bind_address(EngineConfig(), "slow.example", _StoreWithHost("slow2.example"))
        assert picked == (la.default_route_address() or "127.0.0.1")
        assert time.monotonic() - started < 3
    finally:
        release.set()
