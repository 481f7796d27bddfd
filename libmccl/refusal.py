"""A rank's refusal to join, posted in the c10d store where its peers wait (issue 36).

A rank that cannot join its group (its key does not verify rank 0's comm id, rank 0 started
a world of another size, rank 0 speaks another rendezvous version) used to fail alone while
the others waited for its address until their own set-up timeout and then blamed "a rank did
not start". Now it writes a *refusal record* into every store key its peers may be waiting
on in this incarnation of the group (its own address slot, the other ranks' slots, the
address table), with create-if-missing so that no value already written is replaced. A peer
whose wait returns reads the record instead of a value and fails at once with the cause.

Two kinds, because a host without the job's key cannot prove anything:

- **sealed** (code ``world_size`` or ``version``): written by a rank that verified rank 0's
  comm id, so it holds the job key; MACed under the comm id's key (fresh every run, so a
  record cannot be replayed into another run) over the fixed name ``<prefix>/refusal``.
  Readers believe its fields.
- **plain** (code ``key``, or ``no_key`` from a rank that could not load any job key at all):
  written by a rank whose key did not verify the comm id. It carries
  no MAC and anyone who can reach the store can write one; readers still fail on it, naming
  it as the claim it is. This adds nothing to what a keyless writer can already do (see
  docs/security.md, "What a keyless host can still do"): it only turns a stall into an error.

Through mccld (MCCL_DAEMON=1) the ranks meet in the store as above, then each joins the job
through its own mccld, which links to the other hosts' daemons. A rank whose mccld could not
link (another fleet key, MCCL_FLEET or version) posts a ``daemon_link`` record in the comm's
sealed store (``libmccl/daemon/attach.py``); the others look for it about once a second while
they wait on their own mccld, and fail with it. There only a verified record counts: anything
else under that key is logged once and ignored, as no value is waited on there.

Either way the record is small ASCII of a fixed shape, read with one regular expression
after a length cap; anything else under the refusal prefix is refused as malformed (a
``StoreAuthError``), never half-parsed, and nothing of a record reaches an error message
except fields that passed the pattern.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from mccl_common import store_auth
from mccl_common.errors import AuthError, ConfigError, MCCLError, ProtocolError, StoreAuthError

PREFIX = b"mccl-refusal1 "
MAX_BYTES = 512          # a real record is under 200 bytes
CODES = ("key", "no_key", "world_size", "version", "daemon_link")
SEALED_CODES = ("world_size", "version", "daemon_link")   # only a holder of the key can claim these
_BODY = re.compile(rb"v=1 code=(key|no_key|world_size|version|daemon_link) rank=(\d{1,6}) host=([A-Za-z0-9._:\[\]-]{1,64}) "
                   rb"key=([0-9a-f]{16}|none) mine=(\d{1,6}) seen=(\d{1,6}|-)")
_HOST_CHARS = re.compile(r"[^A-Za-z0-9._:\[\]-]")


@dataclass(frozen=True)
class Refusal:
    code: str
    rank: int        # the rank the refusing process was started as
    host: str        # its MCCL_HOST_ID or host name (its own claim)
    key_id: str      # jobkey.key_id of its key
    mine: int        # its world size (world_size, key) or its rendezvous version (version)
    seen: int | None  # what it read from rank 0: a world size or a version
    sealed: bool     # True: its writer proved the job key; False: a claim anyone could write


def this_host() -> str:
    name = os.environ.get("MCCL_HOST_ID") or socket.gethostname() or "unknown"
    return _HOST_CHARS.sub("_", name)[:64]


def encode_body(ref: Refusal) -> bytes:
    """The record's fields alone, for a store that seals what it is given (a SealedStore)."""
    return (f"v=1 code={ref.code} rank={ref.rank} host={_HOST_CHARS.sub('_', ref.host)[:64]} key={ref.key_id} "
            f"mine={ref.mine} seen={'-' if ref.seen is None else ref.seen}").encode()


def encode(ref: Refusal, mac_key: bytes | None, name: str) -> bytes:
    """The record for ``ref``: sealed under ``mac_key`` over ``name`` when ``ref.sealed``."""
    body = encode_body(ref)
    if ref.sealed:
        return PREFIX + b"sealed " + store_auth.seal(mac_key, name, body)
    return PREFIX + b"plain " + body


def is_refusal(blob: bytes | str) -> bool:
    raw = blob.encode() if isinstance(blob, str) else bytes(blob)
    return raw.startswith(PREFIX)


def decode(blob: bytes | str, mac_key: bytes | None, can_verify: bool, name: str, where: str,
           peer: str) -> Refusal:
    """The refusal in ``blob`` (read under the store key ``where``), or a StoreAuthError saying
    why it is not one. ``can_verify``: the reader holds the comm id's key ``mac_key``."""
    raw = blob.encode() if isinstance(blob, str) else bytes(blob)

    def bad(why: str) -> StoreAuthError:
        return _malformed(where, peer, why)
    if len(raw) > MAX_BYTES:
        raise bad(f"{len(raw)} bytes, more than {MAX_BYTES}")
    rest = raw[len(PREFIX):]
    if rest.startswith(b"plain "):
        body, sealed = rest[len(b"plain "):], False
    elif rest.startswith(b"sealed "):
        if not can_verify:
            raise bad("sealed under a comm id this rank has not read")
        try:
            body = store_auth.open(mac_key, name, rest[len(b"sealed "):], peer)
        except StoreAuthError:
            raise bad("its MAC does not verify under this run's comm id") from None
        sealed = True
    else:
        raise bad("neither plain nor sealed")
    return decode_body(body, sealed, where, peer)


