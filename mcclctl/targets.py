"""Finding daemons (the local daemon's gossiped table, MCCL_PEERS, mDNS or --host) and fetching
from them, in parallel and bounded."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from mccl_common import __version__ as MCCL_VERSION
from mccl_common.errors import ConfigError, MCCLError
from mccl_common.status_protocol import query, split_addr

log = logging.getLogger(__name__)

DEFAULT_STATUS_PORT = 29651
DEFAULT_METRICS_PORT = 29652
MAX_PARALLEL = 256        # status requests in flight at once (a thread each, mostly waiting on the network)
TABLE_TIMEOUT_S = 2.0     # for a daemon's fleet table: the local daemon answers in milliseconds
_SLACK_S = 1.0            # past a query's own timeout, for its thread to report


@dataclass(frozen=True)
class Target:
    """One daemon as mcclctl reaches it."""
    host: str            # host id (mDNS) or what the user typed
    status_addr: str     # host:port of its status endpoint
    metrics_addr: str    # host:port of its /metrics


@dataclass
class Reply:
    target: Target
    result: Any = None
    error: str | None = None     # "ExceptionClass: message" when the daemon could not answer
    version: str | None = None
    clock_offset_s: float | None = None   # daemon clock - ours, estimated mid-request
    rtt_s: float | None = None


def from_hosts(hosts: Iterable[str]) -> list[Target]:
    out = []
    for h in hosts:
        host, port = split_addr(h, DEFAULT_STATUS_PORT)
        out.append(Target(host=host, status_addr=f"{host}:{port}",
                          metrics_addr=f"{host}:{DEFAULT_METRICS_PORT}"))
    return out


def _field(rec: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if isinstance(rec, dict) and rec.get(name) is not None:
            return rec[name]
        if getattr(rec, name, None) is not None:
            return getattr(rec, name)
    props = rec.get("properties") if isinstance(rec, dict) else getattr(rec, "properties", None)
    for name in names:
        if props and props.get(name) is not None:
            return props[name]
    return default


def from_record(rec: Any, status_port: int = DEFAULT_STATUS_PORT,
                metrics_port: int = DEFAULT_METRICS_PORT) -> Target:
    """A Target from one ``mccl_common.discovery.browse_fleet`` record (dict or object).

    The ports come from the record when the daemon advertises them, else from this
    host's settings (a fleet normally uses one MCCL_STATUS_PORT / MCCL_METRICS_PORT).
    """
    host = str(_field(rec, "host_id", "host", "name", default="?"))
    addresses = _field(rec, "addresses", default=None)
    addr = str(addresses[0]) if addresses else str(_field(rec, "ip", "address", "addr", default=host))
    ip = split_addr(addr, 0)[0] if addr.count(":") == 1 else addr
    status_port = int(_field(rec, "status_port", default=status_port))
    metrics_port = int(_field(rec, "metrics_port", default=metrics_port))
    return Target(host=host, status_addr=f"{ip}:{status_port}", metrics_addr=f"{ip}:{metrics_port}")


@dataclass
class Fleet:
    """The daemons mcclctl shows, and which fleet they are: every view names it."""
    name: str | None          # the fleet asked for (None: --host without --fleet; the daemons say)
    source: str               # where the daemons came from, in words
    targets: list[Target]
    others: dict[str, int] = field(default_factory=dict)   # other fleets seen on the way: daemons each

    def describe(self, reported: Iterable[str | None] = ()) -> str:
        """"fleet lab: 3 daemons (from ...)"; ``reported``: the fleets the daemons answered with."""
        from .formatting import fleet_line
        return fleet_line({"name": self.name, "source": self.source, "daemons": len(self.targets),
                           "reported": sorted({f for f in reported if f}), "other_fleets": self.others})

    def strays(self, replies: list[Reply]) -> list[str]:
        """Warnings for daemons that answered with another fleet than the one asked for."""
        out = []
        for r in replies:
            theirs = r.result.get("fleet") if isinstance(r.result, dict) else None
            if self.name and theirs and theirs != self.name:
                host = r.result.get("host") or r.target.host
                out.append(f"{host} belongs to fleet {theirs}, not {self.name}")
        return out

    def to_json(self, replies: list[Reply] = ()) -> dict:
        reported = sorted({r.result.get("fleet") for r in replies if isinstance(r.result, dict)
                           and r.result.get("fleet")})
        return {"name": self.name, "source": self.source, "daemons": len(self.targets),
                "reported": reported, "other_fleets": dict(self.others)}


def wanted_fleet(fleet: str | None) -> str:
    """--fleet, else MCCL_FLEET (mccld.toml / environment), else "default"."""
    if fleet:
        return fleet
    from mccl_common.daemon_settings import load_config
    return load_config().fleet


def discover(timeout_s: float, key: bytes | None = None, fleet: str | None = None) -> list[Target]:
    return find_fleet(timeout_s, key, fleet).targets


def find_fleet(timeout_s: float, key: bytes | None = None, fleet: str | None = None) -> Fleet:
    """Daemons of ``fleet`` (default MCCL_FLEET), sorted by host id.

    First the table of this host's own daemon, which knows every subnet through gossip
    (mccld/net/gossip.py) and answers at once; else the tables of the MCCL_PEERS seeds; else
    whatever answers mDNS on this subnet within ``timeout_s`` (unless MCCL_DISCOVERY=off).
    ``key`` (the fleet key) lets mcclctl ask daemons; without one only mDNS is tried. Daemons
    of other fleets are left out and counted in ``others``, so an empty answer can say why."""
    from mccl_common.daemon_settings import load_config
    cfg = load_config()
    name = fleet or cfg.fleet
    ports = (cfg.status_port or DEFAULT_STATUS_PORT, cfg.metrics_port or DEFAULT_METRICS_PORT)
    seen: dict[str, set[str]] = {}     # other fleets -> their hosts (a host seen twice counts once)

    def others() -> dict[str, int]:
        return {f: len(hosts) for f, hosts in sorted(seen.items())}

    def split(rows: list, label: str) -> Fleet | None:
        mine = []
        for r in rows:
            theirs = _field(r, "fleet", default=None)
            if theirs is None or theirs == name:
                mine.append(r)
            else:
                seen.setdefault(str(theirs), set()).add(str(_field(r, "host_id", "host", "name", default="?")))
        if not mine:
            return None
        return Fleet(name, label, sorted((from_record(r, *ports) for r in mine), key=lambda t: t.host), others())

    if key is not None and cfg.status_port:
        for label, addrs in (("this host's mccld", _own_daemon(cfg)),
                             ("the MCCL_PEERS seeds", [f"{h}:{cfg.status_port}" for h, _ in cfg.seeds()])):
            found = split(_tables(addrs, key), label)
            if found:
                return found
    if cfg.discovery == "off":
        return Fleet(name, "nowhere: MCCL_DISCOVERY=off and no daemon's fleet table could be read", [], others())
    try:
        from mccl_common.discovery import browse_fleet
    except ImportError as e:
        raise ConfigError(f"[mcclctl] mDNS discovery is unavailable ({e}) and no daemon's fleet table could be "
                          "read; name daemons with --host, or set MCCL_PEERS") from None
    return split(browse_fleet(timeout_s, fleet=None), "mDNS") or Fleet(name, "mDNS", [], others())


def _own_daemon(cfg) -> list[str]:
    """The status endpoint this host's mccld listens on (the address it would choose)."""
    from mccl_common.netif import choose_address
    try:
        return [f"{choose_address(cfg.iface, cfg.listen_addr, cfg.allow_wifi)[1]}:{cfg.status_port}"]
    except MCCLError as e:
        log.debug("no local daemon address: %s", e)
        return []


