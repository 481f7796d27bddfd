"""Address exchange through the c10d store: comm id, listen address, peer table.

Every process group (the default one and each ``new_group``) gets its own store
prefix from torch. Inside it, rank 0 draws a random 64-bit communicator id and
every rank publishes the "host:port" its engine listens on. A per-rank creation
counter keeps keys of a group re-created on the same store (re-init after
``destroy_process_group`` with a user-supplied store) from colliding with the
previous incarnation's.

The store sees O(N) operations, not O(N^2): rank 0 alone reads the N addresses (one
multi_get) and publishes them as one sealed table, which every other rank reads once.
Every rank reading every other's address was N^2 gets on the one TCPStore server, which
at 200 ranks dominated set-up.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from mccl_common import jobkey, store_auth
from mccl_common.errors import CollectiveTimeout, ConfigError, MCCLError, ProtocolError, StoreAuthError
from mccl_common.settings import EngineConfig

from . import listen_addr, refusal

_log = logging.getLogger(__name__)

_KEY_ROOT = "mccl"
# Published instead of an address by a rank that cannot listen, so that its peers stop
# waiting for it at once; no "host:port" starts with it.
_FAILED = "!"
_LINGER_S = 10.0  # at most this long a failing rank waits for its peers to read why
_NONCE_BYTES = 16  # each rank's per-run nonce, repeated in rank 0's table (hex in the store)
# The comm id's value is "v<VERSION> <comm id> <rank 0's world size> <rank 0's key id>": every
# rank checks the first two against its own before it publishes anything.
_VERSION = 2
_ID_VALUE = re.compile(rb"v(\d{1,6}) (\d{1,20}) (\d{1,6}) ([0-9a-f]{16}|none)")


class _Refused(Exception):
    """This rank cannot join: ``refusal`` is what it posts for its peers, ``error`` what it raises."""

    def __init__(self, ref: refusal.Refusal, error: MCCLError, comm_id: int | None = None) -> None:
        super().__init__(str(error))
        self.refusal = ref
        self.error = error
        self.comm_id = comm_id    # what a sealed refusal is sealed under (the run's comm id)


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

    Every value is sealed (mccl_common/store_auth.py): the comm id under the group's key, each
    address under a key scoped to that comm id, so an address from another job or an earlier
    incarnation cannot be replayed into this one. So rank 0 publishes the comm id first and the
    others publish their addresses once they read it.

    A sealed comm id stays valid under a long-lived key (the fleet key), and the store's key
    names repeat every run: rank 0 knows the id it drew, but another rank cannot tell run 1's
    id, written back into run 2's store, from the one rank 0 drew now. So every rank publishes
    a fresh nonce beside its address (in mccld's mode, alone), and rank 0's table, sealed under
    the comm id's key, repeats each rank's nonce: a rank that finds its own nonce in the table
    knows the table, and the comm id it is sealed under, were written in this run.
    """
    started = time.monotonic()
    generation = int(store.add(f"{_KEY_ROOT}/incarnation/{rank}", 1))
    prefix = f"{_KEY_ROOT}/{generation}"
    label = f"group {group_id!r}" if group_id else "the process group"
    peer = _store_peer(store)
    id_key = f"{prefix}/comm_id"
    try:
        group_key = store_auth.job_store_key(cfg.wire_security, "c10d", group_id)
    except ConfigError:
        # No usable key here: tell the others (rank 0's comm id is what they wait for first),
        # so they fail now naming it instead of at their set-up timeout.
        ref = refusal.Refusal("no_key", rank, refusal.this_host(), "none", size, None, False)
        if rank == 0:
            try:
                store.compare_set(id_key, "", refusal.encode(ref, None, f"{prefix}/refusal"))
            except Exception:  # noqa: BLE001 - the store failing too must not hide why we stop
                _log.debug("[rendezvous] rank 0 could not post its refusal at the comm id", exc_info=True)
        _post_refusal(store, prefix, rank, size, ref, None, timeout_s)
        raise

    def missing_what(missing: list[str]) -> str:
        return f"{label}: rank {rank} is missing " + ", ".join(
            "the comm id from rank 0" if k.endswith("comm_id")
            else "the address table from rank 0" if k.endswith("addr_table")
            else f"rank {k.rsplit('/', 1)[1]}'s address"
            for k in missing)

    our_key_id = jobkey.key_id(jobkey.require_job_key(cfg.wire_security)) if group_key is not None else "none"
    drawn = secrets.randbits(64) if rank == 0 else None
    if drawn is not None:
        store.set(id_key, store_auth.seal(group_key, id_key, comm_id_value(drawn, size, our_key_id)))
    _wait_keys(store, [id_key], timeout_s, missing_what)
    blob = store.get(id_key)
    if drawn is None and refusal.is_refusal(blob):   # rank 0 had no key: only a plain record goes here
        ref = refusal.decode(blob, None, False, f"{prefix}/refusal", id_key, peer)
        error = refusal.error_for(ref, rank, size, label, our_key_id, peer)
        linger(store, prefix, rank, size, timeout_s)
        raise error
    try:
        comm_id = _read_comm_id(blob, id_key, group_key, peer, drawn, rank, size, label, our_key_id)
    except _Refused as refused:
        # Where the others wait, so that they fail now, with this cause, not at their timeout.
        mac_key = store_auth.scoped_key(group_key, "comm", refused.comm_id) if refused.refusal.sealed else None
        _post_refusal(store, prefix, rank, size, refused.refusal, mac_key, timeout_s)
        raise refused.error from None
    addr_key = store_auth.scoped_key(group_key, "comm", comm_id)

    told: list[BaseException] = []   # a peer's refusal we read: we linger on it, as on a ConfigError

    def refused_by_peer(where: str, blob: bytes) -> None:
        """A peer's refusal read where we waited for a value: fail with its cause."""
        ref = refusal.decode(blob, addr_key, True, f"{prefix}/refusal", where, peer)
        told.append(refusal.error_for(ref, rank, size, label, our_key_id, peer))
        raise told[-1]

    addr_keys = [f"{prefix}/addr/{r}" for r in range(size)]
    table_key = f"{prefix}/addr_table"
    nonce = secrets.token_hex(_NONCE_BYTES)
    listener = None
    if listener_factory is not None:
        try:
            listener = listener_factory(listen_addr.choose_bind_address(cfg, os.environ.get("MASTER_ADDR"), store))
        except Exception as exc:
            try:
                store.set(addr_keys[rank], store_auth.seal(
                    addr_key, addr_keys[rank], f"{nonce} {_FAILED}{type(exc).__name__}: {exc}".encode()))
            except Exception:  # noqa: BLE001 - the store failing too must not hide why we stop
                _log.debug("[rendezvous] rank %d could not publish its failure", rank, exc_info=True)
            else:
                if rank == 0:  # the others wait for the table, which must say why we stop
                    try:
                        _publish_table(store, addr_keys, table_key, addr_key, peer, timeout_s, missing_what,
                                       refused_by_peer)
                    except Exception:  # noqa: BLE001 - as above
                        _log.debug("[rendezvous] rank 0 could not publish the table", exc_info=True)
                linger(store, prefix, rank, size, timeout_s)
            raise
    # No engine listens in mccld's mode: the nonce goes alone, the table carries no addresses.
    mine = f"{nonce} {listener.address if listener is not None else ''}"
    store.set(addr_keys[rank], store_auth.seal(addr_key, addr_keys[rank], mine.encode()))

    try:
        if rank == 0:
            rows = _publish_table(store, addr_keys, table_key, addr_key, peer, timeout_s, missing_what,
                                  refused_by_peer)
        else:
            _wait_keys(store, [table_key], timeout_s, missing_what)
            blob = store.get(table_key)
            if refusal.is_refusal(blob):
                refused_by_peer(table_key, blob)
            rows = _open_table(store_auth.open(addr_key, table_key, blob, peer), size, peer)
        _check_fresh(rows, rank, nonce, table_key, peer)
        peers = [addr for _, addr in rows] if listener_factory is not None else []
        _check_peers(peers, rank, label)
    except BaseException as exc:
        if listener is not None:
            listener.close()
        # We may host the store: stay until the others read why (they may wait on the same table).
        if isinstance(exc, ConfigError) or exc in told:
            linger(store, prefix, rank, size, timeout_s)
        raise
    _log.debug("[rendezvous] %s rank %d/%d: comm_id=%016x, listening on %s, in %.3fs", label, rank, size,
               comm_id, listener.address if listener is not None else "-", time.monotonic() - started)
    from torch.distributed import PrefixStore

    from .sealed_store import SealedStore

    # What the daemon client reads from the group's store (its peers' mccld addresses) is
    # sealed under this communicator's key too.
    return Rendezvous(comm_id=comm_id, peer_addrs=peers, listener=listener,
                      store=SealedStore(PrefixStore(f"{prefix}/", store), addr_key, peer))


