"""The link port (daemon-to-daemon TCP) and the data sockets dialled to it.

The fuzzer plays a peer daemon of the fleet (it holds the fleet key), with the code a
peer runs (``mccld.net.auth.initiate``), so its seeds are real: the handshake frames that
code sends, captured from ``auth.send_plain``, and the link messages a daemon sends
(``data_lease``, ``data_ack``, ``job_failed``).

link surface, stages:
  raw      bytes on a fresh connection
  hello    a mutated hello frame; if a challenge comes back, a valid auth for what the
           hello claimed, so mutated host ids, listen addresses and purposes get adopted
  session  after a valid control handshake, one mutated link message sealed with a
           valid AEAD tag (or its frame damaged): reaches the daemon's link handlers. A
           notification: nothing answers it, the link must just live or close.
data surface, stages:
  hello    as link/hello with a "data:<id>" purpose: the socket joins the daemon's pool
  engine   a two-host job with this fuzzer as the other host: the data socket is leased
           to it over the control link as a peer would, then the engine's 88-byte
           hello (transport/handshake.h) is sent mutated; when challenged, the fuzzer proves
           the job's engine secret (it holds the fleet key, as a peer does), and after an
           accepting verdict sends a mutated 72-byte frame header (frame.h); the engine's
           verdict or a close must come, and the job's join must be answered
"""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
import struct
import time
from typing import Any

import zmq
from hypothesis import strategies as st

from mccld.net import auth
from mccl_common import attach_protocol as protocol

from .mutate import byte_noise, encode, mutated_json, random_bytes
from .surfaces import ANSWER_TIMEOUT_S, Input, Surface, Verdict, connect, drain_until_closed, send_and_close
from .target import FLEET, FLEET_KEY, Helper, fake_host_id

_KEY = FLEET_KEY.encode()
_LEN = struct.Struct("!I")
_HELLO = struct.Struct("<IIQIIIIIQQI32s")    # handshake.cc encode_hello: 88 bytes
_REPLY = 44                                   # challenge or verdict: magic, status, reason length, 32 bytes
_MAGIC = 0x4C43434D
_LINK_VERSION = 3                             # handshake.cc kLinkVersion
_ENGINE_VERSION = 2                           # frame.h kProtocolVersion
_K = 1                                       # MCCL_SOCKETS_PER_PEER of the fuzzed daemon
_JOBS = itertools.count(1)


def _frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def _read_frame(sock: socket.socket, timeout_s: float = ANSWER_TIMEOUT_S) -> dict[str, Any] | None:
    sock.settimeout(timeout_s)
    try:
        return auth.recv_plain(sock, "daemon")
    except (OSError, ConnectionError, ValueError, Exception):  # noqa: BLE001 - closed or not a frame: no challenge
        return None


def _valid_auth(hello: Any, challenge: dict[str, Any]) -> bytes:
    """The auth frame a peer would send for what ``hello`` claimed (auth.initiate's MAC)."""
    purpose = str(hello.get("purpose", auth.CONTROL))
    mac = auth._mac(_KEY, "init", FLEET, purpose, str(hello.get("host_id")), str(hello.get("listen")),
                    str(challenge.get("host_id")), str(challenge.get("listen")), bytes.fromhex(hello["nonce"]),
                    bytes.fromhex(str(challenge.get("nonce"))))
    return _frame(json.dumps({"type": "auth", "mac": mac.hex()}).encode())


def _well_formed(frame: bytes) -> dict[str, Any] | None:
    """The hello a frame carries when its length prefix is right and its body an object."""
    if len(frame) < 4 or _LEN.unpack(frame[:4])[0] != len(frame) - 4:
        return None
    try:
        hello = json.loads(frame[4:])
    except (ValueError, RecursionError):
        return None
    return hello if isinstance(hello, dict) else None


