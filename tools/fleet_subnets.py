"""Emulated hosts on several routed subnets (network namespaces), for discovery beyond one
broadcast domain: what MCCL_PEERS and gossip are for (mccld/gossip.py).

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

import atexit
import logging
import os
import random
import re
import signal
import subprocess
import threading
import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from mccl_common.errors import ConfigError, MCCLError

from .fleet import PREFIX, _sh, check_prerequisites, kill_namespace_pids, list_links, list_namespaces

log = logging.getLogger(__name__)

MAX_SUBNETS = 8
MAX_HOSTS_PER_SUBNET = 16
FIRST_NET = 79                   # 10.79.x.0/24, 10.80.x.0/24, ...: clear of tools/fleet.py's 10.77
ROUTER_HOST = 254
_KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class Host:
    subnet: int
    index: int
    ns: str
    addr: str
    veth: str                    # bridge-side end, in the root namespace
    ifname: str = "eth0"


class SubnetFleet:
    """``sizes[s]`` hosts on subnet s, subnets joined by one router; a context manager."""

    def __init__(self, sizes: Sequence[int]):
        if not 1 <= len(sizes) <= MAX_SUBNETS or not all(1 <= n <= MAX_HOSTS_PER_SUBNET for n in sizes):
            raise ConfigError(f"[fleet] subnets {list(sizes)}: use 1..{MAX_SUBNETS} subnets of "
                              f"1..{MAX_HOSTS_PER_SUBNET} hosts")
        self.sizes = list(sizes)
        self.id: str | None = None
        self.hosts: dict[tuple[int, int], Host] = {}
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._started = self._stopped = False
        self._owner_pid = os.getpid()

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

    # ---- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> "SubnetFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "SubnetFleet":
        if self._started:
            raise MCCLError("[fleet] start() called twice; a SubnetFleet is started once, then stopped")
        check_prerequisites()
        self._started = True
        self._owner_pid = os.getpid()
        atexit.register(self.stop)
        try:
            self._claim_id()
            _sh(["ip", "netns", "add", self.router])
            _sh(["ip", "-n", self.router, "link", "set", "lo", "up"])
            _sh(["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            for s, n in enumerate(self.sizes):
                self._add_subnet(s, n)
        except BaseException:
            self.stop()
            raise
        log.info("subnet fleet %s up: subnets %s behind router %s", self.id, self.sizes, self.router)
        return self

    def _claim_id(self) -> None:
        """Creating the first bridge is the atomic claim of an id across processes."""
        existing = list_namespaces()
        for cand in (str(random.randint(1, 9999)) for _ in range(50)):
            if any(ns.startswith(f"{PREFIX}{cand}") for ns in existing):
                continue
            res = _sh(["ip", "link", "add", f"{PREFIX}{cand}b0", "type", "bridge"], check=False)
            if res.returncode == 0:
                self.id = cand
                return
            if "exists" not in res.stderr:
                raise MCCLError(f"[fleet] could not create bridge {PREFIX}{cand}b0: {res.stderr.strip()}")
        raise ConfigError("[fleet] no free subnet-fleet id after 50 tries; a crashed run left bridges behind: "
                          "scripts/cleanup.sh removes them")

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

    def stop(self) -> None:
        """Kill every process in the namespaces, then delete them, the veths and the bridges.
        Only the process that started the fleet tears it down (a forked child inherits atexit)."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = self._stopped or self._started
                return
            self._stopped = True
        atexit.unregister(self.stop)
        if self.id is None:
            return
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        teardown(self.id)
        for p in self._procs:
            try:
                p.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("[fleet] pid %d survived SIGKILL for %.0f s", p.pid, _KILL_WAIT_S)
        log.info("subnet fleet %s down", self.id)

    # ---- running things inside hosts ---------------------------------------------------
    def exec_argv(self, host: tuple[int, int], argv: Sequence[str]) -> list[str]:
        if not self._started or self._stopped:
            raise MCCLError("[fleet] the subnet fleet is not running; start() it first")
        if host not in self.hosts:
            raise ConfigError(f"[fleet] no host {host}; hosts are (subnet, index) of {self.sizes}")
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    def popen(self, host: tuple[int, int], argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` in a session of its own (stop() kills its group)."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.exec_argv(host, argv), env={**os.environ, **(env or {})}, **kw)
        self._procs.append(p)
        return p

    def run(self, host: tuple[int, int], argv: Sequence[str], timeout: float,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        p = self.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=_KILL_WAIT_S)
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


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
