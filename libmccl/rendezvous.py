"""Address exchange through the c10d store: comm id, listen address, peer table.

Every process group (the default one and each ``new_group``) gets its own store
prefix from torch. Inside it, rank 0 draws a random 64-bit communicator id and
every rank publishes the "host:port" its engine listens on. A per-rank creation
counter keeps keys of a group re-created on the same store (re-init after
``destroy_process_group`` with a user-supplied store) from colliding with the
previous incarnation's.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .config import EngineConfig
from .errors import CollectiveTimeout, ConfigError

_log = logging.getLogger(__name__)

_KEY_ROOT = "mccl"
_LOOPBACK = "127.0.0.1"
_RESOLVE_TIMEOUT_S = 5.0  # seconds; only used to pick a listen address when none is configured
# ioctl(SIOCGIFADDR): an interface's IPv4 address, without extra dependencies.
_SIOCGIFADDR = 0xC0206921 if sys.platform == "darwin" else 0x8915


@dataclass(frozen=True)
class Rendezvous:
    comm_id: int
    peer_addrs: list[str]     # "host:port" per rank; empty when no listener was asked for
    listener: Any             # this rank's engine Listener, or None
    store: Any                # the store scoped to this incarnation of the group (daemon mode uses it)


def interface_address(ifname: str) -> str:
    """First IPv4 address of interface ``ifname``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            why = "no such interface" if exc.errno == errno.ENODEV else "it has no IPv4 address"
            raise ConfigError(f"[rendezvous] MCCL_SOCKET_IFNAME={ifname!r} cannot be used: {why} ({exc}); "
                              "set it to an interface listed by `ip addr`/`ifconfig`, or set MCCL_BIND_ADDR") from None
    return socket.inet_ntoa(packed[20:24])


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
        _log.warning("[rendezvous] resolving MASTER_ADDR=%s took over %.0f s; not using it to pick the "
                     "listen address (set MCCL_BIND_ADDR or MCCL_SOCKET_IFNAME)", host, timeout_s)
        return None
    return found[0] if found else None


def routed_address(target: str) -> str | None:
    """The local address the kernel would use to reach ``target``.

    Connecting a UDP socket only selects a route; no packet is sent.
    """
    target_ip = _resolve(target, _RESOLVE_TIMEOUT_S)
    if target_ip is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target_ip, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def choose_bind_address(cfg: EngineConfig, master_addr: str | None) -> str:
    """MCCL_BIND_ADDR, else MCCL_SOCKET_IFNAME, else the route toward MASTER_ADDR, else loopback."""
    if cfg.bind_addr:
        if cfg.bind_addr in ("0.0.0.0", "::"):
            # The listen address is also what peers are told to dial.
            raise ConfigError(f"[rendezvous] MCCL_BIND_ADDR={cfg.bind_addr} cannot be dialled by peers; set it "
                              "to this host's address on the training network, or set MCCL_SOCKET_IFNAME")
        return cfg.bind_addr
    if cfg.socket_ifname:
        return interface_address(cfg.socket_ifname)
    if master_addr:
        addr = routed_address(master_addr)
        if addr and addr != "0.0.0.0":
            return addr
    return _LOOPBACK


def _wait_keys(store: Any, keys: list[str], timeout_s: float, what: Callable[[list[str]], str]) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        missing = [k for k in keys if not _has_key(store, k)]
        if not missing:
            raise
        raise CollectiveTimeout(f"[rendezvous] waited {timeout_s:.0f}s for {what(missing)}, "
                                "likely cause: a rank did not start, crashed, or created a different "
                                "process group; check every rank's log, or raise the timeout") from exc


def _has_key(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - a store that cannot answer counts as "missing"
        return False


def exchange(store: Any, rank: int, size: int, listener_factory: Callable[[str], Any] | None,
             cfg: EngineConfig, timeout_s: float, group_id: str = "") -> Rendezvous:
    """Agree on a comm id and, given ``listener_factory``, exchange listen addresses.

    ``listener_factory(host)`` binds and listens at once, so a peer can dial us as
    soon as our address is in the store. Without it (daemon mode) only the comm id
    and the scoped store are produced.
    """
    started = time.monotonic()
    generation = int(store.add(f"{_KEY_ROOT}/incarnation/{rank}", 1))
    prefix = f"{_KEY_ROOT}/{generation}"
    label = f"group {group_id!r}" if group_id else "the process group"

    listener = None
    if listener_factory is not None:
        host = choose_bind_address(cfg, os.environ.get("MASTER_ADDR"))
        listener = listener_factory(host)
        store.set(f"{prefix}/addr/{rank}", listener.address)
    if rank == 0:
        store.set(f"{prefix}/comm_id", str(secrets.randbits(64)))

    addr_keys = [f"{prefix}/addr/{r}" for r in range(size)] if listener is not None else []
    _wait_keys(store, [f"{prefix}/comm_id"] + addr_keys, timeout_s,
               lambda missing: f"{label}: rank {rank} is missing "
               + ", ".join("the comm id from rank 0" if k.endswith("comm_id") else f"rank {k.rsplit('/', 1)[1]}'s address"
                           for k in missing))
    comm_id = int(store.get(f"{prefix}/comm_id").decode())
    peers = [store.get(k).decode() for k in addr_keys]
    _log.debug("[rendezvous] %s rank %d/%d: comm_id=%016x, listening on %s, in %.3fs", label, rank, size,
               comm_id, listener.address if listener is not None else "-", time.monotonic() - started)
    from torch.distributed import PrefixStore

    return Rendezvous(comm_id=comm_id, peer_addrs=peers, listener=listener,
                      store=PrefixStore(f"{prefix}/", store))