def _handshake(sock: socket.socket, hello_frame: bytes) -> str:
    """Send a hello; answer a challenge with a valid auth when the hello was well-formed.
    A hello the daemon cannot have read whole gets no wait for a challenge: the caller's
    half-close is what tells the daemon nothing more comes."""
    sock.sendall(hello_frame)
    hello = _well_formed(hello_frame)
    if hello is None:
        return "sent"
    challenge = _read_frame(sock)
    if challenge is None or challenge.get("type") != "challenge":
        return "refused"
    try:
        sock.sendall(_valid_auth(hello, challenge))
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeError):
        return "challenged"
    return "authed"


class _Capture:
    """Every frame ``auth.send_plain`` sends while it is active."""

    def __enter__(self) -> list[dict[str, Any]]:
        self.sent: list[dict[str, Any]] = []
        self._real = auth.send_plain

        def recording(sock, msg):
            self.sent.append(json.loads(json.dumps(msg)))
            return self._real(sock, msg)
        auth.send_plain = recording
        return self.sent

    def __exit__(self, *exc) -> None:
        auth.send_plain = self._real


class PeerLink:
    """An authenticated control link from a fake peer host, as a peer daemon holds one."""

    def __init__(self, daemon, host_id: str, listen: str):
        self.host_id, self.listen = host_id, listen
        self.sock = connect(daemon.link_addr)
        _, _, self.session = auth.initiate(self.sock, _KEY, FLEET, host_id, listen, daemon.link_addr, auth.CONTROL)

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(self.session.seal(msg))

    def recv(self, timeout_s: float) -> dict[str, Any]:
        self.sock.settimeout(timeout_s)
        return self.session.open(self.sock)

    def close(self) -> None:
        self.sock.close()


class LinkSurface(Surface):
    name = "link"

    def __init__(self, daemon):
        super().__init__(daemon)
        self._peer: PeerLink | None = None
        self._n = 0

    def capture(self) -> None:
        with _Capture() as sent:
            link = PeerLink(self.daemon, fake_host_id(0), "127.0.0.9:29650")
            link.close()
        err = protocol.error_payload(auth.ProtocolError("[fuzz] a peer's job failed", peer_rank=0))
        self.seeds = {"hello": [sent[0]], "session": [
            {"type": "data_lease", "job": "00000001", "round": 0, "ids": [f"{fake_host_id(0)}.0.1"]},
            {"type": "data_ack", "job": "00000001", "round": 0, "missing": []},
            {"type": "job_failed", "job": "00000001", "error": err}]}

    def strategy(self) -> st.SearchStrategy[Input]:
        hello = mutated_json(self.seeds["hello"]).map(encode).map(_frame).flatmap(byte_noise)
        session = mutated_json(self.seeds["session"]).map(encode)
        return st.one_of(random_bytes.map(lambda b: Input(self.name, "raw", [b])),
                         hello.map(lambda b: Input(self.name, "hello", [b])),
                         hello.map(lambda b: Input(self.name, "hello", [b])),
                         st.tuples(session, st.sampled_from(["sealed"] * 4 + ["bad_mac", "bad_len"])).map(
                             lambda t: Input(self.name, "session", [t[0], t[1].encode()])))

    def begin_batch(self) -> None:
        self._n += 1

    def end_batch(self) -> int:
        if self._peer is not None:
            self._peer.close()
            self._peer = None
        return 0

    def send(self, inp: Input) -> Verdict:
        if inp.stage == "raw":
            return send_and_close(connect(self.daemon.link_addr), inp.frames[0])
        if inp.stage == "hello":
            sock = connect(self.daemon.link_addr)
            try:
                _handshake(sock, inp.frames[0])
            except OSError:
                sock.close()
                return Verdict(True, detail="closed during the handshake")
            return send_and_close(sock, b"")
        return self._session(inp.frames[0], inp.frames[1].decode())

    def _session(self, body: bytes, how: str) -> Verdict:
        if self._peer is None:
            self._peer = PeerLink(self.daemon, fake_host_id(1), "127.0.0.9:29650")
        frame = self._peer.session.seal_raw(body)
        if how == "bad_mac":            # a flipped bit of the tag: the frame fails its authentication
            frame = frame[:-1] + bytes([frame[-1] ^ 1])
        if how == "bad_len":
            frame = _LEN.pack(0xFFFFFFFF) + frame[4:]
        try:
            self._peer.sock.sendall(frame)
        except OSError:
            self._peer.close()
            self._peer = None       # the daemon dropped the link (a bad frame): the next input redials
        return Verdict(True, counted=False)


