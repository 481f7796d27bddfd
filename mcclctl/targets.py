"""Finding daemons (mDNS or --host) and fetching from them, in parallel and bounded."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from mccl_common import __version__ as MCCL_VERSION
from mccl_common.errors import ConfigError, MCCLError
from mccl_common.status_protocol import query, split_addr

log = logging.getLogger(__name__)

DEFAULT_STATUS_PORT = 29651
DEFAULT_METRICS_PORT = 29652


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


def discover(timeout_s: float) -> list[Target]:
    """Daemons of this host's fleet (MCCL_FLEET) announced over mDNS, sorted by host id."""
    try:
        from mccl_common.daemon_settings import load_config
        from mccl_common.discovery import browse_fleet
    except ImportError as e:
        raise ConfigError(f"[mcclctl] mDNS discovery is unavailable ({e}); name daemons with --host") from None
    cfg = load_config()
    records = browse_fleet(timeout_s, fleet=cfg.fleet)
    return sorted((from_record(r, cfg.status_port or DEFAULT_STATUS_PORT,
                               cfg.metrics_port or DEFAULT_METRICS_PORT) for r in records),
                  key=lambda t: t.host)


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
    """Ask every target at once; a daemon that fails gives a Reply with ``error`` set."""
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
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(one, targets))


def version_mismatches(replies: list[Reply]) -> list[str]:
    ours = MCCL_VERSION
    return [f"{r.target.host} runs mccld {r.version}, this mcclctl is {ours}; upgrade both to the "
            f"same release" for r in replies if r.version and r.version != ours]
