"""The attach protocol between a training process and its local daemon (ZeroMQ).

Every message is one JSON frame carrying the protocol version ``v``, a ``type`` and a
request id ``req``. The daemon answers every request exactly once with
``{"type": "reply", "req": ..., "ok": true, ...}`` or ``{"ok": false, "error": {...}}``;
a collective's reply *is* its completion, pushed when it finishes (no polling).

Request types and their fields:
  hello    token, pid                    -> host_id, link_addr, daemon_version
  join     job, rank, size, hosts, timeout_s, opts [, compression, compression_min_bytes,
           compression_feedback]         -> (when the job's host communicator is built)
                                            (``compression``: the job's MCCL_COMPRESSION, which
                                            every rank of the job must send alike)
  register job, rank, segment, nbytes [, buffer]
                                         -> ok; the daemon maps the segment (``buffer``: one the
                                            rank's tensors live in, kept beside its data segment
                                            until released; all-reduces on it are not copied)
  release  job, rank, segment            -> ok; the daemon unmaps that buffer
  op       job, rank, seq, op, args      -> (when the collective finished)
           op "send": args dst, tag, nbytes, segment   -> when the daemon holds or sent the data
           op "recv": args src (-1: any), tag, nbytes, post -> src, when a send matched
           op "take": args post, segment  -> when the matched message is in the segment
           (p2p ops carry seq 0: they are not part of the job's collective order)
  status                                 -> the daemon's status snapshot
  overlap  job, rank, ratio              -> ok (compute/communication overlap, for the exporter)
  balance  job, rank, speed, share       -> ok (a rank's samples/s and batch share, SpeedBalancer)
  leave    job, rank [, abort]           -> ok; the daemon frees the rank's segments
                                            (``abort``: a reason; fails the job for every rank)
  probe    addr                          -> link to the daemon at addr (dial + authenticate)
Tensor data never travels here: ``args`` name byte ranges of registered segments.

Each request type is a frozen dataclass below whose fields declare their wire type and
bounds (and OP_ARGS each op's exact arguments). ``build_request`` makes one from a parsed
frame, once, on arrival: a bad request gets a ProtocolError naming its field, and the
handlers and the job code only ever see well-typed, in-range objects. What depends on the
daemon's state (ranks of the job's world, bytes of the registered segment) is checked
against it with ``Op.check_world`` and ``Op.span``.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from . import PROTO_VERSION, errors
from .errors import MCCLError, ProtocolError
from .wire import AVG, DTYPE_SIZE, MAX_TAG, OP_NAMES, SUM

SOCKET_NAME = "mccld.sock"
TOKEN_NAME = "token"
# Where a client hands mccld the descriptors of its segments (fd_handover.py): ZeroMQ cannot carry them.
HANDOVER_NAME = "mccld.fds"

MAX_MESSAGE_BYTES = 1 << 20
MAX_RANKS = 1 << 20
MAX_HOSTS = 4096
_MAX_BYTES = 1 << 48                  # any byte count or offset: far past any real segment
_MAX_ID = (1 << 63) - 1               # sequence numbers, request and post ids
# Buffers a rank may hold registered at once: each costs the daemon a mapping and an fd.
MAX_BUFFERS_PER_RANK = 64

# A job's set-up (ranks publishing their daemons, joining, the hosts' data sockets) waits at
# least this long, whatever the collective timeout: ranks and hosts reach each step seconds
# apart on a loaded machine, and a 2 s op timeout must not fail the set-up.
SETUP_TIMEOUT_FLOOR_S = 5.0
# MCCL_COMPRESSION's values (mccl_common/settings.py; the engine's compress/codec.h).
CODECS = ("off", "bf16", "fp16", "int8")


def setup_timeout(timeout_s: float) -> float:
    """How long a job's set-up may take, given its collective timeout."""
    return max(timeout_s, SETUP_TIMEOUT_FLOOR_S)


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


_RANK = Field(int, 0, MAX_RANKS - 1)
_BYTES = Field(int, 0, _MAX_BYTES)
_SEGMENT = Field(str, max_len=64, required=False)
JOB_RE = re.compile(r"^[0-9a-f]{1,12}$")
# mccl-<job>-<rank>-<pid>-<gen>; the pid (group 1) tells whose it is (shm.py)
SEGMENT_RE = re.compile(r"^mccl-[0-9a-f]{1,12}-\d{1,6}-(\d{1,9})-\d{1,6}$")