def _tables(addrs: list[str], key: bytes) -> list[dict]:
    """The union of the fleet tables these daemons hold ([] if none answers)."""
    rows: dict[str, dict] = {}
    for r in fetch(from_hosts(addrs), key, "fleet", timeout_s=TABLE_TIMEOUT_S):
        if r.error:
            log.debug("fleet table of %s: %s", r.target.status_addr, r.error)
            continue
        theirs = (r.result or {}).get("fleet")
        for row in (r.result or {}).get("fleet_table") or []:
            if isinstance(row, dict) and isinstance(row.get("host_id"), str):
                if theirs and not row.get("fleet"):
                    row = {**row, "fleet": theirs}
                rows.setdefault(row["host_id"], row)
    return list(rows.values())


def load_key(key_file: str | None) -> bytes:
    from mccl_common.daemon_settings import load_config
    env = None
    if key_file:
        import os
        env = dict(os.environ, MCCL_KEY_FILE=key_file)
        env.pop("MCCL_FLEET_KEY", None)
    return load_config(env=env).read_key()


def fetch(targets: list[Target], key: bytes, method: str, args: dict | None = None,
          timeout_s: float = 5.0) -> list[Reply]:
    """Ask every target at once (at most MAX_PARALLEL in flight), each within ``timeout_s`` as a
    whole; a daemon that fails or does not answer in time gives a Reply with ``error`` set, so
    one unreachable host costs the caller ``timeout_s`` once, not once per host."""
    def one(t: Target) -> Reply:
        if t.status_addr.endswith(":0"):
            return Reply(t, error="status endpoint disabled on that host (MCCL_STATUS_PORT=0)")
        t0 = time.time()
        try:
            result, hello = query(t.status_addr, key, method, args, timeout_s=timeout_s)
        except MCCLError as e:
            return Reply(t, error=f"{type(e).__name__}: {e}")
        t1 = time.time()
        offset = hello["time"] - (t0 + t1) / 2 if isinstance(hello.get("time"), (int, float)) else None
        return Reply(t, result=result, version=hello.get("version"), clock_offset_s=offset, rtt_s=t1 - t0)

    if not targets:
        return []
    replies: list[Reply | None] = [None] * len(targets)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(targets)):
        todo.put(i)
    done = threading.Semaphore(0)

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                replies[i] = one(targets[i])
            except Exception as e:  # noqa: BLE001 - one host's surprise must not lose the others
                replies[i] = Reply(targets[i], error=f"{type(e).__name__}: {e}")
            done.release()

    # Daemon threads: a host that never answers must not hold mcclctl's exit.
    for _ in range(min(MAX_PARALLEL, len(targets))):
        threading.Thread(target=worker, name="mcclctl-fetch", daemon=True).start()
    # Each query bounds its own connect and reads; the deadline bounds the whole (a host that
    # dribbles bytes), plus a wave of waiting when more hosts than MAX_PARALLEL are asked.
    waves = -(-len(targets) // MAX_PARALLEL)
    deadline = time.monotonic() + waves * (timeout_s + _SLACK_S)
    for _ in targets:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    return [r if r is not None else Reply(t, error=f"DaemonUnavailableError: no answer within {timeout_s:.1f} s; "
                                                    "the host is unreachable or its daemon hangs")
            for t, r in zip(targets, list(replies))]


def version_mismatches(replies: list[Reply]) -> list[str]:
    ours = MCCL_VERSION
    return [f"{r.target.host} runs mccld {r.version}, this mcclctl is {ours}; upgrade both to the "
            f"same release" for r in replies if r.version and r.version != ours]
