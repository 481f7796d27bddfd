"""Emulated hosts on several routed subnets (network namespaces), for discovery beyond one
broadcast domain: what MCCL_PEERS and gossip are for (mccld/net/gossip.py).

Subnet ``s`` is a bridge ``mccl<id>b<s>`` in the root namespace with hosts ``mccl<id>s<s>h<i>``
at ``10.<79 + s>.<octet>.<i + 1>/24``; a router namespace ``mccl<id>r`` holds one leg per subnet
at ``.254`` and forwards between them (IP forwarding, each host's default route points at its
leg). The router forwards unicast only: mDNS (link-local multicast, 224.0.0.251, TTL 255 but
never routed) stays inside its subnet, as it does behind a real router or between VLANs.

Usage::

    with SubnetFleet([2, 2, 2]) as net:
        net.popen((0, 1), ["python", "-m", "mccld"], env={...})
        net.hosts[(2, 0)].addr

Teardown (``stop``, also on exceptions and at interpreter exit) kills every process in the
namespaces by pid first, then deletes namespaces, veths and bridges; it is idempotent.
"""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass
from typing import Sequence

from mccl_common.errors import ConfigError

from .fleet import PREFIX
from .netns_fleet import NamespaceFleet, _sh, kill_namespace_pids, list_links, list_namespaces

log = logging.getLogger(__name__)

MAX_SUBNETS = 8
MAX_HOSTS_PER_SUBNET = 16
FIRST_NET = 79                   # 10.79.x.0/24, 10.80.x.0/24, ...: clear of tools/fleet.py's 10.77
ROUTER_HOST = 254


@dataclass(frozen=True)
class Host:
    subnet: int
    index: int
    ns: str
    addr: str
    veth: str                    # bridge-side end, in the root namespace
    ifname: str = "eth0"


class SubnetFleet(NamespaceFleet):
    """``sizes[s]`` hosts on subnet s, subnets joined by one router; a context manager."""

    def __init__(self, sizes: Sequence[int]):
        if not 1 <= len(sizes) <= MAX_SUBNETS or not all(1 <= n <= MAX_HOSTS_PER_SUBNET for n in sizes):
            raise ConfigError(f"[fleet] subnets {list(sizes)}: use 1..{MAX_SUBNETS} subnets of "
                              f"1..{MAX_HOSTS_PER_SUBNET} hosts")
        self.sizes = list(sizes)
        self.hosts: dict[tuple[int, int], Host] = {}
        super().__init__()

    # ---- names -------------------------------------------------------------------------
    @property
    def router(self) -> str:
        return f"{PREFIX}{self.id}r"

    def bridge(self, s: int) -> str:
        return f"{PREFIX}{self.id}b{s}"

    def subnet(self, s: int) -> str:
        return f"10.{FIRST_NET + s}.{self._octet()}"

    def gateway(self, s: int) -> str:
        return f"{self.subnet(s)}.{ROUTER_HOST}"

    def _octet(self) -> int:
        assert self.id is not None
        return zlib.crc32(self.id.encode()) % 250

    # ---- lifecycle (netns_fleet.py) -------------------------------------------------
    def _build(self) -> None:
        self._claim_id_from(self.random_ids(), lambda c: f"{PREFIX}{c}b0",
                            lambda c: any(ns.startswith(f"{PREFIX}{c}") for ns in list_namespaces()),
                            "a crashed run left bridges behind: scripts/cleanup.sh removes them")
        _sh(["ip", "netns", "add", self.router])
        _sh(["ip", "-n", self.router, "link", "set", "lo", "up"])
        _sh(["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for s, n in enumerate(self.sizes):
            self._add_subnet(s, n)
        log.info("subnet fleet %s up: subnets %s behind router %s", self.id, self.sizes, self.router)

    def _namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts.values()]

    def _teardown(self) -> None:
        assert self.id is not None
        teardown(self.id)

    def _ns(self, host: tuple[int, int]) -> str:
        if host not in self.hosts:
            raise ConfigError(f"[fleet] no host {host}; hosts are (subnet, index) of {self.sizes}")
        return self.hosts[host].ns

    def _add_subnet(self, s: int, n: int) -> None:
        br = self.bridge(s)
        if s > 0:
            _sh(["ip", "link", "add", br, "type", "bridge"])
        # Without snooping off the bridge drops mDNS until a multicast querier shows up.
        _sh(["ip", "link", "set", br, "type", "bridge", "mcast_snooping", "0"])
        _sh(["ip", "link", "set", br, "up"])
        leg, tmp = f"{PREFIX}{self.id}r{s}", f"{PREFIX}{self.id}q{s}"
        _sh(["ip", "link", "add", leg, "type", "veth", "peer", "name", tmp])
        _sh(["ip", "link", "set", tmp, "netns", self.router])
        _sh(["ip", "link", "set", leg, "master", br])
        _sh(["ip", "link", "set", leg, "up"])
        r = ["ip", "-n", self.router]
        _sh(r + ["link", "set", tmp, "name", f"eth{s}"])
        _sh(r + ["addr", "add", f"{self.gateway(s)}/24", "dev", f"eth{s}"])
        _sh(r + ["link", "set", f"eth{s}", "up"])
        for i in range(n):
            h = Host(s, i, f"{PREFIX}{self.id}s{s}h{i}", f"{self.subnet(s)}.{i + 1}", f"{PREFIX}{self.id}v{s}x{i}")
            self._add_host(h)
            self.hosts[(s, i)] = h

    def _add_host(self, h: Host) -> None:
        tmp = f"{PREFIX}{self.id}p{h.subnet}x{h.index}"
        _sh(["ip", "netns", "add", h.ns])
        _sh(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", tmp])
        _sh(["ip", "link", "set", tmp, "netns", h.ns])
        _sh(["ip", "link", "set", h.veth, "master", self.bridge(h.subnet)])
        _sh(["ip", "link", "set", h.veth, "up"])
        n = ["ip", "-n", h.ns]
        _sh(n + ["link", "set", tmp, "name", h.ifname])
        _sh(n + ["addr", "add", f"{h.addr}/24", "dev", h.ifname])
        _sh(n + ["link", "set", h.ifname, "multicast", "on", "up"])
        _sh(n + ["link", "set", "lo", "up"])
        _sh(n + ["route", "add", "default", "via", self.gateway(h.subnet)])
        _sh(n + ["route", "add", "224.0.0.0/4", "dev", h.ifname])   # mDNS out of eth0 (it stops at the router)


def teardown(fleet_id: str) -> None:
    """Delete whatever exists of subnet fleet ``fleet_id``; safe on a half-built one."""
    prefix = f"{PREFIX}{fleet_id}"
    namespaces = [ns for ns in list_namespaces() if re.fullmatch(rf"{prefix}(r|s\d+h\d+)", ns)]
    kill_namespace_pids(namespaces)
    for ns in namespaces:
        res = _sh(["ip", "netns", "del", ns], check=False)
        if res.returncode != 0 and ns in list_namespaces():
            log.warning("[fleet] could not delete namespace %s: %s", ns, res.stderr.strip())
    for link in list_links():
        if re.fullmatch(rf"{prefix}(b\d+|r\d+|q\d+|v\d+x\d+|p\d+x\d+)", link):
            _sh(["ip", "link", "del", link], check=False)