def wire(kind: type | tuple[type, ...], lo: float | None = None, hi: float | None = None, *,
         max_len: int = 0, items: Field | None = None, default: Any = MISSING) -> Any:
    """A request field and its wire check; with ``default`` the field may be absent."""
    check = Field(kind, lo, hi, max_len, items, required=default is MISSING)
    return field(default=default, metadata={"wire": check})


def _job() -> Any:
    return wire(str, max_len=12)


def _rank() -> Any:
    return wire(int, 0, MAX_RANKS - 1)


def _job_id(where: str, job: str) -> None:
    if not JOB_RE.match(job):
        raise ProtocolError(f"[daemon] {where}: field 'job'={_short(job)} must be 1-12 lowercase hex digits")


def _segment_name(where: str, name: str) -> None:
    if not SEGMENT_RE.match(name):
        raise ProtocolError(f"[daemon] {where}: field 'segment'={_short(name)} is not a segment "
                            "name (mccl-<job>-<rank>-<pid>-<gen>)")


@dataclass(frozen=True)
class Compression:
    """A job's compressed all-reduce (MCCL_COMPRESSION, _MIN_BYTES, _ERROR_FEEDBACK; docs/compression.md),
    as each rank's join carries it and the store shows it to the other ranks."""
    codec: str = "off"
    min_bytes: int = 64 << 10
    feedback: bool = True

    def __str__(self) -> str:
        if self.codec == "off":
            return "MCCL_COMPRESSION=off"
        return (f"MCCL_COMPRESSION={self.codec} MCCL_COMPRESSION_MIN_BYTES={self.min_bytes} "
                f"MCCL_COMPRESSION_ERROR_FEEDBACK={int(self.feedback)}")

    def join_fields(self) -> dict[str, Any]:
        return {"compression": self.codec, "compression_min_bytes": self.min_bytes,
                "compression_feedback": self.feedback}

    def applies(self, dtype: int, redop: int, nbytes: int, codec_takes: Any) -> bool:
        """Whether the engine runs an all-reduce of ``nbytes`` compressed (its
        Communicator::compression rule); ``codec_takes(codec, dtype)``: the engine's
        ``_core.compress_applies`` (this module imports nothing of the engine)."""
        return (self.codec != "off" and redop in (SUM, AVG)
                and nbytes >= self.min_bytes and bool(codec_takes(self.codec, dtype)))


NO_COMPRESSION = Compression()


@dataclass(frozen=True)
class Request:
    """What every request carries; ``type`` names the subclass on the wire."""
    type: ClassVar[str] = ""
    req: int


@dataclass(frozen=True)
class Hello(Request):
    type: ClassVar[str] = "hello"
    token: str = wire(str, max_len=256)
    pid: int = wire(int, 1, (1 << 31) - 1)


@dataclass(frozen=True)
class Host:
    """One host of a job's placement, as every rank's join lists it."""
    host_id: str = wire(str, max_len=255)
    link_addr: str = wire(str, max_len=300)
    ranks: tuple[int, ...] = wire(list, max_len=MAX_RANKS, items=_RANK)
    switch: str = wire(str, max_len=255, default="")  # the daemon's switch (mccld/net/topology.py); "": unknown

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))


@dataclass(frozen=True)
class Join(Request):
    type: ClassVar[str] = "join"
    job: str = _job()
    rank: int = _rank()
    size: int = wire(int, 1, MAX_RANKS)
    hosts: tuple[Host, ...] = wire(list, max_len=MAX_HOSTS, items=Field(dict))
    timeout_s: float = wire((int, float), 1e-3, 1e7)
    opts: dict = wire(dict)
    # The job's compressed all-reduce (MCCL_COMPRESSION*, docs/compression.md): the engine among
    # the job's daemons is built with it. Absent (an older client): off.
    compression: str = wire(str, max_len=8, default="off")
    compression_min_bytes: int = wire(int, 0, _MAX_BYTES, default=64 << 10)
    compression_feedback: bool = wire(bool, default=True)

    def __post_init__(self) -> None:
        _job_id("join", self.job)
        if self.compression not in CODECS:
            raise ProtocolError(f"[daemon] join: field 'compression'={_short(self.compression)} is not one of "
                                f"{', '.join(CODECS)}; the client and mccld releases differ, or the request "
                                "was forged")
        object.__setattr__(self, "hosts", tuple(_build(Host, f"join: hosts[{i}]", h, exact=False)
                                                for i, h in enumerate(self.hosts)))

    @property
    def compression_settings(self) -> Compression:
        return Compression(self.compression, self.compression_min_bytes, self.compression_feedback)


