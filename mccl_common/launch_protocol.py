"""Wire protocol of a daemon's launch endpoint (``mcclctl run``), both ends.

One lease per TCP connection, newline-framed JSON (``status_protocol.Conn``)::

    server -> {"mccl_launch": PROTO, "nonce": <hex>, "host": <host id>}
    client -> {"body": "<json LaunchRequest>", "cnonce": <hex>,
               "mac": MAC(key, "launch-req", nonce, host, cnonce, body)}
    server -> {"seq": 0, "event": "started", "data": {...}, "mac": <hex>}
              | {"seq": 0, "event": "refused", "data": {"kind", "message"}, "mac": <hex>}
    server -> {"seq": n, "event": "out" | "err" | "beat" | "left" | "exit", "data": ..., "mac": <hex>} ...
    client -> {"ctl": "beat" | "cancel", "cseq": n, "mac": MAC(key, "launch-ctl", cnonce, nonce, n, ctl)}
              (a beat every BEAT_S; cseq counts 0, 1, ... per lease)

The request is MAC'd with the *submit key* (MCCL_SUBMIT_KEY_FILE), which is not the fleet
key: a host of the fleet can reach its peers' status but cannot start jobs on them. Every
server message after it carries MAC(key, "launch-event", cnonce, nonce, seq, event, data),
so output lines and the exit code cannot be forged or reordered by the network. The host id
the server names in its hello is inside the request's MAC (the server checks it against its
own), so a client cannot be fooled about which host it leased; and the client's beats and
cancel are MAC'd and numbered, so nobody on the path can cancel a job, or keep a lease
alive after its client is gone, by injecting or replaying one (the server ignores, and logs,
a control message that fails its check).

The request's ``run_nonce`` (fresh per run, under the request's MAC) gives every leased host
the same *run key*, ``run_key(submit key, job, run_nonce)``, without it crossing the network:
mccld writes it to a file only the job's user reads and points the job's MCCL_JOB_KEY_FILE
there, so the run's rendezvous values and links are keyed to this run alone. Both sides
send at least every BEAT_S and give up on a silent peer after LEASE_TIMEOUT_S: a client
that is gone (Ctrl-C, killed, cable pulled) ends the lease and mccld stops the job.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Any

from .errors import AuthError, ConfigError, DaemonUnavailableError, MCCLError, ProtocolError
from .jobkey import derive
from .status_protocol import MAX_PREAUTH_LINE, Conn, canon, mac, mac_ok, split_addr

PROTO = 2                    # 2: host id in the request MAC; beats and cancels MAC'd
DEFAULT_PORT = 29653
BEAT_S = 2.0                 # each side sends something at least this often
LEASE_TIMEOUT_S = 10.0       # silence after which a side takes the other for gone
MAX_LINE_CHARS = 16 << 10    # one output line as sent; longer lines are cut
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


def event_mac(key: bytes, cnonce: str, nonce: str, seq: int, event: str, data: Any) -> str:
    return mac(key, "launch-event", cnonce, nonce, str(seq), event, canon(data))


def sealed(key: bytes, cnonce: str, nonce: str, seq: int, event: str, data: Any) -> dict:
    return {"seq": seq, "event": event, "data": data, "mac": event_mac(key, cnonce, nonce, seq, event, data)}


def request_mac(key: bytes, nonce: str, host: str, cnonce: str, body: str) -> str:
    return mac(key, "launch-req", nonce, host, cnonce, body)


def request_ok(key: bytes, msg: dict, nonce: str, host: str) -> tuple[str, str] | None:
    """(body, cnonce) of an authentic request to ``host`` (this server's own id), else None."""
    body, cnonce, got = msg.get("body"), msg.get("cnonce"), msg.get("mac")
    if not all(isinstance(x, str) for x in (body, cnonce, got)) or len(cnonce) > 64:
        return None
    return (body, cnonce) if mac_ok(key, got, "launch-req", nonce, host, cnonce, body) else None


CONTROLS = ("beat", "cancel")


def control(key: bytes, cnonce: str, nonce: str, cseq: int, ctl: str) -> dict:
    """A client's sealed beat or cancel, number ``cseq`` of its lease."""
    return {"ctl": ctl, "cseq": cseq, "mac": mac(key, "launch-ctl", cnonce, nonce, str(cseq), ctl)}


class ControlCheck:
    """The server's check of a lease's beats and cancels: authentic, and each number used once
    and in order, so neither an injected nor a replayed one counts."""

    def __init__(self, key: bytes, cnonce: str, nonce: str):
        self._key, self._cnonce, self._nonce = key, cnonce, nonce
        self._next = 0

    def __call__(self, msg: dict) -> str | None:
        """"beat" or "cancel" for an authentic control message, None for anything else."""
        ctl, cseq = msg.get("ctl"), msg.get("cseq")
        if (ctl not in CONTROLS or not isinstance(cseq, int) or isinstance(cseq, bool) or cseq != self._next
                or not mac_ok(self._key, msg.get("mac"), "launch-ctl", self._cnonce, self._nonce, str(cseq), ctl)):
            return None
        self._next += 1
        return ctl


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
        self._seq = 0
        self._cseq = 0
        self._cnonce = os.urandom(16).hex()
        self._nonce = ""
        self.host = ""

    def open(self, request: LaunchRequest) -> dict:
        try:
            hello = self._conn.recv("hello")
            if hello.get("mccl_launch") != PROTO or not isinstance(hello.get("nonce"), str):
                raise ProtocolError(f"[launch] peer={self.addr} speaks launch protocol "
                                    f"{hello.get('mccl_launch')!r}, mcclctl speaks {PROTO}; "
                                    "upgrade mcclctl and mccld to the same release")
            self._nonce, self.host = hello["nonce"], str(hello.get("host", self.addr))
            body = canon(request.to_json())
            if len(body) + 256 > MAX_PREAUTH_LINE:
                raise ConfigError(f"[launch] the request to peer={self.addr} is {len(body)} bytes; a host reads at "
                                  f"most {MAX_PREAUTH_LINE} before the submit key is proven: shorten the "
                                  "command line or the environment passed with it")
            # The host id the server named is under the MAC: the server checks it is its own.
            self._conn.send({"body": body, "cnonce": self._cnonce,
                             "mac": request_mac(self._key, self._nonce, self.host, self._cnonce, body)})
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
        self._conn.send(control(self._key, self._cnonce, self._nonce, self._cseq, ctl))
        self._cseq += 1

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
        if msg.get("ok") is False:      # refused before authentication: unsigned, as the status endpoint does
            raise self._error(msg.get("error") or {})
        seq, event, data = msg.get("seq"), msg.get("event"), msg.get("data")
        if not isinstance(event, str) or seq != self._seq or not mac_ok(
                self._key, msg.get("mac"), "launch-event", self._cnonce, self._nonce, str(seq), event, canon(data)):
            raise AuthError(f"[launch] a message from peer={self.addr} failed its MAC or sequence check; "
                            "something on the path altered it, or the host uses another submit key")
        self._seq += 1
        return event, data

    def _error(self, data: Any) -> MCCLError:
        kind = data.get("kind") if isinstance(data, dict) else None
        text = data.get("message") if isinstance(data, dict) else None
        cls = {"AuthError": AuthError, "ConfigError": ConfigError, "ProtocolError": ProtocolError}.get(kind, MCCLError)
        return cls(f"{text or '[launch] refused without a reason'} (host {self.host or self.addr})")
