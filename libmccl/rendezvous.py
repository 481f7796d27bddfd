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
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from mccl_common.errors import CollectiveTimeout, ConfigError
from mccl_common.settings import EngineConfig

from . import listen_addr

_log = logging.getLogger(__name__)

_KEY_ROOT = "mccl"
# Published instead of an address by a rank that cannot listen, so that its peers stop
# waiting for it at once; no "host:port" starts with it.
_FAILED = "!"
_LINGER_S = 10.0  # at most this long a failing rank waits for its peers to read why


@dataclass(frozen=True)
class Rendezvous:
    comm_id: int
    peer_addrs: list[str]     # "host:port" per rank; empty when no listener was asked for
    listener: Any             # this rank's engine Listener, or None
    store: Any                # the store scoped to this incarnation of the group (daemon mode uses it)


def _wait_keys(store: Any, keys: list[str], timeout_s: float, what: Callable[[list[str]], str]) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        missing = [k for k in keys if not _has_key(store, k)]
        if not missing:
            raise
        raise CollectiveTimeout(f"[rendezvous] Timed out after {timeout_s:.0f}s waiting for {what(missing)}; "
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

    addr_keys = [f"{prefix}/addr/{r}" for r in range(size)] if listener_factory is not None else []
    listener = None
    if listener_factory is not None:
        try:
            listener = listener_factory(listen_addr.choose_bind_address(cfg, os.environ.get("MASTER_ADDR"), store))
        except Exception as exc:
            try:
                store.set(addr_keys[rank], f"{_FAILED}{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - the store failing too must not hide why we stop
                _log.debug("[rendezvous] rank %d could not publish its failure", rank, exc_info=True)
            else:
                linger(store, prefix, rank, size, timeout_s)
            raise
        store.set(addr_keys[rank], listener.address)
    if rank == 0:
        store.set(f"{prefix}/comm_id", str(secrets.randbits(64)))

    try:
        _wait_keys(store, [f"{prefix}/comm_id"] + addr_keys, timeout_s,
                   lambda missing: f"{label}: rank {rank} is missing "
                   + ", ".join("the comm id from rank 0" if k.endswith("comm_id")
                               else f"rank {k.rsplit('/', 1)[1]}'s address" for k in missing))
        comm_id = int(store.get(f"{prefix}/comm_id").decode())
        peers = [store.get(k).decode() for k in addr_keys]
        _check_peers(peers, rank, label)
    except BaseException as exc:
        if listener is not None:
            listener.close()
        if isinstance(exc, ConfigError):
            linger(store, prefix, rank, size, timeout_s)
        raise
    _log.debug("[rendezvous] %s rank %d/%d: comm_id=%016x, listening on %s, in %.3fs", label, rank, size,
               comm_id, listener.address if listener is not None else "-", time.monotonic() - started)
    from torch.distributed import PrefixStore

    return Rendezvous(comm_id=comm_id, peer_addrs=peers, listener=listener,
                      store=PrefixStore(f"{prefix}/", store))


def _check_peers(peers: list[str], rank: int, label: str) -> None:
    """Fail before any rank dials when the address table cannot work; every rank sees
    the same table, so every rank fails alike."""
    for r, addr in enumerate(peers):
        if addr.startswith(_FAILED):
            raise ConfigError(f"[rendezvous] {label}: rank {r} could not start listening ({addr[len(_FAILED):]}); "
                              f"rank {rank} stops too. Fix the setting rank {r}'s error names and restart every rank")
    listen_addr.check_no_loopback_mix(peers, rank, f"[rendezvous] {label}")


def linger(store: Any, prefix: str, rank: int, size: int, timeout_s: float) -> None:
    """Before a rank raises a failure its peers can see in the table, wait (bounded) until
    each of them has read the table too: the rank hosting the TCPStore takes the store
    down when it exits, and a peer still reading would get a bare connection error
    instead of the reason."""
    try:
        store.set(f"{prefix}/failed_seen/{rank}", "1")
        store.wait([f"{prefix}/failed_seen/{r}" for r in range(size)],
                   datetime.timedelta(seconds=min(_LINGER_S, timeout_s)))
    except Exception:  # noqa: BLE001 - best effort: the caller raises the real error next
        _log.debug("[rendezvous] rank %d: not every peer confirmed reading the failed table", rank)
