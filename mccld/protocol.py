"""The attach protocol between a training process and its local daemon (ZeroMQ).

Every message is one JSON frame carrying the protocol version ``v``, a ``type`` and a
request id ``req``. The daemon answers every request exactly once with
``{"type": "reply", "req": ..., "ok": true, ...}`` or ``{"ok": false, "error": {...}}``;
a collective's reply *is* its completion, pushed when it finishes (no polling).

Request types and their fields:
  hello    token, pid                    -> host_id, link_addr, daemon_version
  join     job, rank, size, hosts, timeout_s, opts
                                         -> (when the job's host communicator is built)
  register job, rank, segment, nbytes    -> ok; the daemon maps the segment
  op       job, rank, seq, op, args      -> (when the collective finished)
           op "send": args dst, tag, nbytes, segment   -> when the daemon holds or sent the data
           op "recv": args src (-1: any), tag, nbytes, post -> src, when a send matched
           op "take": args post, segment  -> when the matched message is in the segment
           (p2p ops carry seq 0: they are not part of the job's collective order)
  status                                 -> the daemon's status snapshot
  overlap  job, rank, ratio              -> ok (compute/communication overlap, for the exporter)
  leave    job, rank [, abort]           -> ok; the daemon frees the rank's segments
                                            (``abort``: a reason; fails the job for every rank)
  probe    addr                          -> link to the daemon at addr (dial + authenticate)
Tensor data never travels here: ``args`` name byte ranges of registered segments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from libmccl import errors
from libmccl.errors import MCCLError, ProtocolError

from . import PROTO_VERSION

SOCKET_NAME = "mccld.sock"
TOKEN_NAME = "token"

# Required fields and their types, per request type.
SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"token": str, "pid": int},
    "join": {"job": str, "rank": int, "size": int, "hosts": list, "timeout_s": (int, float),
             "opts": dict},
    "register": {"job": str, "rank": int, "segment": str, "nbytes": int},
    "op": {"job": str, "rank": int, "seq": int, "op": str, "args": dict},
    "status": {},
    "overlap": {"job": str, "rank": int, "ratio": (int, float)},
    "leave": {"job": str, "rank": int},
    "probe": {"addr": str},
}

MAX_MESSAGE_BYTES = 1 << 20


def endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / SOCKET_NAME}"


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTO_VERSION, **msg}, separators=(",", ":")).encode()


def decode_request(frame: bytes) -> dict[str, Any]:
    """Parse and validate one request; raises ProtocolError naming what is wrong."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"[daemon] control message of {len(frame)} bytes exceeds "
                            f"{MAX_MESSAGE_BYTES}; the client is not speaking the MCCL attach protocol")
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("[daemon] control message is not JSON; the client is not speaking "
                            "the MCCL attach protocol") from None
    if not isinstance(msg, dict):
        raise ProtocolError("[daemon] control message is not a JSON object")
    if msg.get("v") != PROTO_VERSION:
        raise ProtocolError(f"[daemon] attach protocol version {msg.get('v')!r}, daemon speaks "
                            f"{PROTO_VERSION}; upgrade libmccl and mccld to the same release")
    kind = msg.get("type")
    if kind not in SCHEMA:
        raise ProtocolError(f"[daemon] unknown control message type {kind!r}")
    if not isinstance(msg.get("req"), int):
        raise ProtocolError(f"[daemon] {kind} message without an integer request id")
    for name, typ in SCHEMA[kind].items():
        value = msg.get(name)
        if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
            raise ProtocolError(f"[daemon] {kind} message: field {name!r} missing or not "
                                f"{getattr(typ, '__name__', typ)}")
    return msg


def decode_reply(frame: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("[daemon-client] reply from mccld is not JSON; is another program "
                            "listening on the attach socket?") from None
    if not isinstance(msg, dict) or msg.get("v") != PROTO_VERSION or not isinstance(msg.get("req"), int):
        raise ProtocolError(f"[daemon-client] reply from mccld speaks another protocol version "
                            f"({msg.get('v') if isinstance(msg, dict) else '?'}, we speak "
                            f"{PROTO_VERSION}); upgrade libmccl and mccld to the same release")
    return msg


def error_payload(exc: BaseException) -> dict[str, Any]:
    """Serialise an exception for the wire: its class name, message and peer."""
    if isinstance(exc, MCCLError):
        return {"kind": type(exc).__name__, "message": str(exc),
                "peer_rank": exc.peer_rank if exc.peer_rank is not None else -1,
                "peer_addr": exc.peer_addr or ""}
    return {"kind": "MCCLError", "message": f"[daemon] internal error: {type(exc).__name__}: {exc}",
            "peer_rank": -1, "peer_addr": ""}


def error_from_payload(payload: dict[str, Any]) -> MCCLError:
    cls = getattr(errors, str(payload.get("kind")), None)
    if not (isinstance(cls, type) and issubclass(cls, MCCLError)):
        cls = MCCLError
    return cls(str(payload.get("message", "")), peer_rank=int(payload.get("peer_rank", -1)),
               peer_addr=str(payload.get("peer_addr", "")))