@dataclass(frozen=True)
class Register(Request):
    type: ClassVar[str] = "register"
    job: str = _job()
    rank: int = _rank()
    segment: str = wire(str, max_len=64)
    nbytes: int = wire(int, 1, _MAX_BYTES)
    buffer: bool = wire(bool, default=False)

    def __post_init__(self) -> None:
        _job_id("register", self.job)
        _segment_name("register", self.segment)


@dataclass(frozen=True)
class Release(Request):
    """A registered buffer the rank no longer uses (its tensors are gone)."""
    type: ClassVar[str] = "release"
    job: str = _job()
    rank: int = _rank()
    segment: str = wire(str, max_len=64)

    def __post_init__(self) -> None:
        _job_id("release", self.job)
        _segment_name("release", self.segment)


@dataclass(frozen=True)
class Op(Request):
    """One collective or p2p step; ``args`` are exactly the op's OP_ARGS (plus ``segment``)."""
    type: ClassVar[str] = "op"
    job: str = _job()
    rank: int = _rank()
    seq: int = wire(int, 0, _MAX_ID)
    op: str = wire(str, max_len=32)
    args: Mapping[str, Any] = wire(dict)

    def __post_init__(self) -> None:
        _job_id("op", self.job)
        if self.op not in OP_ARGS:
            raise ProtocolError(f"[daemon] op: unknown operation {_short(self.op)}; the client is newer "
                                "than this mccld: upgrade mccld")
        args = dict(self.args)
        _check_fields(f"op {self.op}", args, {**OP_ARGS[self.op], "segment": _SEGMENT}, exact=True)
        object.__setattr__(self, "args", MappingProxyType(args))

    def check_world(self, size: int) -> None:
        """The job-dependent part: ranks and per-rank lists fit its world of ``size``."""
        for name in _RANK_ARGS:
            if name in self.args and not (-1 if name == "src" else 0) <= self.args[name] < size:
                raise ProtocolError(f"[daemon] op {self.op}: field {name!r}={self.args[name]} is not a rank of "
                                    f"the job's world of {size}")
        for name in ("send_sizes", "recv_sizes"):
            if name in self.args and len(self.args[name]) != size:
                raise ProtocolError(f"[daemon] op {self.op}: field {name!r} lists {len(self.args[name])} sizes, "
                                    f"the job's world has {size} ranks")

    def span(self, size: int) -> int:
        """Bytes of the rank's segment the collective touches, in a world of ``size`` (after
        ``check_world``); 0 for ops that touch none here (p2p checks its own ranges)."""
        a = self.args
        es = DTYPE_SIZE[a["dtype"]] if "dtype" in a else 1
        if self.op in ("allreduce", "reduce"):
            return a.get("offset", 0) + a["count"] * es
        if self.op == "broadcast":
            return a["nbytes"]
        if self.op in ("allgather", "gather"):
            return max(a["send_off"] + a["nbytes"], a["recv_off"] + size * a["nbytes"])
        if self.op == "reduce_scatter":
            return max(a["send_off"] + size * a["count"] * es, a["recv_off"] + a["count"] * es)
        if self.op == "scatter":
            return max(a["send_off"] + size * a["nbytes"], a["recv_off"] + a["nbytes"])
        if self.op == "alltoallv":
            return max(a["send_off"] + sum(a["send_sizes"]), a["recv_off"] + sum(a["recv_sizes"]))
        return 0


@dataclass(frozen=True)
class Status(Request):
    type: ClassVar[str] = "status"


@dataclass(frozen=True)
class Overlap(Request):
    type: ClassVar[str] = "overlap"
    job: str = _job()
    rank: int = _rank()
    ratio: float = wire((int, float), 0.0, 1.0)


