"""The address a rank's engine listens on, which is also the address its peers dial.

The order: MCCL_BIND_ADDR, MCCL_SOCKET_IFNAME, the local end of the route to
MASTER_ADDR, then, for users who hand ``init_process_group`` a store or a
``file://`` method instead of the environment, the local end of the route to the
store's host, the host name's address, and the default-route interface's address.
Loopback is the last resort, good for one host only: ``check_no_loopback_mix``
makes a job that mixes loopback and real addresses fail at once instead of waiting
out the timeout.

Every lookup is bounded: name resolution runs on a helper thread with a deadline,
the route choice is a UDP ``connect()`` (which sends nothing), the default route
comes from /proc/net/route (on macOS from `route` under a timeout), and interface
addresses from an ioctl.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

from mccl_common.errors import ConfigError
from mccl_common.settings import EngineConfig

_log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_RESOLVE_TIMEOUT_S = 5.0  # seconds per lookup; only used when no address is configured
_ROUTE_TIMEOUT_S = 2.0    # macOS `route -n get default`
_MAX_STORE_DEPTH = 16     # PrefixStore wrappers walked to reach a TCPStore
# ioctl(SIOCGIFADDR): an interface's IPv4 address, without extra dependencies.
_SIOCGIFADDR = 0xC0206921 if sys.platform == "darwin" else 0x8915
_FIX = "set MCCL_SOCKET_IFNAME to the training network's interface, or MCCL_BIND_ADDR to this host's address on it"


def _interface_ipv4(ifname: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def interface_address(ifname: str) -> str:
    """First IPv4 address of interface ``ifname``."""
    try:
        return _interface_ipv4(ifname)
    except OSError as exc:
        why = "no such interface" if exc.errno == errno.ENODEV else "it has no IPv4 address"
        raise ConfigError(f"[rendezvous] MCCL_SOCKET_IFNAME={ifname!r} cannot be used: {why} ({exc}); "
                          "set it to an interface listed by `ip addr`/`ifconfig`, or set MCCL_BIND_ADDR") from None


def _resolve(host: str, timeout_s: float) -> str | None:
    """IPv4 address of ``host``, or None. getaddrinfo has no timeout of its own and a
    broken resolver can stall it for minutes, so it runs on a helper thread that is
    abandoned (daemon) if it overstays."""
    try:
        socket.inet_aton(host)
        return host
    except OSError:
        pass
    found: list[str] = []

    def lookup() -> None:
        try:
            found.append(socket.gethostbyname(host))
        except OSError:
            pass

    t = threading.Thread(target=lookup, name="mccl-resolve", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        _log.warning("[rendezvous] resolving %s took over %.0f s; not using it to pick the listen address "
                     "(set MCCL_BIND_ADDR or MCCL_SOCKET_IFNAME)", host, timeout_s)
        return None
    return found[0] if found else None


def _is_unspecified(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified


def routed_address(target: str) -> str | None:
    """The local address the kernel would use to reach ``target``; None when ``target``
    does not resolve, has no route, or is a wildcard (0.0.0.0 says nothing about where
    the peers are).

    Connecting a UDP socket only selects a route; no packet is sent.
    """
    target_ip = _resolve(target, _RESOLVE_TIMEOUT_S)
    if target_ip is None or _is_unspecified(target_ip):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target_ip, 9))
            local = s.getsockname()[0]
        except OSError:
            return None
    return None if _is_unspecified(local) else local


def store_host(store: Any) -> str | None:
    """The host of the TCPStore under ``store`` (torch wraps it in PrefixStores), or None
    for stores that have no host (FileStore, HashStore)."""
    for _ in range(_MAX_STORE_DEPTH):
        if store is None:
            return None
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def _is_local(ip: str) -> bool:
    """Whether ``ip`` belongs to this host (network namespace): binding to it works."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def is_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) names this host: loopback, or an address
    this host can bind. A name that does not resolve within the lookup deadline is not ours."""
    ip = _resolve(host, _RESOLVE_TIMEOUT_S)
    if ip is None or _is_unspecified(ip):
        return False
    return is_loopback(ip) or _is_local(ip)


def hostname_address() -> str | None:
    """The host name's address when it is a real address of this host: /etc/hosts often
    maps the name to 127.0.1.1, and a copied /etc/hosts to another machine's address."""
    ip = _resolve(socket.gethostname(), _RESOLVE_TIMEOUT_S)
    if ip is None or is_loopback(ip) or _is_unspecified(ip) or not _is_local(ip):
        return None
    return ip


def _default_route_ifname_linux() -> str | None:
    try:
        with open("/proc/net/route") as f:
            return pick_default_route(f.read())
    except OSError:
        return None