def _publish_table(store: Any, addr_keys: list[str], table_key: str, addr_key: bytes | None, peer: str,
                   timeout_s: float, missing_what: Callable[[list[str]], str],
                   refused_by_peer: Callable[[str, bytes], None]) -> list[tuple[str, str]]:
    """Rank 0: reads every rank's sealed "nonce address" (each checked under the comm's key)
    and publishes them as one sealed table; returns them as (nonce, address) rows. A
    refusal in a rank's slot (refusal.py) fails it with that refusal's cause."""
    _wait_keys(store, addr_keys, timeout_s, missing_what)
    blobs = store.multi_get(addr_keys) if hasattr(store, "multi_get") else [store.get(k) for k in addr_keys]
    for k, b in zip(addr_keys, blobs):
        if refusal.is_refusal(b):
            refused_by_peer(k, b)
    rows = [store_auth.open(addr_key, k, b, peer).decode(errors="replace") for k, b in zip(addr_keys, blobs)]
    # Newline-separated: no "host:port" (nor a failure text, which we flatten) holds one.
    body = "\n".join(r.replace("\n", " ") for r in rows)
    store.set(table_key, store_auth.seal(addr_key, table_key, body.encode()))
    return _open_table(body.encode(), len(addr_keys), peer)


def _open_table(raw: bytes, size: int, peer: str) -> list[tuple[str, str]]:
    lines = raw.decode(errors="replace").split("\n")
    if len(lines) != size:
        # The table passed its MAC: rank 0 of this job wrote it, for a world of another size.
        raise ConfigError(f"[rendezvous] world size mismatch: rank 0 started a world of {len(lines)} ranks, this "
                          f"rank one of {size} (store peer={peer}); every rank must be started with the same world "
                          "size (WORLD_SIZE, torchrun's --nnodes x --nproc-per-node): fix the launch on the hosts "
                          "that differ and restart every rank", peer_addr=peer)
    rows = []
    for line in lines:
        nonce, _, addr = line.partition(" ")
        rows.append((nonce, addr))
    return rows