class DataSurface(Surface):
    name = "data"

    def __init__(self, daemon):
        super().__init__(daemon)
        self._att: zmq.Socket | None = None
        self._helper: Helper | None = None
        self._peer: PeerLink | None = None
        self._jobs = 0
        self._pending = 0
        self._joins: dict[int, str] = {}       # join request id -> job
        self._answered: set[str] = set()       # jobs whose join got its reply

    def capture(self) -> None:
        with _Capture() as sent:
            sock = connect(self.daemon.link_addr)
            auth.initiate(sock, _KEY, FLEET, fake_host_id(2), "127.0.0.9:29650", self.daemon.link_addr,
                          f"data:{fake_host_id(2)}.capture.1")
            sock.close()
        cfg = _engine_defaults()
        hello = {"magic": _MAGIC, "version": _LINK_VERSION, "comm_id": "$COMM", "from_rank": 0, "to_rank": 1,
                 "world": 2, "sock_index": 0, "socks_per_peer": _K, "wire_security": 2, **cfg}
        # A collective frame of a 2-float allreduce (op_signature.cc), an ABORT and a BYE.
        header = {"magic": _MAGIC, "version": _ENGINE_VERSION, "kind": 1, "comm_id": "$COMM", "seq": 1, "tag": 0,
                  "offset": 0, "length": 8, "total": 8,
                  "op": 1, "op_bytes": 8, "dtype": 0, "redop": 0, "root": -1, "pieces": 0}
        abort = {**header, "kind": 3, "seq": 0, "op": 0, "op_bytes": 0, "length": 33, "total": 33,
                 "payload": [0, 0, 3, 9, 4, "127.0.0.1", "lost"]}
        self.seeds = {"hello": [sent[0]], "engine_hello": [hello],
                      "engine_frame": [header, abort, {**header, "kind": 4, "op": 0, "length": 0, "total": 0}]}

    def strategy(self) -> st.SearchStrategy[Input]:
        hello = mutated_json(self.seeds["hello"]).map(encode).map(_frame).flatmap(byte_noise)
        eng_hello = mutated_json(self.seeds["engine_hello"], 2).map(encode)
        frame = st.one_of(mutated_json(self.seeds["engine_frame"], 2).map(lambda h: [encode(h), b"json"]),
                          random_bytes.map(lambda b: [b, b"raw"]))
        engine = st.tuples(eng_hello, frame).map(lambda t: Input(self.name, "engine", [t[0], *t[1]]))
        return st.one_of(hello.map(lambda b: Input(self.name, "hello", [b])), engine, engine)

    def begin_batch(self) -> None:
        self._helper = Helper()
        self._att = zmq.Context.instance().socket(zmq.DEALER)
        self._att.setsockopt(zmq.LINGER, 0)
        self._att.connect(protocol.endpoint(self.daemon.rdir))
        self._att.send(protocol.encode(self._hello()))
        if not self._att.poll(10_000) or not json.loads(self._att.recv()).get("ok"):
            raise RuntimeError("[fuzz] mccld refused the data batch's hello")
        # Its own listen address: a mutated hello claiming an address makes the daemon map it to
        # that hello's host (links.py), so one the mutants use could route the lease elsewhere.
        self._peer = PeerLink(self.daemon, fake_host_id(3), "127.0.0.10:29650")
        self._pending = 0
        self._answered.clear()

    def _hello(self) -> dict[str, Any]:
        assert self._helper is not None
        token = (self.daemon.rdir / protocol.TOKEN_NAME).read_text().strip()
        return {"type": "hello", "token": token, "pid": self._helper.pid, "req": 1 << 41}

    def end_batch(self) -> int:
        assert self._helper is not None and self._att is not None
        self._helper.kill()
        deadline = time.monotonic() + 15.0
        while self._pending > 0 and time.monotonic() < deadline:
            if self._att.poll(100):
                self._att.recv()
                self._pending -= 1
        self._att.close(0)
        if self._peer is not None:
            self._peer.close()
        return max(0, self._pending)

    def send(self, inp: Input) -> Verdict:
        if inp.stage == "hello":
            sock = connect(self.daemon.link_addr)
            try:
                _handshake(sock, inp.frames[0])
                sock.sendall(b"stray bytes on an idle data socket")
            except OSError:
                sock.close()
                return Verdict(True, detail="closed during the handshake")
            return send_and_close(sock, b"")
        return self._engine(*inp.frames)

    def _engine(self, hello: bytes, frame: bytes, frame_kind: bytes) -> Verdict:
        assert self._att is not None and self._peer is not None
        self._jobs = next(_JOBS)          # unique across surfaces of one process
        job = f"e{os.getpid() % 0xFFFF:04x}{self._jobs % 0xFFFFFF:06x}"
        fake = self._peer.host_id
        hosts = [{"host_id": fake, "link_addr": self._peer.listen, "ranks": [0]},
                 {"host_id": self.daemon.host_id, "link_addr": self.daemon.link_addr, "ranks": [1]}]
        self._att.send(protocol.encode({"type": "join", "job": job, "rank": 1, "size": 2, "hosts": hosts,
                                        "timeout_s": 3.0, "opts": {}, "req": self._jobs}))
        self._joins[self._jobs] = job
        self._pending += 1
        sock_id = f"{fake}.{os.getpid()}.{self._jobs}"
        sock = connect(self.daemon.link_addr)
        try:
            auth.initiate(sock, _KEY, FLEET, fake, self._peer.listen, self.daemon.link_addr, f"data:{sock_id}")
            self._peer.send({"type": "data_lease", "job": job, "round": 0, "ids": [sock_id]})
            ack = self._lease_ack(job)
            if ack is None:        # the job failed before the lease: its join was answered
                return Verdict(True, detail="join refused")
            if ack.get("missing"):
                return Verdict(False, detail=f"lease not acked: {ack}")
            # The daemon's engine now waits for our Hello on the leased socket.
            comm = int(job, 16)
            packed = _pack_hello(_json(hello, comm))
            sock.sendall(packed)
            sock.settimeout(ANSWER_TIMEOUT_S)
            if _prove(sock, packed, job):
                sock.sendall(_pack_header(_json(frame, comm)) if frame_kind == b"json" else frame)
            sock.shutdown(socket.SHUT_WR)
            # The join's answer, then (joined: the fuzzer will not run the job) a leave that
            # aborts it; only then must the daemon have closed the data socket.
            if not self._join_answered(job):
                return Verdict(False, detail="the join was not answered")
            closed, _ = drain_until_closed(sock)
            return Verdict(closed, detail="" if closed else "the daemon kept a data socket of an ended job")
        except socket.timeout:
            return Verdict(False, detail="the daemon went silent during the lease or the engine handshake")
        except (OSError, auth.AuthError, auth.ProtocolError) as e:
            return Verdict(True, detail=f"closed: {e}")
        finally:
            sock.close()

    def _lease_ack(self, job: str) -> dict[str, Any] | None:
        """The daemon's data_ack for ``job``, or None once its join was answered first (the job
        failed); job_failed notices of earlier jobs come on the link too."""
        assert self._peer is not None
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._join_answered(job, wait_s=0.0):
                return None
            if not select.select([self._peer.sock], [], [], 0.05)[0]:
                continue
            msg = self._peer.recv(ANSWER_TIMEOUT_S)      # a whole frame: never cut one in two
            if msg.get("type") == "data_ack" and msg.get("job") == job:
                return msg
        raise socket.timeout(f"no data_ack for job {job}")

    def _join_answered(self, job: str, wait_s: float = ANSWER_TIMEOUT_S) -> bool:
        """Handle the attach replies that came (within ``wait_s``); True once ``job``'s join is answered."""
        assert self._att is not None
        deadline = time.monotonic() + wait_s
        while self._att.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = json.loads(self._att.recv())
            self._pending -= 1
            joined = self._joins.pop(reply.get("req"), None)
            if reply.get("ok") and joined is not None:
                # Leaving ends the connection's attachment too: it says hello again for the next job.
                self._att.send(protocol.encode({"type": "leave", "job": joined, "rank": 1, "abort": "fuzz",
                                                "req": 1 << 40}))
                self._att.send(protocol.encode(self._hello()))
                self._pending += 2
            if joined == job:
                self._answered.add(job)
            if job in self._answered:
                return True
        return job in self._answered


