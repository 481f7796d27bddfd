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

import atexit
import logging
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from mccl_common.errors import ConfigError, MCCLError

log = logging.getLogger(__name__)

PREFIX = "mccl"
MAX_HOSTS = 256   # a Linux bridge takes up to 1024 ports
# Host addresses .1 to .253 of a /24 (.254 and .255 stay free); beyond, a /16.
HOSTS_PER_24 = 253
# tbf parameters: 256 KB of burst keeps a 10 Gbit/s bucket from starving between timer
# ticks, 10 ms of queue bounds the latency the shaper itself adds.
TBF_BURST = "256kb"
TBF_LATENCY = "10ms"
_CMD_TIMEOUT_S = 20.0
_KILL_WAIT_S = 5.0
# netem queues this many packets at most: enough for a dilated link's whole delay-bandwidth
# product (GSO packets up to 64 KB), so the delay never drops.
NETEM_LIMIT = 100000
_NAME_RE = re.compile(r"^[a-z0-9]{1,5}$")


def _is_root() -> bool:
    return os.geteuid() == 0


def check_prerequisites() -> None:
    """Raise ConfigError unless this process can build namespaces (root, Linux, ip, tc)."""
    if not sys.platform.startswith("linux"):
        raise ConfigError(
            f"[fleet] network namespaces need Linux, this is {sys.platform}; "
            "run the fleet tests and benchmarks on a Linux machine")
    if not _is_root():
        raise ConfigError(
            "[fleet] needs root (network namespaces, veths and tc qdiscs), running as uid "
            f"{os.geteuid()}; run as root, or use loopback mode (python -m tools.bench --hosts 0)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(
                f"[fleet] the '{tool}' command is missing; install iproute2 "
                "(apt-get install iproute2) or put it on PATH")


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


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = _CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MCCLError(f"[fleet] Timed out after {timeout:.0f}s: '{' '.join(argv)}' did not finish; "
                        "the machine may be overloaded, retry") from None
    if check and res.returncode != 0:
        raise MCCLError(f"[fleet] '{' '.join(argv)}' failed (rc={res.returncode}): "
                        f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links(kind: str | None = None) -> list[str]:
    argv = ["ip", "-o", "link", "show"] + (["type", kind] if kind else [])
    out = _sh(argv, check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(": ")
        if len(parts) >= 2:
            names.append(parts[1].split("@")[0])
    return names


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


class Fleet:
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
        self.id: str | None = None
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._owner_pid = os.getpid()

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

    # ---- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Fleet":
        if self._started:
            raise MCCLError("[fleet] start() called twice; a Fleet is started once, then stopped")
        check_prerequisites()
        self._started = True
        self._owner_pid = os.getpid()
        atexit.register(self.stop)
        try:
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
        except BaseException:
            self.stop()
            raise
        log.info("fleet %s up: %d hosts on %s, rate %s, switches %s, uplinks %s %s", self.id, self.n_hosts,
                 self.bridge, self.rate or "unshaped", self.switch_sizes, self.uplink_rate or "unshaped",
                 self.uplink_delay or "")
        return self

    @property
    def prefix_len(self) -> int:
        return 24 if self.n_hosts <= HOSTS_PER_24 else 16

    def _addr(self, i: int, octet: int) -> str:
        if self.prefix_len == 24:
            return f"10.77.{octet}.{i + 1}"
        return f"10.{100 + octet % 100}.{(i + 1) // 256}.{(i + 1) % 256}"

    def _claim_id(self) -> None:
        """Pick an id nobody uses; creating the bridge is the atomic claim across processes."""
        existing_ns = list_namespaces()
        candidates = [self._name] if self._name else [str(random.randint(1, 9999)) for _ in range(50)]
        for cand in candidates:
            if any(ns.startswith(f"{PREFIX}{cand}h") for ns in existing_ns):
                continue
            res = _sh(["ip", "link", "add", f"{PREFIX}{cand}br", "type", "bridge"], check=False)
            if res.returncode == 0:
                self.id = cand
                return
            if "exists" not in res.stderr:
                raise MCCLError(f"[fleet] could not create bridge {PREFIX}{cand}br: {res.stderr.strip()}")
        raise ConfigError(
            f"[fleet] no free fleet id (tried {', '.join(candidates[:5])}...); a fleet with that name "
            "is already up or a crashed run left namespaces behind: run 'python -m tools.fleet down' "
            "for it, or scripts/cleanup.sh")

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
                                     timeout=_CMD_TIMEOUT_S)
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

    def stop(self) -> None:
        """Kill every process in the fleet, delete namespaces, veths and bridge. Idempotent.

        Only the process that started the fleet tears it down: a forked child inherits the
        atexit hook, and its exit must not pull the network out from under its parent."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._stopped or not self._started:
                self._stopped = self._stopped or self._started
                return
            self._stopped = True
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass
        if self.id is None:
            return
        self._kill_all()
        teardown(self.id)
        log.info("fleet %s down", self.id)

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                # Each child leads its own session, so its pid is also its group's id.
                for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), lambda: os.kill(p.pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
        kill_namespace_pids([h.ns for h in self.hosts])
        for p in self._procs:
            try:
                p.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("[fleet] pid %d survived SIGKILL for %.0fs (stuck in the kernel?)", p.pid, _KILL_WAIT_S)

    def release(self) -> None:
        """Forget the fleet without tearing it down (``python -m tools.fleet up``);
        ``python -m tools.fleet down <id>`` or ``teardown(id)`` removes it later."""
        with self._lock:
            self._stopped = True
        atexit.unregister(self.stop)

    # ---- running things inside hosts ----------------------------------------------
    def _host(self, i: int) -> Host:
        if not self._started or self._stopped:
            raise MCCLError("[fleet] the fleet is not running; call start() (or use 'with Fleet(...)') first")
        if not 0 <= i < len(self.hosts):
            raise ConfigError(f"[fleet] host index {i} is out of range; this fleet has {len(self.hosts)} hosts")
        return self.hosts[i]

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside host i (``ip netns exec`` execs, so pids match)."""
        return ["ip", "netns", "exec", self._host(i).ns, *argv]

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside host i. ``env`` is added on top of this process's environment.

        The process leads its own session (so teardown can kill its children too) and is
        tracked: stop() kills it.
        """
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.exec_argv(i, argv), env=full_env, **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host i to completion, output captured as text.

        After ``timeout`` seconds the process group is killed and subprocess.TimeoutExpired
        raised, so a wedged command never stalls the caller."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = self.popen(i, argv, env=env, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate(timeout=_KILL_WAIT_S)
            raise
        res = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            res.check_returncode()
        return res

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


def kill_namespace_pids(namespaces: Sequence[str]) -> None:
    """SIGKILL every process inside the given namespaces and wait until they are gone."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        alive = []
        for ns in namespaces:
            res = _sh(["ip", "netns", "pids", ns], check=False)
            alive += [int(x) for x in res.stdout.split() if x.isdigit()]
        if not alive:
            return
        if time.monotonic() > deadline:
            log.warning("[fleet] pids %s still in namespaces %s after SIGKILL; deleting anyway", alive, namespaces)
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


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