def _check_fresh(rows: list[tuple[str, str]], rank: int, nonce: str, table_key: str, peer: str) -> None:
    """The table must repeat the nonce this rank drew for this run: a table (and the comm id
    it is sealed under) recorded in an earlier run under the same key cannot."""
    if rows[rank][0] != nonce:
        raise StoreAuthError(f"[rendezvous] the address table under {table_key!r} does not carry the nonce rank "
                             f"{rank} published in this run, peer={peer}: it (or the comm id it is sealed under) "
                             "was recorded in an earlier run under the same key and written back by someone who "
                             "can reach the store, and was not used; restart the job, give each run its own key "
                             "(mcclctl run does) and keep the store's port off untrusted networks", peer_addr=peer)


def _read_comm_id(blob: bytes, id_key: str, group_key: bytes | None, peer: str, drawn: int | None, rank: int,
                  size: int, label: str, our_key_id: str) -> int:
    """The group's comm id, checked; rank 0 also checks it reads back the id it drew, so a
    sealed id replayed from an earlier job under the same key stops the group at once.
    Raises _Refused when this rank cannot join the world rank 0 started: another key, another
    world size, another rendezvous version. ``blob``: what the store holds under ``id_key``."""
    try:
        raw = store_auth.open(group_key, id_key, blob, peer)
    except StoreAuthError as exc:
        if drawn is not None:
            raise
        theirs = _unverified_key_id(blob)
        ref = refusal.Refusal("key", rank, refusal.this_host(), our_key_id, size, None, False)
        raise _Refused(ref, StoreAuthError(
            f"[rendezvous] {label}: rank {rank} cannot join: the comm id rank 0 wrote under {id_key!r} does not "
            f"verify under this host's key, peer={peer}; likely cause: the hosts hold different job keys (ours has "
            f"key id {our_key_id}, rank 0's value claims key id {theirs}), or someone without the key wrote it; "
            "give every host the same key (MCCL_JOB_KEY_FILE or the fleet key) and restart every rank. The other "
            f"ranks were told. ({exc})", peer_addr=peer)) from None
    m = _ID_VALUE.fullmatch(raw)
    if m is None or int(m.group(1)) != _VERSION:
        seen = int(m.group(1)) if m is not None else 1 if raw.isdigit() else None
        if seen is None:
            raise StoreAuthError(f"[rendezvous] the comm id under {id_key!r} is not a number, peer={peer}: a "
                                 "writer holding the job's key wrote something else there; check which programs "
                                 "use this job key", peer_addr=peer)
        ref = refusal.Refusal("version", rank, refusal.this_host(), our_key_id, _VERSION, seen, True)
        error = ProtocolError(f"[rendezvous] {label}: version skew: rank 0 wrote rendezvous version {seen}, rank "
                              f"{rank} speaks version {_VERSION} (store peer={peer}); install the same MCCL version "
                              "on every host and restart every rank", peer_addr=peer)
        raise _Refused(ref, error, int(m.group(2)) if m is not None else int(raw))
    comm_id, root_size = int(m.group(2)), int(m.group(3))
    if drawn is not None and comm_id != drawn:
        raise StoreAuthError(f"[rendezvous] the comm id under {id_key!r} was replaced after rank 0 wrote it, "
                             f"peer={peer}: a value replayed from an earlier job under the same key, written by "
                             "someone who can reach the store; restart the job, and give each run its own key "
                             "(mcclctl run does) or keep the store's port off untrusted networks", peer_addr=peer)
    if root_size != size:
        ref = refusal.Refusal("world_size", rank, refusal.this_host(), our_key_id, size, root_size, True)
        raise _Refused(ref, ConfigError(
            f"[rendezvous] {label}: world size mismatch: rank 0 started a world of {root_size} ranks, this rank "
            f"{rank} one of {size} (store peer={peer}); every rank must be started with the same world size "
            "(WORLD_SIZE, torchrun's --nnodes x --nproc-per-node): fix the launch on the hosts that differ and "
            "restart every rank. The other ranks were told", peer_addr=peer, peer_rank=0), comm_id)
    return comm_id