def _json(data: bytes, comm_id: int) -> Any:
    """A stored engine hello or header (JSON), with the job's communicator id for "$COMM"."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    if isinstance(obj, dict) and obj.get("comm_id") == "$COMM":
        obj["comm_id"] = comm_id
    return obj


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def _prove(sock: socket.socket, hello: bytes, job: str) -> bool:
    """The dialer's half of the keyed handshake after ``hello``: answer a challenge with the
    proof under the job's engine secret (as mccld derives it); True on an accepting verdict."""
    import hashlib
    import hmac

    from mccl_common import jobkey
    challenge = _recv_exact(sock, _REPLY)
    if challenge is None or int.from_bytes(challenge[4:8], "little") != 0:
        return False
    secret = jobkey.derive(_KEY, "engine-job", FLEET, job)
    proof = hmac.new(secret, b"mccl link v3 dialer proof\0" + hello + challenge[12:], hashlib.sha256).digest()
    sock.sendall(struct.pack("<I", _MAGIC) + proof)
    verdict = _recv_exact(sock, _REPLY)
    return verdict is not None and int.from_bytes(verdict[4:8], "little") == 0


def _engine_defaults() -> dict[str, int]:
    from mccl_common.settings import EngineConfig, load
    cfg = load(EngineConfig)
    return {"segment_bytes": cfg.segment_bytes, "small_allreduce_bytes": cfg.small_allreduce_bytes}


