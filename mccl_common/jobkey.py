"""The job key: the one secret every rank of a job holds.

Everything a job acts on that crossed the network is checked against it: the engine's
links open with a challenge-response on a key derived from it (and their frames are
encrypted under keys derived from that handshake, libmccl/csrc/transport/handshake.h),
and every value the job reads from a rendezvous store carries a MAC under another key
derived from it (mccl_common/store_auth.py). Where it comes from, first found wins:

1. ``MCCL_JOB_KEY_FILE`` (``mcclctl run`` writes a per-run key there for its workers);
2. the fleet key: ``MCCL_FLEET_KEY``, ``MCCL_KEY_FILE``, /etc/mccl/fleet.key, ~/.config/mccl/fleet.key.

With none, a job refuses to start unless ``MCCL_WIRE_SECURITY=off`` says the network is
trusted. Derived keys are HMAC-SHA256 (Python's hashlib, i.e. OpenSSL) over length-prefixed
labels, so no two uses share a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
from typing import Mapping

from .daemon_settings import DEFAULT_KEY_FILES, key_material, read_key_file
from .errors import ConfigError

log = logging.getLogger(__name__)

KEY_BYTES = 32
_LEN = struct.Struct("!I")
_warned_off = False


def derive(key: bytes, label: str, *parts: str | bytes | int) -> bytes:
    """A 32-byte key for one purpose: HMAC-SHA256(key, label || parts), each length-prefixed
    so that no two different (label, parts) give the same input."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in (label, *parts):
        b = p.encode() if isinstance(p, str) else (str(p).encode() if isinstance(p, int) else p)
        h.update(_LEN.pack(len(b)) + b)
    return h.digest()


def find_job_key(env: Mapping[str, str] | None = None) -> bytes | None:
    """The job key from the environment (see the module doc), or None when there is none."""
    env = os.environ if env is None else env
    explicit = env.get("MCCL_JOB_KEY_FILE", "")
    if explicit:
        return read_key_file(explicit, (), "MCCL_JOB_KEY_FILE", _daemon_owner(explicit, env))
    if env.get("MCCL_FLEET_KEY"):
        return key_material(env["MCCL_FLEET_KEY"].encode(), "MCCL_FLEET_KEY",
                            "mccld keygen /etc/mccl/fleet.key")
    return read_key_file(env.get("MCCL_KEY_FILE", ""), DEFAULT_KEY_FILES, "MCCL_KEY_FILE")


def _daemon_owner(key_file: str, env: Mapping[str, str]) -> tuple[int, ...]:
    """mccld writes a launched job's run key into a folder of the job's own inside mccld's
    runtime dir (MCCL_RUNTIME_DIR, which the launcher sets): that dir's owner, the daemon that
    started this job and wrote the key, is trusted with the folder above the key."""
    runtime = env.get("MCCL_RUNTIME_DIR", "")
    if not runtime:
        return ()
    try:
        base = os.path.realpath(runtime)
        if os.path.commonpath([base, os.path.realpath(key_file)]) != base:
            return ()
        return (os.stat(base).st_uid,)
    except (OSError, ValueError):
        return ()


def engine_secret(wire_security: str, env: Mapping[str, str] | None = None) -> bytes | None:
    """What an in-process engine's links prove and derive their frame keys from
    (``_core.Communicator(..., secret=)``): a key derived from the job key for the engine
    alone, so no other use of the job key (store MACs) shares it; None under ``off``."""
    key = require_job_key(wire_security, env)
    return None if key is None else derive(key, "engine")


def require_job_key(wire_security: str, env: Mapping[str, str] | None = None) -> bytes | None:
    """The job key a communicator needs under ``MCCL_WIRE_SECURITY=wire_security``: None only
    when it is ``off`` (warned once per process); else the key, or a ConfigError saying how
    to give one."""
    global _warned_off
    if wire_security == "off":
        if not _warned_off:
            _warned_off = True
            log.warning("[security] MCCL_WIRE_SECURITY=off: links are opened without a key and frames are "
                        "neither encrypted nor authenticated; anyone on the network can read and alter "
                        "this job's tensors. Use it only on a network you trust")
        return None
    key = find_job_key(env)
    if key is None:
        raise ConfigError("[security] no job key: every rank of an mccl job must hold the same secret. Create "
                          "one with `mccld keygen ~/.config/mccl/fleet.key` and copy it (mode 0600) to every "
                          "host of the job, or point MCCL_JOB_KEY_FILE at such a file; MCCL_WIRE_SECURITY=off "
                          "runs without one, on a network you trust")
    return key


def key_id(key: bytes | None) -> str:
    """A name for ``key`` that is safe to show and to publish: 16 hex digits of
    HMAC-SHA256(key, "key-id"). It tells two keys apart in an error ("its key id X, ours Y")
    and reveals nothing of the key: HMAC is a PRF, and a store already holds MACs of known
    values under keys derived from the same one, so it gives no guess a check it lacked.
    "none" for a job that runs without a key (MCCL_WIRE_SECURITY=off)."""
    return "none" if key is None else derive(key, "key-id").hex()[:16]