def comm_id_value(comm_id: int, size: int, key_id: str) -> bytes:
    """What rank 0 seals under the comm id's key: the id, with what every rank checks first."""
    return f"v{_VERSION} {comm_id} {size} {key_id}".encode()


def _unverified_key_id(blob: bytes | str) -> str:
    """Rank 0's key id as its comm id value claims it, read without the key (only to name it in
    the error of a rank whose key does not verify it): a bounded pattern or "unknown"."""
    value = store_auth.unverified_value(blob)
    m = _ID_VALUE.fullmatch(value) if value is not None else None
    return m.group(4).decode() if m is not None else "unknown"


def _post_refusal(store: Any, prefix: str, rank: int, size: int, ref: refusal.Refusal, mac_key: bytes | None,
                  timeout_s: float) -> None:
    """Write ``ref`` into every key a peer of this incarnation may wait on and that is still
    empty (create-if-missing: nothing already written is replaced, so a refusal arriving
    after the table was read changes nothing), then linger until they read it."""
    name = f"{prefix}/refusal"
    blob = refusal.encode(ref, mac_key, name)
    other = ref.seen if ref.code == "world_size" and ref.seen is not None else size
    keys = [f"{prefix}/addr/{r}" for r in range(max(size, other))] + [f"{prefix}/addr_table"]
    try:
        for key in [keys[rank]] + keys:
            store.compare_set(key, "", blob)
        # Ranks that exist in one of the two worlds only read nothing: nobody waits for them.
        for r in range(min(size, other), max(size, other)):
            store.set(f"{prefix}/failed_seen/{r}", "1")
    except Exception:  # noqa: BLE001 - the store failing too must not hide why we stop
        _log.debug("[rendezvous] rank %d could not post its refusal", rank, exc_info=True)
        return
    _log.info("[rendezvous] rank %d posted its refusal (%s) for its peers", rank, ref.code)
    linger(store, prefix, rank, size, timeout_s)


def _store_peer(store: Any) -> str:
    """host:port of the TCPStore under ``store`` (through PrefixStores), for error messages."""
    inner = store
    for _ in range(8):
        host, port = getattr(inner, "host", None), getattr(inner, "port", None)
        if host is not None and port is not None:
            return f"{host}:{port}"
        try:
            inner = inner.underlying_store
        except (AttributeError, RuntimeError):
            break
    return "the c10d store"


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