def _u(v: Any, bits: int) -> int:
    """A mutated field as the C++ side reads it: any int wraps to ``bits``; anything else is 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        return 0
    return int(v) & ((1 << bits) - 1)


def _pack_hello(h: Any) -> bytes:
    h = h if isinstance(h, dict) else {}
    return _HELLO.pack(_u(h.get("magic"), 32), _u(h.get("version"), 32), _u(h.get("comm_id"), 64),
                       _u(h.get("from_rank"), 32), _u(h.get("to_rank"), 32), _u(h.get("world"), 32),
                       _u(h.get("sock_index"), 32), _u(h.get("socks_per_peer"), 32),
                       _u(h.get("segment_bytes"), 64), _u(h.get("small_allreduce_bytes"), 64),
                       _u(h.get("wire_security"), 32), os.urandom(32))


def _pack_header(h: Any) -> bytes:
    """frame.h's header, field by field, then the payload: an ABORT's fields when given
    (``payload``: origin, lost, kind, address length, message length, address, message),
    else ``length`` zero bytes (at most 4 KiB of them)."""
    h = h if isinstance(h, dict) else {}
    head = struct.pack("<IHHQQIQQQHQBBII", *(_u(h.get(k), b) for k, b in (
        ("magic", 32), ("version", 16), ("kind", 16), ("comm_id", 64), ("seq", 64), ("tag", 32),
        ("offset", 64), ("length", 64), ("total", 64),
        # the opaque signature, as the engine's communicator fills it
        ("op", 16), ("op_bytes", 64), ("dtype", 8), ("redop", 8), ("root", 32), ("pieces", 32))))
    p = h.get("payload")
    if isinstance(p, list) and len(p) == 7:
        strs = [str(x).encode("utf-8", "surrogatepass")[:4096] for x in p[5:]]
        return head + struct.pack("<5I", *(_u(x, 32) for x in p[:5])) + b"".join(strs)
    return head + bytes(min(_u(h.get("length"), 64), 4096))
