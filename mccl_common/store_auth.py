"""MACs on the values a job reads from a store (rendezvous state, addresses, comm ids,
MASTER_ADDR/PORT).

A TCPStore has no access control: anyone who reaches its port can read, write and replace
every key. So the store itself is trusted for nothing; each value a job acts on is written as
``PREFIX || base64(tag || value)`` with tag = HMAC-SHA256 under a key derived from the job key
for one *scope* (a run id, a communicator id), over the store key's *name* and the value. A
value therefore cannot be forged without the job key, nor moved to another key name, nor
carried from one scope (another run, another communicator) into this one. The value is
checked before anything parses it: torch unpickles the rendezvous state it is given.

Under ``MCCL_WIRE_SECURITY=off`` there is no key: values are written with PLAIN instead and
read back unchecked (a warning says once per process what that exposes); a sealed value is
still accepted there, so a reader that trusts the network interoperates with writers that
do not. A reader holding a key refuses a PLAIN value.

Counters (``store.add``) and key presence (``store.wait``/``check``) cannot carry a MAC: a
stranger can still disturb them, which ends a rendezvous early (denial of service) but never
makes a job act on a value of the stranger's choosing.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from typing import Callable

from .errors import StoreAuthError
from .jobkey import derive, require_job_key

log = logging.getLogger(__name__)

PREFIX = b"mccl-mac1:"
PLAIN = b"mccl-plain1:"
TAG_BYTES = 32
_warned_off = False


def scoped_key(job_key: bytes | None, *scope: str | int) -> bytes | None:
    """The key that MACs one scope's store values; None when the job runs without a key."""
    return None if job_key is None else derive(job_key, "store", *scope)


def job_store_key(wire_security: str, *scope: str | int) -> bytes | None:
    """``scoped_key`` for this process's job key under ``MCCL_WIRE_SECURITY=wire_security``:
    raises ConfigError when a key is needed and none is found."""
    global _warned_off
    key = scoped_key(require_job_key(wire_security), *scope)
    if key is None and not _warned_off:
        _warned_off = True
        log.warning("[rendezvous] MCCL_WIRE_SECURITY=off: values in the rendezvous and c10d stores carry no "
                    "MAC; anyone who reaches a store's port can redirect ranks to other addresses or, through "
                    "torch's rendezvous state, run code in torchrun. Use it only on a network you trust")
    return key


def _tag(key: bytes, name: str, value: bytes) -> bytes:
    return derive(key, "value", name, value)


def seal(key: bytes | None, name: str, value: bytes) -> bytes:
    """What to store under ``name`` for ``value``."""
    if key is None:
        return PLAIN + value
    return PREFIX + base64.b64encode(_tag(key, name, value) + value)


def open(key: bytes | None, name: str, blob: bytes | str, peer: str, component: str = "rendezvous",
         error: Callable[..., Exception] = StoreAuthError) -> bytes:
    """The value sealed under ``name``, or ``error`` (a StoreAuthError unless told) naming the
    key and the store's ``peer``; nothing of the expected tag or the key is in the message."""
    raw = blob.encode() if isinstance(blob, str) else bytes(blob)
    if raw.startswith(PLAIN):
        if key is None:
            return raw[len(PLAIN):]
        raise _failed(error, component, name, peer, "carries no MAC (its writer runs with MCCL_WIRE_SECURITY=off)",
                      "set the same MCCL_WIRE_SECURITY on every host")
    if not raw.startswith(PREFIX):
        raise _failed(error, component, name, peer, "is not a sealed MCCL value",
                      "give this job a store (port, --rdzv-id) no other program writes")
    try:
        body = base64.b64decode(raw[len(PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        body = b""
    if len(body) < TAG_BYTES:
        raise _failed(error, component, name, peer, "is malformed (too short for its MAC)",
                      "give this job a store (port, --rdzv-id) no other program writes")
    tag, value = body[:TAG_BYTES], body[TAG_BYTES:]
    if key is None:
        return value
    if not hmac.compare_digest(tag, _tag(key, name, value)):
        raise _failed(error, component, name, peer, "failed its MAC",
                      "check that every host holds the same job key (MCCL_JOB_KEY_FILE or the fleet key) "
                      "and keep the store's port off networks you do not trust")
    return value


def unverified_value(blob: bytes | str) -> bytes | None:
    """The value part of a sealed ``blob`` WITHOUT checking its MAC, or None when it is not one:
    only for naming, in an error, what a value we could not verify claims (rendezvous.py
    shows the key id a comm id claims). Never act on it."""
    raw = blob.encode() if isinstance(blob, str) else bytes(blob)
    if not raw.startswith(PREFIX) or len(raw) > 4096:
        return None
    try:
        body = base64.b64decode(raw[len(PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        return None
    return body[TAG_BYTES:] if len(body) > TAG_BYTES else None


def _failed(error: Callable[..., Exception], component: str, name: str, peer: str, what: str,
            todo: str) -> Exception:
    msg = (f"[{component}] the value under {name!r} in the store {what}, peer={peer}: it was written by "
           f"someone without the job's key, or copied there from another key or run, and was not used; {todo}")
    try:
        return error(msg, peer_addr=peer)
    except TypeError:   # an error class that takes the message alone (torch's rendezvous errors)
        return error(msg)


__all__ = ["PLAIN", "PREFIX", "TAG_BYTES", "job_store_key", "open", "scoped_key", "seal", "unverified_value"]
