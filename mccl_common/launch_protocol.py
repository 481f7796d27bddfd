"""Wire protocol of a daemon's launch endpoint (``mcclctl run``), both ends.

One lease per TCP connection, newline-framed JSON (``status_protocol.Conn``)::

    server -> {"mccl_launch": PROTO, "nonce": <hex>, "host": <host id>}              (clear)
    client -> {"cnonce": <hex>, "box": B64(SEAL(K_req, 0, "<json LaunchRequest>"))}
    server -> {"seq": n, "box": B64(SEAL(K_down, n, {"event", "data"}))} ...
              events: started | refused, then out | err | beat | left | exit
    client -> {"cseq": n, "box": B64(SEAL(K_up, n, "beat" | "cancel"))}
              (a beat every BEAT_S; cseq counts 0, 1, ... per lease)

SEAL is AES-256-GCM (``mccl_common.aead``): the request (command line, ``--env`` values, cwd)
and every event (job output, exit code) and control are encrypted and authenticated. Its
keys come from the *submit key* (MCCL_SUBMIT_KEY_FILE), which is not the fleet key (a host
of the fleet can reach its peers' status but cannot start jobs on them or read their jobs'
output): K_x = derive(submit key, "launch-x", nonce, host, cnonce) for x = req, down, up,
so each connection and direction has keys of its own (both nonces are fresh). The GCM nonce
is the message's number in its direction, and the associated data names the protocol, the
message kind and its number, so a message can be neither forged, altered, replayed nor
reordered. The host id the server named in its hello is in every key: a server other than
the one the client meant cannot open the request (it answers an unsigned AuthError), so a
client cannot be fooled about which host it leased. The server ignores (and logs) a control
that fails to open: nobody on the path can cancel a job, or keep a lease alive after its
client is gone, by injecting or replaying one. Only the hello and a refusal before the key
is proven are in clear, and neither carries anything secret.

The request's ``run_nonce`` (fresh per run, sealed in the request) gives every leased host
the same *run key*, ``run_key(submit key, job, run_nonce)``, without it crossing the network:
mccld writes it to a file only the job's user reads and points the job's MCCL_JOB_KEY_FILE
there, so the run's rendezvous values and links are keyed to this run alone. Both sides
send at least every BEAT_S and give up on a silent peer after LEASE_TIMEOUT_S: a client
that is gone (Ctrl-C, killed, cable pulled) ends the lease and mccld stops the job.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import re
import socket
from typing import Any

from . import aead
from .errors import AuthError, ConfigError, DaemonUnavailableError, MCCLError, ProtocolError
from .jobkey import derive
from .status_protocol import MAX_PREAUTH_LINE, Conn, canon, split_addr

PROTO = 3                    # 3: request, events and controls AES-256-GCM; 2: MAC'd, in clear
DEFAULT_PORT = 29653
BEAT_S = 2.0                 # each side sends something at least this often
LEASE_TIMEOUT_S = 10.0       # silence after which a side takes the other for gone
MAX_LINE_CHARS = 16 << 10    # one output line as sent; longer lines are cut
# The request body a client may send: what fitted the 16 KiB pre-auth line in clear (protocol 2).
MAX_REQUEST_BODY = MAX_PREAUTH_LINE - 256
# What the server reads before the request opened: that body sealed (tag) and in base64 (4/3),
# plus the JSON around it. Events go the other way, read under status_protocol.MAX_LINE (4 MiB):
# a maximal output line, JSON-escaped (at most 6 characters a byte) and base64'd, is ~130 KiB.
MAX_REQUEST_LINE = 4 * math.ceil((MAX_REQUEST_BODY + aead.TAG_BYTES) / 3) + 256
MAX_ARGV = 256
MAX_ARG_CHARS = 4096
MAX_ENV = 64
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NONCE = re.compile(r"^[0-9a-f]{32}$")
# The job's key file, written by the daemon from the run key (never taken from the request).
RUN_KEY_ENV = "MCCL_JOB_KEY_FILE"
# A launched job's drain file (its path in the job's environment): it appears when the host's
# user is back; the job's ranks there save, write the file + LEFT_SUFFIX and exit (libmccl.elastic).
DRAIN_ENV = "MCCL_DRAIN_FILE"
LEFT_SUFFIX = ".left"
# Set by the mccl rendezvous handler in torchrun for its workers: the file it creates when a host
# waits to join the running job; the ranks save at their next step boundary and re-form with it.
# Workers that do so (libmccl.elastic) create the file + AWARE_SUFFIX, telling the handler not to
# let torchrun restart them mid-step instead.
REFORM_ENV = "MCCL_REFORM_FILE"
AWARE_SUFFIX = ".aware"
# Set by the daemon for the job, not by the request: they say which host and daemon it runs on.
RESERVED_ENV = ("MCCL_HOST_ID", "MCCL_RUNTIME_DIR", DRAIN_ENV, REFORM_ENV, RUN_KEY_ENV)


def new_run_nonce() -> str:
    return os.urandom(16).hex()


def run_key(submit_key: bytes, job: str, run_nonce: str) -> bytes:
    """The run's job key: every host holding the submit key derives the same one from the
    request, and a key from one run is worth nothing in another."""
    return derive(submit_key, "run", job, run_nonce)


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """What to start on one host: torchrun with the mccl rendezvous, then the user's command.
    Validated once, here, at the boundary; the daemon trusts the object afterwards."""

    job: str                    # the run's id: torchrun's --rdzv-id, and the name in logs
    rdzv_endpoint: str          # the anchor's store, host:port
    nnodes: str                 # "N" or "MIN:MAX"
    nproc_per_node: int
    argv: tuple[str, ...]       # the user's command: python script.py ARGS, or any executable
    cwd: str
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0
    any_state: bool = False     # lease even a host whose user is at it (mcclctl run --where state=any)
    run_nonce: str = ""         # 32 hex digits: the run key's input (see run_key); "" keeps the hosts' own key

    @classmethod
    def parse(cls, obj: Any) -> "LaunchRequest":
        def bad(what: str) -> ProtocolError:
            return ProtocolError(f"[launch] bad request: {what}")

        if not isinstance(obj, dict):
            raise bad("not a JSON object")
        job = obj.get("job")
        if not isinstance(job, str) or not _JOB.match(job):
            raise bad(f"job {job!r} is not 1-64 letters, digits, '.', '_' or '-'")
        endpoint = obj.get("rdzv_endpoint")
        if not isinstance(endpoint, str) or len(endpoint) > 256 or ":" not in endpoint:
            raise bad(f"rdzv_endpoint {endpoint!r} is not host:port")
        nnodes = obj.get("nnodes")
        if not isinstance(nnodes, str) or not re.fullmatch(r"[1-9][0-9]{0,3}(:[1-9][0-9]{0,3})?", nnodes):
            raise bad(f"nnodes {nnodes!r} is not N or MIN:MAX")
        lo, _, hi = nnodes.partition(":")
        if hi and int(hi) < int(lo):
            raise bad(f"nnodes {nnodes!r}: MAX is below MIN")
        nproc = obj.get("nproc_per_node")
        if not isinstance(nproc, int) or isinstance(nproc, bool) or not 1 <= nproc <= 256:
            raise bad(f"nproc_per_node {nproc!r} is not 1..256")
        restarts = obj.get("max_restarts", 0)
        if not isinstance(restarts, int) or isinstance(restarts, bool) or not 0 <= restarts <= 1000:
            raise bad(f"max_restarts {restarts!r} is not 0..1000")
        argv = obj.get("argv")
        if (not isinstance(argv, list) or not 1 <= len(argv) <= MAX_ARGV
                or not all(isinstance(a, str) and len(a) <= MAX_ARG_CHARS and "\0" not in a for a in argv)
                or not argv[0]):
            raise bad(f"argv must be 1-{MAX_ARGV} strings of at most {MAX_ARG_CHARS} characters, "
                      "the first not empty")
        cwd = obj.get("cwd")
        if not isinstance(cwd, str) or not cwd.startswith("/") or len(cwd) > MAX_ARG_CHARS or "\0" in cwd:
            raise bad(f"cwd {cwd!r} is not an absolute path")
        env = obj.get("env", {})
        if not isinstance(env, dict) or len(env) > MAX_ENV:
            raise bad(f"env must be an object of at most {MAX_ENV} variables")
        for k, v in env.items():
            if not _ENV_NAME.match(k) or not isinstance(v, str) or len(v) > MAX_ARG_CHARS or "\0" in v:
                raise bad(f"env variable {k!r} has a bad name or value")
            if k in RESERVED_ENV:
                raise bad(f"env variable {k} is set by the daemon for the host it runs on")
        any_state = obj.get("any_state", False)
        if not isinstance(any_state, bool):
            raise bad("any_state is not a boolean")
        run_nonce = obj.get("run_nonce", "")
        if not isinstance(run_nonce, str) or (run_nonce and not _NONCE.match(run_nonce)):
            raise bad("run_nonce is not 32 lowercase hex digits")
        return cls(job=job, rdzv_endpoint=endpoint, nnodes=nnodes, nproc_per_node=nproc,
                   argv=tuple(argv), cwd=cwd, env=tuple(sorted(env.items())), max_restarts=restarts,
                   any_state=any_state, run_nonce=run_nonce)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["argv"] = list(self.argv)
        d["env"] = dict(self.env)
        return d


CONTROLS = ("beat", "cancel")
_LABEL = f"mccl-launch/{PROTO}"


def _b64(box: bytes) -> str:
    return base64.b64encode(box).decode("ascii")


def _unb64(text: Any) -> bytes | None:
    if not isinstance(text, str):
        return None
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except ValueError:          # binascii.Error and UnicodeEncodeError both are
        return None


class Channel:
    """One lease's keys and counters, on either side: the request box (used once), the
    server's events (down) and the client's controls (up), each AES-256-GCM under a key
    of this connection and direction alone."""

    def __init__(self, key: bytes, nonce: str, host: str, cnonce: str):
        self._req = aead.Box(derive(key, "launch-req", nonce, host, cnonce))
        self._down = aead.Box(derive(key, "launch-down", nonce, host, cnonce))
        self._up = aead.Box(derive(key, "launch-up", nonce, host, cnonce))
        self.cnonce = cnonce

    # client -> server
    def seal_request(self, body: str) -> dict:
        _, box = self._req.seal(body.encode(), f"{_LABEL}\0req".encode())
        return {"cnonce": self.cnonce, "box": _b64(box)}

    def seal_control(self, ctl: str) -> dict:
        seq = self._up.seq
        _, box = self._up.seal(ctl.encode(), f"{_LABEL}\0ctl\0{seq}".encode())
        return {"cseq": seq, "box": _b64(box)}

    # server -> client
    def seal_event(self, event: str, data: Any) -> dict:
        seq = self._down.seq
        _, box = self._down.seal(canon({"event": event, "data": data}).encode(),
                                 f"{_LABEL}\0event\0{seq}".encode())
        return {"seq": seq, "box": _b64(box)}

    def open_request(self, msg: dict) -> str | None:
        box = _unb64(msg.get("box"))
        plain = None if box is None else self._req.open(box, f"{_LABEL}\0req".encode())
        try:
            return None if plain is None else plain.decode()
        except UnicodeDecodeError:
            return None

    def open_control(self, msg: dict) -> str | None:
        """"beat" or "cancel" for the client's next control, None for anything else: a control
        injected, replayed or altered on the path fails to open and counts for nothing."""
        seq, box = msg.get("cseq"), _unb64(msg.get("box"))
        if box is None or seq != self._up.seq or isinstance(seq, bool):
            return None
        plain = self._up.open(box, f"{_LABEL}\0ctl\0{seq}".encode())
        ctl = None if plain is None else plain.decode("ascii", "replace")
        return ctl if ctl in CONTROLS else None

    def open_event(self, msg: dict) -> tuple[str, Any] | None:
        seq, box = msg.get("seq"), _unb64(msg.get("box"))
        if box is None or seq != self._down.seq or isinstance(seq, bool):
            return None
        plain = self._down.open(box, f"{_LABEL}\0event\0{seq}".encode())
        if plain is None:
            return None
        # Sealed by the holder of the submit key: parsed, but still checked for shape.
        try:
            obj = json.loads(plain)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("event"), str):
            return None
        return obj["event"], obj.get("data")


def accept_request(key: bytes, msg: dict, nonce: str, host: str) -> tuple[Channel, str] | None:
    """The server's lease channel and the request body of an authentic request to ``host``
    (this server's own id), else None."""
    cnonce = msg.get("cnonce")
    if not isinstance(cnonce, str) or not 1 <= len(cnonce) <= 64 or not cnonce.isascii():
        return None
    chan = Channel(key, nonce, host, cnonce)
    body = chan.open_request(msg)
    return None if body is None else (chan, body)


class Lease:
    """The client's end of one lease: ``open`` sends the request and returns once the host
    started the job (or raises why not); ``events`` yields (event, data) until the exit;
    ``beat``/``cancel`` keep it alive or end it; ``close`` drops it (the host stops the job)."""

    def __init__(self, addr: str, key: bytes, timeout_s: float = LEASE_TIMEOUT_S):
        self.addr = addr
        self._key = key
        self._timeout_s = timeout_s
        host, port = split_addr(addr, DEFAULT_PORT)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise DaemonUnavailableError(
                f"[launch] cannot reach the launch endpoint, peer={host}:{port}: {e.strerror or e}; mccld is "
                "not running there, its MCCL_LAUNCH_PORT differs, or a firewall blocks it") from None
        self._conn = Conn(self._sock, f"{host}:{port}")
        self._cnonce = os.urandom(16).hex()
        self._chan: Channel | None = None
        self._started = False
        self.host = ""

    def open(self, request: LaunchRequest) -> dict:
        try:
            hello = self._conn.recv("hello")
            if hello.get("mccl_launch") != PROTO or not isinstance(hello.get("nonce"), str):
                raise ProtocolError(f"[launch] peer={self.addr} speaks launch protocol "
                                    f"{hello.get('mccl_launch')!r}, mcclctl speaks {PROTO}; "
                                    "upgrade mcclctl and mccld to the same release")
            self.host = str(hello.get("host", self.addr))
            body = canon(request.to_json())
            if len(body) > MAX_REQUEST_BODY:
                raise ConfigError(f"[launch] the request to peer={self.addr} is {len(body)} bytes; a host reads at "
                                  f"most {MAX_REQUEST_BODY} before the submit key is proven: shorten the "
                                  "command line or the environment passed with it")
            # The host id the server named is in every key: only that host can open the request.
            self._chan = Channel(self._key, hello["nonce"], self.host, self._cnonce)
            self._conn.send(self._chan.seal_request(body))
            event, data = self._next()
        except (OSError, ConnectionError) as e:
            raise DaemonUnavailableError(f"[launch] lost the connection to peer={self.addr} "
                                         f"({self.host or 'no host id yet'}) before it started the job: {e}") from None
        if event == "refused":
            raise self._error(data)
        if event != "started":
            raise ProtocolError(f"[launch] peer={self.addr} answered {event!r} instead of starting the job")
        return data

    def read(self) -> tuple[str, Any]:
        """The next (event, data), beats included; blocks up to the lease timeout. A host that
        goes silent or drops the connection raises DaemonUnavailableError naming it."""
        try:
            return self._next()
        except (OSError, ConnectionError) as e:
            raise DaemonUnavailableError(
                f"[launch] lost the lease on {self.host} (peer={self.addr}): {e}; the host went down, "
                "its mccld stopped, or the network between here and there failed") from None

    def beat(self) -> None:
        self._control("beat")

    def cancel(self) -> None:
        self._control("cancel")

    def _control(self, ctl: str) -> None:
        if self._chan is None:
            raise ProtocolError(f"[launch] no lease on peer={self.addr} yet: open() it first")
        self._conn.send(self._chan.seal_control(ctl))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def settimeout(self, seconds: float) -> None:
        self._sock.settimeout(seconds)

    def fileno(self) -> int:
        """For select(): readable when the host sent something."""
        return self._sock.fileno()

    def buffered(self) -> bool:
        """A message already read off the socket waits here (select() would not see it)."""
        return self._conn.pending()

    def _next(self) -> tuple[str, Any]:
        msg = self._conn.recv("launch event")
        if msg.get("ok") is False and not self._started:
            # Refused before authentication: unsigned, as the status endpoint does. Only the
            # first answer may be one; later, it is an injection like any other.
            raise self._error(msg.get("error") or {})
        got = self._chan.open_event(msg) if self._chan is not None else None
        if got is None:
            raise AuthError(f"[launch] a message from peer={self.addr} failed its authentication or sequence "
                            "check; something on the path altered it, or the host uses another submit key")
        self._started = True
        return got

    def _error(self, data: Any) -> MCCLError:
        kind = data.get("kind") if isinstance(data, dict) else None
        text = data.get("message") if isinstance(data, dict) else None
        cls = {"AuthError": AuthError, "ConfigError": ConfigError, "ProtocolError": ProtocolError}.get(kind, MCCLError)
        return cls(f"{text or '[launch] refused without a reason'} (host {self.host or self.addr})")