@dataclass(frozen=True)
class Balance(Request):
    """A rank's measured speed and its share of the global batch (libmccl.training.SpeedBalancer)."""
    type: ClassVar[str] = "balance"
    job: str = _job()
    rank: int = _rank()
    speed: float = wire((int, float), 0.0, 1e12)      # samples/s; 0 = not measured yet
    share: int = wire(int, 0, 1 << 40)                 # samples of the global batch per step


@dataclass(frozen=True)
class Leave(Request):
    type: ClassVar[str] = "leave"
    job: str = _job()
    rank: int = _rank()
    abort: str | None = wire(str, max_len=4096, default=None)   # a reason: fails the job for every rank


@dataclass(frozen=True)
class Probe(Request):
    type: ClassVar[str] = "probe"
    addr: str = wire(str, max_len=300)

    def __post_init__(self) -> None:
        check_addr(self.addr)


REQUESTS: dict[str, type[Request]] = {cls.type: cls for cls in (Hello, Join, Register, Release, Op, Status,
                                                                  Overlap, Balance, Leave, Probe)}

# An op's arguments, exactly: the job's thread calls its algorithm with them, so a key
# unknown to this daemon (or a missing one) is refused here rather than failing there.
_COUNT, _DTYPE, _REDOP = _BYTES, Field(int, 0, len(DTYPE_SIZE) - 1), Field(int, 0, len(OP_NAMES) - 1)
_OFFS = {"send_off": _BYTES, "recv_off": _BYTES}
_KEY = Field(int, 0, (1 << 64) - 1, required=False)
OP_ARGS: dict[str, dict[str, Field]] = {
    # pipelined: through the segment's tickets, the op starting at `base` in their counts
    # key: the client's address of the tensor, which keys a compressed op's error feedback
    "allreduce": {"count": _COUNT, "dtype": _DTYPE, "op": _REDOP, "offset": _BYTES,
                  "pipelined": Field(bool, required=False), "base": Field(int, 0, _MAX_ID, required=False),
                  "key": _KEY},
    "broadcast": {"nbytes": _BYTES, "root": _RANK},
    "allgather": {**_OFFS, "nbytes": _BYTES},
    "reduce_scatter": {**_OFFS, "count": _COUNT, "dtype": _DTYPE, "op": _REDOP, "key": _KEY},
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


def _check_fields(where: str, obj: dict[str, Any], spec: dict[str, Field], exact: bool) -> None:
    for name, f in spec.items():
        if name in obj:
            _check(where, name, obj[name], f)
        elif f.required:
            raise ProtocolError(f"[daemon] {where}: field {name!r} is missing; the client speaks another "
                                "protocol version: upgrade libmccl and mccld to the same release")
    if exact:
        unknown = sorted(set(obj) - set(spec))
        if unknown:
            raise ProtocolError(f"[daemon] {where}: unknown argument {_short(unknown[0])}; the client is newer "
                                f"than this mccld (it knows {sorted(spec)}): upgrade mccld")


def parse_request(frame: bytes) -> dict[str, Any]:
    """A request's envelope (JSON object, version, type, request id): enough to address the
    reply. ``build_request`` then validates the rest."""
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
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise ProtocolError(f"[daemon] unknown control message type {_short(kind)}")
    req = msg.get("req")
    if not isinstance(req, int) or isinstance(req, bool) or not 0 <= req <= _MAX_ID:
        raise ProtocolError(f"[daemon] {kind} message without an integer request id")
    return msg


def _build(cls: type, where: str, obj: dict[str, Any], exact: bool) -> Any:
    """``cls`` from ``obj``, each field checked against its ``wire`` declaration."""
    spec = {f.name: f.metadata["wire"] for f in fields(cls) if "wire" in f.metadata}
    _check_fields(where, obj, spec, exact)
    values = {name: obj[name] for name in spec if name in obj}
    if "req" in obj and issubclass(cls, Request):
        values["req"] = obj["req"]
    return cls(**values)


def build_request(msg: dict[str, Any]) -> Request:
    """The typed request of a frame ``parse_request`` accepted; ProtocolError names the first
    field that is wrong. Fields this daemon does not know are ignored (a newer client's
    extras), except in an op's ``args``, which the job's algorithm is called with."""
    kind = msg["type"]
    return _build(REQUESTS[kind], kind, msg, exact=False)


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