def decode_body(body: bytes, sealed: bool, where: str, peer: str) -> Refusal:
    """The refusal in the fields ``body`` (``sealed``: its MAC was checked), or a StoreAuthError."""
    m = _BODY.fullmatch(body) if len(body) <= MAX_BYTES else None
    if m is None:
        raise _malformed(where, peer, "unknown reason code or fields" if body.startswith(b"v=1 ")
                         else "unknown format" if len(body) <= MAX_BYTES else f"more than {MAX_BYTES} bytes")
    code = m.group(1).decode()
    if (code in SEALED_CODES) != sealed:
        raise _malformed(where, peer, f"a {code} refusal must {'' if code in SEALED_CODES else 'not '}carry the "
                         "job key's MAC")
    seen = None if m.group(6) == b"-" else int(m.group(6))
    return Refusal(code, int(m.group(2)), m.group(3).decode(), m.group(4).decode(), int(m.group(5)), seen, sealed)


def _malformed(where: str, peer: str, why: str) -> StoreAuthError:
    return StoreAuthError(f"[rendezvous] the value under {where!r} in the store is a malformed refusal record "
                          f"({why}), peer={peer}: no MCCL host of this version wrote it, and it was not used; "
                          "give this job a store (port, --rdzv-id) no other program writes, keep the store's "
                          "port off networks you do not trust, and run one MCCL version on every host",
                          peer_addr=peer)


def error_for(ref: Refusal, rank: int, size: int, label: str, our_key_id: str, peer: str) -> MCCLError:
    """The error a rank raises on reading ``ref``: the refusing rank's cause, as its peer sees it."""
    who = f"rank {ref.rank} (host {ref.host})"
    if ref.code == "world_size":
        return ConfigError(f"[rendezvous] {label}: world size mismatch: {who} was started with a world of {ref.mine} "
                           f"ranks and rank 0 with one of {ref.seen}; this rank {rank} with one of {size} "
                           f"(store peer={peer}); every rank must be started with the same world size (WORLD_SIZE, "
                           "torchrun's --nnodes x --nproc-per-node): fix the launch on the hosts that differ and "
                           "restart every rank", peer_addr=peer, peer_rank=ref.rank)
    if ref.code == "daemon_link":
        return AuthError(f"[daemon-client] {label}: {who} could not join: its mccld failed to link with the mccld "
                         f"of another host of this job (store peer={peer}); likely cause: the hosts' mccld hold "
                         "different fleet keys or MCCL_FLEET, or run different MCCL versions (that rank's error "
                         "names which); give every host's mccld the same fleet key (mccld keygen, "
                         "/etc/mccl/fleet.key or MCCL_KEY_FILE) and version, restart them, then every rank",
                         peer_addr=peer, peer_rank=ref.rank)
    if ref.code == "version":
        return ProtocolError(f"[rendezvous] {label}: version skew: {who} speaks rendezvous version {ref.mine}, rank 0 "
                             f"wrote version {ref.seen} (store peer={peer}); install the same MCCL version on every "
                             "host and restart every rank", peer_addr=peer, peer_rank=ref.rank)
    if ref.code == "no_key":
        return ConfigError(f"[rendezvous] {label}: {who} refused to join: it could not load a job key (its own "
                           f"error says why: no key file, an unreadable one, or one others can write), store "
                           f"peer={peer}; give every host the same key (MCCL_JOB_KEY_FILE or the fleet key; ours "
                           f"has key id {our_key_id}) and restart every rank. This record carries no MAC (its "
                           "writer has no key of this job), so anyone who can reach the store could have written "
                           "it", peer_addr=peer, peer_rank=ref.rank)
    if ref.key_id == our_key_id:
        likely = (f"it says it holds our key (key id {our_key_id}), so it reads this store differently: another "
                  "MCCL_WIRE_SECURITY or MCCL version on that host, or someone without the key wrote the comm id")
    elif ref.key_id == "none":
        likely = "it runs without a key (MCCL_WIRE_SECURITY=off on that host); set the same setting everywhere"
    else:
        likely = (f"that host holds a different job key (its key id {ref.key_id}, ours {our_key_id}); give every "
                  "host the same key (MCCL_JOB_KEY_FILE or the fleet key)")
    return StoreAuthError(f"[rendezvous] {label}: {who} refused to join: the comm id rank 0 wrote did not verify "
                          f"under its key, store peer={peer}; likely cause: {likely}, and restart every rank. This "
                          "record carries no MAC (its writer has no key of this job), so anyone who can reach the "
                          "store could have written it", peer_addr=peer, peer_rank=ref.rank)


__all__ = ["CODES", "MAX_BYTES", "PREFIX", "Refusal", "decode", "decode_body", "encode", "encode_body", "error_for",
           "is_refusal", "this_host"]