def pick_default_route(proc_net_route: str) -> str | None:
    """The interface of the lowest-metric IPv4 default route that is up, from the text of
    /proc/net/route (Iface Destination Gateway Flags RefCnt Use Metric Mask ..., hex)."""
    best: tuple[int, str] | None = None
    for row in (line.split() for line in proc_net_route.splitlines()[1:]):
        if len(row) < 8 or row[1] != "00000000" or row[7] != "00000000" or not int(row[3], 16) & 0x1:  # RTF_UP
            continue
        if best is None or int(row[6]) < best[0]:
            best = (int(row[6]), row[0])
    return best[1] if best else None


def _default_route_ifname_macos() -> str | None:
    """Unverified: written from `route -n get default`'s documented output, not run on a Mac."""
    try:
        out = subprocess.run(["route", "-n", "get", "default"], capture_output=True, text=True,
                             timeout=_ROUTE_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "interface" and value.strip():
            return value.strip()
    return None


def default_route_address() -> str | None:
    """The IPv4 address of the interface that holds the default route."""
    ifname = _default_route_ifname_macos() if sys.platform == "darwin" else _default_route_ifname_linux()
    if ifname is None:
        return None
    try:
        ip = _interface_ipv4(ifname)
    except OSError:
        return None
    return None if is_loopback(ip) or _is_unspecified(ip) else ip


def choose_bind_address(cfg: EngineConfig, master_addr: str | None, store: Any = None) -> str:
    """MCCL_BIND_ADDR, else MCCL_SOCKET_IFNAME, else the route toward MASTER_ADDR, else the
    route toward the store's host, else the host name's address, else the default-route
    interface's, else loopback."""
    if cfg.bind_addr:
        if cfg.bind_addr in ("0.0.0.0", "::"):
            # The listen address is also what peers are told to dial.
            raise ConfigError(f"[rendezvous] MCCL_BIND_ADDR={cfg.bind_addr} cannot be dialled by peers; set it "
                              "to this host's address on the training network, or set MCCL_SOCKET_IFNAME")
        return cfg.bind_addr
    if cfg.socket_ifname:
        return interface_address(cfg.socket_ifname)
    host = store_host(store)
    guesses = [
        (f"the route to MASTER_ADDR={master_addr}", lambda: routed_address(master_addr) if master_addr else None),
        (f"the route to the store's host {host}", lambda: routed_address(host) if host else None),
        ("the host name's address", hostname_address),
        ("the default route's interface", default_route_address),
    ]
    for source, guess in guesses:
        addr = guess()
        if addr:
            _log.debug("[rendezvous] listening on %s: %s", addr, source)
            return addr
    _log.warning("[rendezvous] no MASTER_ADDR, store host, host name address or default route to pick a "
                 "listen address from; listening on %s, which only ranks on this host can reach. For "
                 "several hosts, %s", LOOPBACK, _FIX)
    return LOOPBACK


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` ("host" or "host:port") only reaches this host."""
    if addr.startswith("["):
        host = addr[1:].split("]", 1)[0]
    else:
        host = addr.rsplit(":", 1)[0] if addr.count(":") == 1 else addr
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ENGINE_ADVICE = ("Likely cause: no MASTER_ADDR in the environment and no route or host name to pick an address "
                 "from on that host, or MCCL_BIND_ADDR/MCCL_SOCKET_IFNAME set to loopback there; "
                 f"{_FIX}, on every host")


def check_no_loopback_mix(addrs: list[str], rank: int, where: str, advice: str = ENGINE_ADVICE, of: str = "") -> None:
    """Raise ConfigError when ``addrs`` (every rank's published "host:port") mixes loopback
    and real addresses: the ranks on loopback cannot be dialled from the others' hosts, so
    connecting would only wait out the timeout. Every rank holds the same table, so every
    rank raises here, before any of them dials. ``where`` opens the message ("[component]
    group ..."), ``of`` follows each rank's number ("'s mccld")."""
    loop = [r for r, a in enumerate(addrs) if is_loopback(a)]
    if not loop or len(loop) == len(addrs):
        return
    real = [r for r in range(len(addrs)) if r not in loop]
    # This rank's own address first: it is the one this log's reader can change.
    lr = rank if rank in loop else loop[0]
    rr = rank if rank in real else real[0]
    raise ConfigError(
        f"{where}: rank {lr}{of} listens on loopback {addrs[lr]} but rank {rr}{of} publishes {addrs[rr]} "
        f"(loopback on ranks {_ranks(loop)}, other addresses on ranks {_ranks(real)}; seen by rank {rank}): "
        f"ranks on other hosts cannot dial a loopback address. {advice}")


def _ranks(rs: list[int], shown: int = 8) -> str:
    head = ", ".join(str(r) for r in rs[:shown])
    return head + (f" and {len(rs) - shown} more" if len(rs) > shown else "")
