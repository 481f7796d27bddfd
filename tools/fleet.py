"""An emulated fleet of hosts on one Linux machine, built from network namespaces.

Each host is a network namespace ``mccl<id>h<i>`` with one interface ``eth0`` (a veth)
whose peer sits on a bridge ``mccl<id>br`` in the root namespace, like machines on one
switch. Host ``i`` has address ``10.77.<id % 250>.<i + 1>/24``; that subnet exists only
inside our namespaces (the bridge itself has no address), so two fleets never see each
other and nothing leaves the machine. A fleet of more than ``HOSTS_PER_24`` hosts does not
fit a /24: its hosts get ``10.<100 + id % 100>.<(i + 1) // 256>.<(i + 1) % 256>/16``
instead. Links can be shaped to a line rate with a token bucket on both ends of every
veth, so each host's send *and* receive side is capped, like a NIC on a switch port;
``delay`` adds a fixed one-way latency (netem, on the host's sending side only, so a
message between two hosts is delayed once, like one switch hop). ``static_arp`` gives every
host a permanent neighbour entry for every other: when tens of hosts open connections to
each other at once, their ARP broadcasts, flooded by the bridge to every port, overflow
the kernel's per-CPU backlog (netdev_max_backlog) and connects fail with "no route to
host" or time out (seen from 64 hosts on, on 2 and on 16 cores).

Switches (``switches=``): host i then hangs off bridge ``mccl<id>s<k>`` of its switch k (switch
0 is ``mccl<id>br``), and every switch has one uplink, a veth pair ``mccl<id>u<k>a`` /
``mccl<id>u<k>b``, to a core bridge ``mccl<id>core``. Uplinks are shaped both ways to
``uplink_rate`` (an oversubscribed uplink: less than the sum of its hosts' rates) and may
add ``uplink_delay`` per hop (so a path between two switches crosses two uplinks). It is
still one subnet: only the bandwidth and latency between switches differ.

Usage::

    with Fleet(3, rate="1gbit") as fleet:
        srv = fleet.popen(0, ["iperf3", "-s", "-1"])
        fleet.run(1, ["iperf3", "-c", fleet.hosts[0].addr, "-t", "1"], timeout=10)

Teardown (``stop``, also on exceptions and at interpreter exit) kills every process in
the namespaces by pid, then deletes the namespaces, veths and the bridge. It is
idempotent and keeps going past individual failures so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import re
import select
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Sequence

from mccl_common.errors import ConfigError, MCCLError

from .netns_fleet import (CMD_TIMEOUT_S, NamespaceFleet, _sh, check_prerequisites,  # noqa: F401
                          kill_namespace_pids, list_links, list_namespaces)

log = logging.getLogger(__name__)

PREFIX = "mccl"
MAX_HOSTS = 256   # a Linux bridge takes up to 1024 ports
# Host addresses .1 to .253 of a /24 (.254 and .255 stay free); beyond, a /16.
HOSTS_PER_24 = 253
# tbf parameters: 256 KB of burst keeps a 10 Gbit/s bucket from starving between timer
# ticks, 10 ms of queue bounds the latency the shaper itself adds.
TBF_BURST = "256kb"
TBF_LATENCY = "10ms"
# netem queues this many packets at most: enough for a dilated link's whole delay-bandwidth
# product (GSO packets up to 64 KB), so the delay never drops.
NETEM_LIMIT = 100000
_NAME_RE = re.compile(r"^[a-z0-9]{1,5}$")


def parse_time_s(text: str) -> float:
    """'30us' -> 3e-05 (tc's time units: s, ms, us)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|ms|us)", text.strip().lower())
    if not m:
        raise ConfigError(f"[fleet] delay={text!r} is not a tc time; use e.g. '30us', '2.5ms'")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


def parse_rate_bits(rate: str) -> float:
    """'2.5gbit' -> 2.5e9 bits/s (tc's units: bit = bits/s, bps = bytes/s)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ConfigError(f"[fleet] rate={rate!r} is not a tc rate; use e.g. '1gbit', '2.5gbit', '200mbit'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)


def netem_supported() -> bool:
    """Can this kernel delay packets (sch_netem)? Some VM kernels are built without it; a
    throwaway namespace's loopback tells, leaving nothing behind."""
    check_prerequisites()
    ns = f"{PREFIX}probe{os.getpid() % 100000}"
    if _sh(["ip", "netns", "add", ns], check=False).returncode != 0:
        return False
    try:
        return _sh(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                   check=False).returncode == 0
    finally:
        _sh(["ip", "netns", "del", ns], check=False)


@dataclass(frozen=True)
class Host:
    index: int
    ns: str       # network namespace name
    addr: str     # IPv4 address of eth0 inside ns
    veth: str     # bridge-side end of the host's veth, in the root namespace
    ifname: str = "eth0"
    switch: int = 0  # which switch (bridge) it hangs off


class Fleet(NamespaceFleet):
    """N emulated hosts on one bridge; a context manager with explicit start()/stop()."""

    def __init__(self, n_hosts: int, rate: str | None = "1gbit", name: str | None = None,
                 delay: str | None = None, burst: str | None = None, static_arp: bool = False,
                 switches: int | Sequence[int] | None = None, uplink_rate: str | None = None,
                 uplink_delay: str | None = None, queue: str | None = None):
        """``switches``: a number of switches (hosts split in order, as evenly as they go) or
        the number of hosts on each; None: one switch, no uplinks. ``queue``: how much time of
        the rate a host's shaper queues before it drops (tbf latency; default TBF_LATENCY)."""
        if not 1 <= int(n_hosts) <= MAX_HOSTS:
            raise ConfigError(f"[fleet] n_hosts={n_hosts} is out of range; use 1..{MAX_HOSTS}")
        if rate is not None:
            parse_rate_bits(rate)
        if delay is not None:
            parse_time_s(delay)
        self.switch_sizes = _switch_sizes(int(n_hosts), switches)
        if uplink_rate is not None:
            parse_rate_bits(uplink_rate)
        if uplink_delay is not None:
            parse_time_s(uplink_delay)
        if (uplink_rate or uplink_delay) and len(self.switch_sizes) < 2:
            raise ConfigError("[fleet] uplink_rate/uplink_delay need at least two switches (switches=2 or more)")
        self.uplink_rate = uplink_rate
        self.uplink_delay = uplink_delay
        if name is not None and not _NAME_RE.match(name):
            raise ConfigError(f"[fleet] name={name!r} must be 1-5 lowercase letters/digits "
                              "(interface names are limited to 15 characters)")
        self.n_hosts = int(n_hosts)
        self.rate = rate
        self.rate_bits = parse_rate_bits(rate) if rate else None
        self.delay = delay
        # A slow (time-dilated) link wants a smaller burst: 256 KB at 100 Mbit/s is 20 ms of free line rate.
        self.burst = burst or TBF_BURST
        if queue is not None:
            parse_time_s(queue)
        self.queue = queue or TBF_LATENCY
        self.static_arp = static_arp
        self._name = name
        self.hosts: list[Host] = []
        super().__init__()

    # ---- names -------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.id}br"

    def switch_bridge(self, k: int) -> str:
        return self.bridge if k == 0 else f"{PREFIX}{self.id}s{k}"

    @property
    def core_bridge(self) -> str:
        return f"{PREFIX}{self.id}core"

    def topology_text(self) -> str:
        """An MCCL_TOPOLOGY file for this fleet, hosts named by address (docs/topology.md)."""
        return "".join(f"switch-{k}: " + " ".join(h.addr for h in self.hosts if h.switch == k) + "\n"
                       for k in range(len(self.switch_sizes)))

    def _subnet_octet(self) -> int:
        assert self.id is not None
        return int(self.id) % 250 if self.id.isdigit() else zlib.crc32(self.id.encode()) % 250

    # ---- lifecycle (netns_fleet.py) ---------------------------------------------
    def _build(self) -> None:
        self._claim_id()
        octet = self._subnet_octet()
        switch_of = [k for k, size in enumerate(self.switch_sizes) for _ in range(size)]
        self.hosts = [Host(i, f"{PREFIX}{self.id}h{i}", self._addr(i, octet), f"{PREFIX}{self.id}v{i}",
                           switch=switch_of[i]) for i in range(self.n_hosts)]
        if len(self.switch_sizes) > 1:
            self._add_switches()
        # Without snooping off the bridge drops mDNS until a multicast querier shows up.
        _sh(["ip", "link", "set", self.bridge, "type", "bridge", "mcast_snooping", "0"])
        _sh(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            self._add_host(h)
        if self.static_arp:
            self._pin_neighbours()
        log.info("fleet %s up: %d hosts on %s, rate %s, switches %s, uplinks %s %s", self.id, self.n_hosts,
                 self.bridge, self.rate or "unshaped", self.switch_sizes, self.uplink_rate or "unshaped",
                 self.uplink_delay or "")

    @property
    def prefix_len(self) -> int:
        return 24 if self.n_hosts <= HOSTS_PER_24 else 16

    def _addr(self, i: int, octet: int) -> str:
        if self.prefix_len == 24:
            return f"10.77.{octet}.{i + 1}"
        return f"10.{100 + octet % 100}.{(i + 1) // 256}.{(i + 1) % 256}"

    def _claim_id(self) -> None:
        self._claim_id_from([self._name] if self._name else self.random_ids(), lambda c: f"{PREFIX}{c}br",
                            lambda c: any(ns.startswith(f"{PREFIX}{c}h") for ns in list_namespaces()),
                            "a fleet with that name is already up or a crashed run left namespaces behind: run "
                            "'python -m tools.fleet down' for it, or scripts/cleanup.sh")

    def _add_host(self, h: Host) -> None:
        tmp = f"{PREFIX}{self.id}p{h.index}"  # host end before it moves into the namespace
        _sh(["ip", "netns", "add", h.ns])
        _sh(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", tmp])
        _sh(["ip", "link", "set", tmp, "netns", h.ns])
        _sh(["ip", "link", "set", h.veth, "master", self.switch_bridge(h.switch)])
        _sh(["ip", "link", "set", h.veth, "up"])
        n = ["ip", "-n", h.ns]
        _sh(n + ["link", "set", tmp, "name", h.ifname] + (["address", self._mac(h.index)] if self.static_arp else []))
        _sh(n + ["addr", "add", f"{h.addr}/{self.prefix_len}", "dev", h.ifname])
        _sh(n + ["link", "set", h.ifname, "multicast", "on", "up"])
        _sh(n + ["link", "set", "lo", "up"])
        # mDNS sends to 224.0.0.251; with no default route it would find no way out.
        _sh(n + ["route", "add", "224.0.0.0/4", "dev", h.ifname])
        if self.rate:
            tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.queue]
            _sh(["tc", "-n", h.ns, "qdisc", "replace", "dev", h.ifname, "root", "handle", "1:"] + tbf)  # host -> switch
            _sh(["tc", "qdisc", "replace", "dev", h.veth, "root"] + tbf)                              # switch -> host
        if self.delay:
            # Under the token bucket (or alone): the line rate is shaped first, then each packet waits.
            where = ["parent", "1:1"] if self.rate else ["root"]
            _sh(["tc", "-n", h.ns, "qdisc", "replace", "dev", h.ifname, *where, "handle", "10:",
                 "netem", "delay", self.delay, "limit", str(NETEM_LIMIT)])

    @staticmethod
    def _mac(i: int) -> str:
        return f"02:6d:63:{(i >> 8) & 0xff:02x}:{i & 0xff:02x}:01"   # locally administered, one per host

    def _pin_neighbours(self) -> None:
        """Every host's neighbour table holds every other host (see the module doc): one
        ``ip -batch`` per host, so 256 hosts cost 256 commands, not 65,000."""
        for h in self.hosts:
            lines = "".join(f"neigh replace {o.addr} lladdr {self._mac(o.index)} dev {o.ifname} nud permanent\n"
                            for o in self.hosts if o is not h)
            try:
                res = subprocess.run(["ip", "-n", h.ns, "-batch", "-"], input=lines, capture_output=True, text=True,
                                     timeout=CMD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise MCCLError(f"[fleet] Timed out pinning the neighbours of {h.ns}; the machine may be "
                                "overloaded, retry") from None
            if res.returncode != 0:
                raise MCCLError(f"[fleet] pinning the neighbours of {h.ns} failed: {res.stderr.strip()[-300:]}")

    def _add_switches(self) -> None:
        """A bridge per switch beyond the first and the core, each switch with its shaped uplink."""
        for br in [self.core_bridge] + [self.switch_bridge(k) for k in range(1, len(self.switch_sizes))]:
            _sh(["ip", "link", "add", br, "type", "bridge"])
            _sh(["ip", "link", "set", br, "type", "bridge", "mcast_snooping", "0"])
            _sh(["ip", "link", "set", br, "up"])
        for k in range(len(self.switch_sizes)):
            down, up = f"{PREFIX}{self.id}u{k}a", f"{PREFIX}{self.id}u{k}b"  # switch end, core end
            _sh(["ip", "link", "add", down, "type", "veth", "peer", "name", up])
            _sh(["ip", "link", "set", down, "master", self.switch_bridge(k)])
            _sh(["ip", "link", "set", up, "master", self.core_bridge])
            for end in (down, up):
                _sh(["ip", "link", "set", end, "up"])
                shape_link(end, self.uplink_rate, self.uplink_delay, burst=uplink_burst(self.uplink_rate))

    def _namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts]

    def _teardown(self) -> None:
        assert self.id is not None
        teardown(self.id)

    # ---- running things inside hosts ----------------------------------------------
    def _ns(self, i: int) -> str:
        if not 0 <= i < len(self.hosts):
            raise ConfigError(f"[fleet] host index {i} is out of range; this fleet has {len(self.hosts)} hosts")
        return self.hosts[i].ns

    def pids(self) -> list[int]:
        """Pids of every process currently inside any of this fleet's namespaces."""
        out: list[int] = []
        for h in self.hosts:
            res = _sh(["ip", "netns", "pids", h.ns], check=False)
            out += [int(x) for x in res.stdout.split() if x.isdigit()]
        return out

    def __repr__(self) -> str:
        return f"Fleet(id={self.id}, n_hosts={self.n_hosts}, rate={self.rate}, delay={self.delay})"


def _switch_sizes(n_hosts: int, switches: int | Sequence[int] | None) -> list[int]:
    if switches is None:
        return [n_hosts]
    if isinstance(switches, int):
        if not 1 <= switches <= n_hosts:
            raise ConfigError(f"[fleet] switches={switches} must be between 1 and the {n_hosts} hosts")
        return [n_hosts // switches + (1 if k < n_hosts % switches else 0) for k in range(switches)]
    sizes = [int(x) for x in switches]
    if not sizes or any(x < 1 for x in sizes) or sum(sizes) != n_hosts or len(sizes) > 16:
        raise ConfigError(f"[fleet] switches={list(switches)} must be 1..16 positive sizes adding up to "
                          f"the {n_hosts} hosts")
    return sizes


def shape_link(dev: str, rate: str | None, delay: str | None = None, ns: str | None = None,
               burst: str = TBF_BURST) -> None:
    """Shape what leaves ``dev`` (in namespace ``ns``): a token bucket at ``rate`` with
    ``burst``, behind a netem delay when ``delay`` is given. Nothing when both are None."""
    qdisc = ["tc"] + (["-n", ns] if ns else []) + ["qdisc", "replace", "dev", dev]
    tbf = ["tbf", "rate", rate or "", "burst", burst, "latency", TBF_LATENCY]
    if delay:
        # netem holds the packets for the delay, its child bucket paces them.
        res = _sh(qdisc + ["root", "handle", "1:", "netem", "delay", delay, "limit", "100000"], check=False)
        if res.returncode != 0:
            raise ConfigError(f"[fleet] cannot add {delay} of delay on {dev}: {res.stderr.strip()}; this kernel "
                              "may lack netem (CONFIG_NET_SCH_NETEM): leave the delay out")
        if rate:
            _sh(qdisc + ["parent", "1:1", "handle", "10:"] + tbf)
    elif rate:
        _sh(qdisc + ["root"] + tbf)


def uplink_burst(rate: str | None) -> str:
    """A line's burst: ~100 us at its rate, at least two full frames. A switch port sends each
    frame at line rate, with no bucket of credit to spend: so a probe crossing an uplink takes
    its serialization time there, as it would on the wire."""
    if not rate:
        return TBF_BURST
    return f"{max(3028, int(parse_rate_bits(rate) * 100e-6 / 8))}b"


def wait_for_output(p: subprocess.Popen, marker: bytes, what: str, timeout: float = 15.0) -> None:
    """Block until process ``p`` (stdout=PIPE) prints ``marker``, e.g. a server's
    "listening" line; raises naming ``what`` and what it printed if it does not in time."""
    deadline = time.monotonic() + timeout
    seen = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            if marker.lower() in seen.lower():
                return
    raise MCCLError(f"[fleet] {what} did not print {marker.decode()!r} within {timeout:.0f}s "
                    f"(exit code {p.poll()}): {seen.decode(errors='replace').strip()[-300:]}; is its port taken?")


def teardown(fleet_id: str) -> None:
    """Delete whatever exists of fleet ``fleet_id``: namespaces (with their processes),
    bridge-side veths and the bridge. Safe to call on a half-built or already deleted fleet."""
    prefix = f"{PREFIX}{fleet_id}"
    namespaces = [ns for ns in list_namespaces() if re.fullmatch(rf"{prefix}h\d+", ns)]
    kill_namespace_pids(namespaces)
    for ns in namespaces:
        # Deleting the namespace destroys its veth end, and with it the bridge-side peer.
        res = _sh(["ip", "netns", "del", ns], check=False)
        if res.returncode != 0 and ns in list_namespaces():
            log.warning("[fleet] could not delete namespace %s: %s", ns, res.stderr.strip())
    for link in list_links():
        if (re.fullmatch(rf"{prefix}(v|p|s)\d+|{prefix}u\d+a", link)
                or link in (f"{prefix}br", f"{prefix}core")):
            _sh(["ip", "link", "del", link], check=False)


if __name__ == "__main__":
    from .fleet_cli import main

    sys.exit(main())
