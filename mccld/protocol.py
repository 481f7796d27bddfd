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

Each field's type and bounds, and each op's exact arguments, are declared below (SCHEMA,
OP_ARGS) and checked once on arrival (``check_request``): a bad request gets a
ProtocolError naming its field, and what reaches a handler is well-typed and in range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libmccl import errors
from libmccl.daemon_ops import DTYPE_SIZE, MAX_TAG
from libmccl.errors import MCCLError, ProtocolError

from . import PROTO_VERSION

SOCKET_NAME = "mccld.sock"
TOKEN_NAME = "token"

MAX_MESSAGE_BYTES = 1 << 20
MAX_RANKS = 1 << 20
MAX_HOSTS = 4096
_MAX_BYTES = 1 << 48                  # any byte count or offset: far past any real segment
_MAX_ID = (1 << 63) - 1               # sequence numbers, request and post ids


@dataclass(frozen=True)
class Field:
    """One field's type and bounds: ints and floats within [lo, hi], strings and lists of at
    most ``max_len`` characters / items (each item checked by ``items``)."""
    kind: type | tuple[type, ...]
    lo: float | None = None
    hi: float | None = None
    max_len: int = 0
    items: "Field | None" = None
    required: bool = True


_JOB = Field(str, max_len=12)
_RANK = Field(int, 0, MAX_RANKS - 1)
_BYTES = Field(int, 0, _MAX_BYTES)
_SEGMENT = Field(str, max_len=64, required=False)

# Every request type's fields; fields not named here are ignored (a newer client's extras).
SCHEMA: dict[str, dict[str, Field]] = {
    "hello": {"token": Field(str, max_len=256), "pid": Field(int, 1, (1 << 31) - 1)},
    "join": {"job": _JOB, "rank": _RANK, "size": Field(int, 1, MAX_RANKS),
             "hosts": Field(list, max_len=MAX_HOSTS, items=Field(dict)),
             "timeout_s": Field((int, float), 1e-3, 1e7), "opts": Field(dict)},
    "register": {"job": _JOB, "rank": _RANK, "segment": Field(str, max_len=64), "nbytes": Field(int, 1, _MAX_BYTES)},
    "op": {"job": _JOB, "rank": _RANK, "seq": Field(int, 0, _MAX_ID), "op": Field(str, max_len=32),
           "args": Field(dict)},
    "status": {},
    "overlap": {"job": _JOB, "rank": _RANK, "ratio": Field((int, float), 0.0, 1.0)},
    "leave": {"job": _JOB, "rank": _RANK, "abort": Field(str, max_len=4096, required=False)},
    "probe": {"addr": Field(str, max_len=300)},
}

_HOST = {"host_id": Field(str, max_len=255), "link_addr": Field(str, max_len=300),
         "ranks": Field(list, max_len=MAX_RANKS, items=_RANK)}

# An op's arguments, exactly: the job's thread calls its algorithm with them, so a key
# unknown to this daemon (or a missing one) is refused here rather than failing there.
_COUNT, _DTYPE, _REDOP = _BYTES, Field(int, 0, len(DTYPE_SIZE) - 1), Field(int, 0, 7)
_OFFS = {"send_off": _BYTES, "recv_off": _BYTES}
OP_ARGS: dict[str, dict[str, Field]] = {
    # pipelined: through the segment's tickets, the op starting at `base` in their counts
    "allreduce": {"count": _COUNT, "dtype": _DTYPE, "op": _REDOP, "offset": _BYTES,
                  "pipelined": Field(bool, required=False), "base": Field(int, 0, _MAX_ID, required=False)},
    "broadcast": {"nbytes": _BYTES, "root": _RANK},
    "allgather": {**_OFFS, "nbytes": _BYTES},
    "reduce_scatter": {**_OFFS, "count": _COUNT, "dtype": _DTYPE, "op": _REDOP},
    "reduce": {"count": _COUNT, "dtype": _DTYPE, "op": _REDOP, "root": _RANK},
    "gather": {**_OFFS, "nbytes": _BYTES, "root": _RANK},
    "scatter": {**_OFFS, "nbytes": _BYTES, "root": _RANK},
    "barrier": {},
    "alltoallv": {**_OFFS, "send_sizes": Field(list, max_len=MAX_RANKS, items=_BYTES),
                  "recv_sizes": Field(list, max_len=MAX_RANKS, items=_BYTES)},
    "send": {"dst": _RANK, "tag": Field(int, 0, MAX_TAG), "nbytes": _BYTES},
    "recv": {"src": Field(int, -1, MAX_RANKS - 1), "tag": Field(int, 0, MAX_TAG), "nbytes": _BYTES,
             "post": Field(int, 0, _MAX_ID)},
    "take": {"post": Field(int, 0, _MAX_ID)},
}
_RANK_ARGS = ("root", "dst", "src")          # must name a rank of the job


def endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / SOCKET_NAME}"


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTO_VERSION, **msg}, separators=(",", ":")).encode()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(where: str, name: str, value: Any, f: Field) -> None:
    kinds = f.kind if isinstance(f.kind, tuple) else (f.kind,)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"[daemon] {where}: field {name!r} must be "
                            f"{' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    if f.lo is not None and not f.lo <= value <= f.hi:      # also refuses NaN
        raise ProtocolError(f"[daemon] {where}: field {name!r}={_short(value)} is outside [{f.lo}, {f.hi}]")
    if f.max_len and len(value) > f.max_len:
        raise ProtocolError(f"[daemon] {where}: field {name!r} is longer than {f.max_len}")
    if f.items is not None:
        for i, item in enumerate(value):
            _check(where, f"{name}[{i}]", item, f.items)


def _check_fields(where: str, obj: dict[str, Any], fields: dict[str, Field], exact: bool) -> None:
    for name, f in fields.items():
        if name in obj:
            _check(where, name, obj[name], f)
        elif f.required:
            raise ProtocolError(f"[daemon] {where}: field {name!r} is missing; the client speaks another "
                                "protocol version: upgrade libmccl and mccld to the same release")
    if exact:
        unknown = sorted(set(obj) - set(fields))
        if unknown:
            raise ProtocolError(f"[daemon] {where}: unknown argument {_short(unknown[0])}; the client is newer "
                                f"than this mccld (it knows {sorted(fields)}): upgrade mccld")


def parse_request(frame: bytes) -> dict[str, Any]:
    """A request's envelope (JSON object, version, type, request id): enough to address the
    reply. ``check_request`` then validates the rest."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"[daemon] control message of {len(frame)} bytes exceeds "
                            f"{MAX_MESSAGE_BYTES}; the client is not speaking the MCCL attach protocol")
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("[daemon] control message is not JSON (or nests too deep); the client is not "
                            "speaking the MCCL attach protocol") from None
    if not isinstance(msg, dict):
        raise ProtocolError("[daemon] control message is not a JSON object")
    if msg.get("v") != PROTO_VERSION:
        raise ProtocolError(f"[daemon] attach protocol version {_short(msg.get('v'))}, daemon speaks "
                            f"{PROTO_VERSION}; upgrade libmccl and mccld to the same release")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise ProtocolError(f"[daemon] unknown control message type {_short(kind)}")
    req = msg.get("req")
    if not isinstance(req, int) or isinstance(req, bool) or not 0 <= req <= _MAX_ID:
        raise ProtocolError(f"[daemon] {kind} message without an integer request id")
    return msg


def check_request(msg: dict[str, Any]) -> None:
    """Every field of a parsed request; ProtocolError names the first one that is wrong. What
    passes is well-typed and in range: handlers only check it against the daemon's state."""
    kind = msg["type"]
    _check_fields(kind, msg, SCHEMA[kind], exact=False)
    if kind == "join":
        for i, host in enumerate(msg["hosts"]):
            _check_fields(f"join: hosts[{i}]", host, _HOST, exact=False)
    elif kind == "op":
        if msg["op"] not in OP_ARGS:
            raise ProtocolError(f"[daemon] op: unknown operation {_short(msg['op'])}; the client is newer "
                                "than this mccld: upgrade mccld")
        _check_fields(f"op {msg['op']}", msg["args"], {**OP_ARGS[msg["op"]], "segment": _SEGMENT}, exact=True)
    elif kind == "probe":
        check_addr(msg["addr"])


def check_op_ranks(msg: dict[str, Any], size: int) -> None:
    """The job-dependent part of an op's validation: ranks and per-rank lists fit its world."""
    op, args = msg["op"], msg["args"]
    for name in _RANK_ARGS:
        if name in args and not (-1 if name == "src" else 0) <= args[name] < size:
            raise ProtocolError(f"[daemon] op {op}: field {name!r}={args[name]} is not a rank of the "
                                f"job's world of {size}")
    for name in ("send_sizes", "recv_sizes"):
        if name in args and len(args[name]) != size:
            raise ProtocolError(f"[daemon] op {op}: field {name!r} lists {len(args[name])} sizes, the "
                                f"job's world has {size} ranks")


def check_addr(addr: str) -> tuple[str, int]:
    """A probe's ``host:port``, split; ProtocolError unless the port is a TCP port."""
    host, sep, port = addr.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ProtocolError(f"[daemon] probe: field 'addr'={_short(addr)} is not host:port with a port "
                            "in 1-65535")
    return host, int(port)


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
