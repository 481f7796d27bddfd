"""The switch of every rank, agreed through the rendezvous store (in-process engine).

Rank 0 reads MCCL_TOPOLOGY (mccl_common/topology.py), places every rank by the address its
engine listens on (a file may name the host by IP, or by a name that resolves to it) and
publishes the result, sealed like every store value; every rank takes it from there, so the
engine's ``switch_of_rank`` is the same everywhere by construction. A rank whose own
MCCL_TOPOLOGY differs from rank 0's fails with a ConfigError rather than silently running
another rank's grouping (and the engine refuses an all-reduce grouped differently anyway:
a topology mismatch). Costs one store write and one read per rank.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import logging
import socket
from typing import Any

from mccl_common import topology
from mccl_common.errors import CollectiveTimeout, ConfigError
from mccl_common.settings import EngineConfig

_log = logging.getLogger(__name__)
_KEY = "topology"
_RESOLVE_TIMEOUT_S = 2.0


def _digest(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read(topology.MAX_FILE_BYTES + 1)).hexdigest()[:16]
    except OSError:
        return "unreadable"


def _host(addr: str) -> str:
    host = addr.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def _addresses_of(name: str) -> set[str]:
    try:
        ipaddress.ip_address(name)
        return {name}
    except ValueError:
        pass
    old = socket.getdefaulttimeout()
    try:
        socket.setdefaulttimeout(_RESOLVE_TIMEOUT_S)
        return {ai[4][0] for ai in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()
    finally:
        socket.setdefaulttimeout(old)


def place(t: topology.Topology, peer_addrs: list[str]) -> list[int]:
    """switch_of_rank for ranks listening at ``peer_addrs``; ConfigError naming an unplaced rank."""
    by_ip = {}
    for switch, hosts in t.switches.items():
        for h in hosts:
            for ip in _addresses_of(h):
                by_ip.setdefault(ip, switch)
    names = []
    for r, addr in enumerate(peer_addrs):
        switch = by_ip.get(_host(addr))
        if switch is None:
            raise ConfigError(f"[topology] rank {r} listens at {addr}, which {t.source} places on no switch; "
                              "name every host of the job by IP (or a name that resolves to it), or unset it")
        names.append(switch)
    return topology.switch_ids(names)


def agree(store: Any, rank: int, size: int, peer_addrs: list[str], cfg: EngineConfig, timeout_s: float) -> list[int]:
    """Every rank's switch id (identical on every rank), or [] for one switch."""
    if size < 2:
        return []
    mine = _digest(cfg.topology)
    if rank == 0:
        doc: dict[str, Any] = {"digest": mine, "switches": [], "error": ""}
        try:
            if cfg.topology:
                doc["switches"] = place(topology.load(cfg.topology), peer_addrs)
        except ConfigError as e:
            doc["error"] = str(e)
        store.set(_KEY, json.dumps(doc))
    else:
        try:
            store.wait([_KEY], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
            raise CollectiveTimeout(f"[topology] Timed out after {timeout_s:.0f}s on rank {rank} waiting for rank 0's "
                                    "switch placement; rank 0 failed or is stuck, check its log") from exc
        doc = json.loads(store.get(_KEY))
    if doc.get("error"):
        raise ConfigError(doc["error"] if rank == 0 else f"{doc['error']} (rank 0 says)")
    if doc.get("digest", "") != mine:
        raise ConfigError(f"[topology] rank {rank}'s MCCL_TOPOLOGY ({cfg.topology or 'unset'}) differs from rank 0's; "
                          "give every rank the same file (or none)")
    switches = [int(x) for x in doc.get("switches") or []]
    if switches and len(switches) != size:
        raise ConfigError(f"[topology] rank 0 placed {len(switches)} ranks on switches, the job has {size}")
    if switches and rank == 0:
        _log.info("[topology] %d ranks on %d switches (%s)", size, len(set(switches)), cfg.topology)
    return switches
