"""torchrun's ``--rdzv-backend mccl``: hosts meet through a store on an anchor host.

    torchrun --rdzv-backend mccl --rdzv-endpoint ANCHOR[:PORT] --nnodes MIN:MAX ... script.py

torch's DynamicRendezvousHandler does the rounds (join, last call, a wait list that lets a
late host trigger the next round, keep-alives that drop a silent host); this file gives it
what fits a LAN job:

- its state lives in a TCPStore on the anchor: the torchrun started on the anchor host serves
  it (later, whatever keeps the anchor up for the whole job), every other torchrun dials it;
- timeouts in seconds (RendezvousConfig in mccl_common/settings.py, or the ``--rdzv-conf`` keys
  torch's own backends use), so a missing host or a dead anchor ends the run in seconds
  instead of torch's ten minutes;
- the address each host advertises, which becomes the workers' MASTER_ADDR when the host gets
  rank 0, is chosen like the engine's listen address (MCCL_BIND_ADDR, MCCL_SOCKET_IFNAME,
  else the route to the anchor), so the job's stores and links use the training network;
- its errors name the anchor and say what to do, and are torch's rendezvous error types too,
  which the elastic agent acts on.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import inspect
import logging
import os
import pickle
import secrets
import socket
import struct
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

# Submodules, not the package: torch imports this file from inside
# torch.distributed.elastic.rendezvous's __init__, before the package has finished loading.
from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                      RendezvousInfo, RendezvousParameters,
                                                      RendezvousStateError, RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler, RendezvousBackend,
                                                                     RendezvousTimeout)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mccl_common import store_auth
from mccl_common.jobkey import derive, find_job_key, key_id
from mccl_common.errors import AbortedError, CollectiveTimeout, ConfigError, PeerLostError, StoreAuthError
from mccl_common.launch_protocol import AWARE_SUFFIX, DRAIN_ENV, REFORM_ENV
from mccl_common.settings import EngineConfig, RendezvousConfig, load

from .. import listen_addr, refusal
from . import store_server
from .assign_store import AssignmentStore
from ..sealed_store import SealedStore

_log = logging.getLogger(__name__)

BACKEND_NAME = "mccl"
DEFAULT_PORT = 29400  # torch's c10d rendezvous port: one firewall rule serves either backend
_CONNECT_ATTEMPT_S = 2.0  # one connect attempt: a LAN answers in milliseconds, a dropped SYN never does
_CONNECT_RETRY_S = 0.25
_MIN_KEEP_ALIVE_WINDOW_S = 2.0
_LINGER_POLL_S = 0.05
_PARENT_POLL_S = 0.5
_WORKERS_STORE_TIMEOUT = timedelta(seconds=300)  # torch's TCPStore default, as its own server has
_VERSION = struct.Struct("!Q")     # the state's version, sealed with it (AnchorStoreBackend)
_COUNT = struct.Struct("!H")       # how many acknowledged hello nonces follow the epoch
_NONCE_BYTES = 16                  # a run's epoch, a host's hello nonce
_MAX_ACKS = 64                     # acknowledged nonces a state keeps (newest): enough for a round's joins
_VOUCH_POLL_S = 0.1
_EMPTY = "mccl-rdzv-empty"  # stored until the first host writes a state; never a sealed value
# torchrun always passes "timeout" (the legacy etcd rendezvous's); the timeouts here have their own keys.
_IGNORED_KEYS = frozenset({"timeout"})
_REFUSAL_LINGER_S = 5.0   # a refusing host (maybe the anchor's server) waits this long at most for readers


class RendezvousUnreachable(RendezvousConnectionError, PeerLostError):
    """The anchor's store cannot be reached, or stopped answering."""


class RendezvousJoinTimeout(RendezvousTimeoutError, CollectiveTimeout):
    """Fewer hosts than the minimum joined a round in time."""


class RendezvousClosed(RendezvousClosedError, AbortedError):
    """Another torchrun of the run finished or failed and closed the rendezvous."""


class RendezvousForged(RendezvousStateError, StoreAuthError):
    """A value in the anchor's store failed its MAC under the run's key: nothing of it was used."""


def run_store_key(run_id: str) -> bytes | None:
    """The key that seals this run's values in the anchor's store (mccl_common/store_auth.py),
    from this torchrun's job key: MCCL_JOB_KEY_FILE (mcclctl run's per-run key) or the fleet key."""
    return store_auth.job_store_key(load(EngineConfig).wire_security, "rdzv", run_id)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """One run's rendezvous options: RendezvousConfig, with the ``--rdzv-conf`` keys over it."""

    store_timeout_s: float
    join_timeout_s: float
    last_call_s: float
    close_timeout_s: float
    heartbeat_s: float
    heartbeat_misses: int
    join_at_step_s: float
    is_host: bool | None  # None: serve the store when the anchor names this host

    # --rdzv-conf key -> field; the keys are those torch's c10d backend reads, so a command line
    # written for it keeps its meaning.
    KEYS = {"read_timeout": "store_timeout_s", "join_timeout": "join_timeout_s",
            "last_call_timeout": "last_call_s", "close_timeout": "close_timeout_s",
            "keep_alive_interval": "heartbeat_s", "keep_alive_max_attempt": "heartbeat_misses",
            "join_at_step_timeout": "join_at_step_s"}

    @classmethod
    def parse(cls, params: RendezvousParameters, cfg: RendezvousConfig) -> "RunOptions":
        values: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                                  if f.name in cls.KEYS.values()}
        for key, name in cls.KEYS.items():
            raw = params.get(key)
            if raw is None:
                continue
            try:
                value = int(raw) if name == "heartbeat_misses" else float(raw)
            except (TypeError, ValueError):
                raise ConfigError(f"[rendezvous] --rdzv-conf {key}={raw!r} is not a number; "
                                  f"give {'a count' if name == 'heartbeat_misses' else 'seconds'}") from None
            if value <= 0:
                raise ConfigError(f"[rendezvous] --rdzv-conf {key}={raw!r} must be positive")
            values[name] = value
        is_host = None
        if params.get("is_host") is not None:
            try:
                is_host = params.get_as_bool("is_host")
            except ValueError:
                raise ConfigError(f"[rendezvous] --rdzv-conf is_host={params.get('is_host')!r} is not a "
                                  "boolean; give 1 on the anchor host, 0 elsewhere, or leave it out") from None
        window = values["heartbeat_s"] * values["heartbeat_misses"]
        if window < _MIN_KEEP_ALIVE_WINDOW_S:
            # A host still joining writes its keep-alive only on torch's join poll, once a second;
            # a shorter window makes hosts drop each other before any round can form.
            raise ConfigError(f"[rendezvous] keep-alive window {values['heartbeat_s']:g}s x "
                              f"{values['heartbeat_misses']} = {window:g}s is under {_MIN_KEEP_ALIVE_WINDOW_S:g}s: "
                              "joining hosts would drop each other; raise MCCL_RDZV_HEARTBEAT (keep_alive_interval) "
                              "or MCCL_RDZV_HEARTBEAT_MISSES (keep_alive_max_attempt)")
        unknown = sorted(set(params.config) - set(cls.KEYS) - {"is_host"} - _IGNORED_KEYS)
        if unknown:
            _log.warning("[rendezvous] ignoring --rdzv-conf %s: the mccl backend reads only %s",
                         ", ".join(unknown), ", ".join([*cls.KEYS, "is_host"]))
        return cls(is_host=is_host, **values)


def anchor_endpoint(endpoint: str, cfg: RendezvousConfig) -> tuple[str, int]:
    """(host, port) of the anchor: ``--rdzv-endpoint``, else MCCL_RDZV_ANCHOR."""
    raw = (endpoint or cfg.anchor).strip()
    if not raw:
        raise ConfigError("[rendezvous] no anchor: torchrun got no --rdzv-endpoint and MCCL_RDZV_ANCHOR is "
                          "empty; pass --rdzv-endpoint HOST[:PORT] naming a host that stays up for the whole "
                          "job, the same on every host")
    try:
        host, port = parse_rendezvous_endpoint(raw, default_port=DEFAULT_PORT)
    except ValueError as exc:
        raise ConfigError(f"[rendezvous] anchor {raw!r} is not HOST[:PORT] ({exc}); fix --rdzv-endpoint "
                          "or MCCL_RDZV_ANCHOR") from None
    if port == 0:
        raise ConfigError(f"[rendezvous] anchor {raw!r} has port 0, which other hosts cannot dial; "
                          f"give a fixed port (e.g. {DEFAULT_PORT})")
    return host, port


def open_anchor_store(host: str, port: int, serve: bool | None, timeout_s: float) -> tuple[Any, bool]:
    """(TCPStore, whether this process serves it). ``serve`` None: serve when ``host`` is this
    host and the port is free, else dial; so on the anchor host the first torchrun serves and
    any other one there joins it."""
    from torch.distributed import TCPStore

    anchor = f"{host}:{port}"
    timeout = timedelta(seconds=timeout_s)
    if serve is None:
        serve_now = listen_addr.is_this_host(host)
    else:
        serve_now = serve
    if serve_now:
        try:
            # Not multi-tenant: a second handler in this process must find the port taken and
            # dial, as one in another process does.
            return _serve_on(host, port, timeout), True
        except (RuntimeError, ValueError, OSError) as exc:
            if serve:
                raise RendezvousUnreachable(
                    f"[rendezvous] cannot serve the rendezvous store on port {port}, peer={anchor}: {_first_line(exc)}; "
                    "likely cause: another process holds the port; free it, pick another port in "
                    "--rdzv-endpoint, or drop is_host=1 to join the store already there", peer_addr=anchor) from exc
            _log.debug("[rendezvous] port %d is taken on this host (%s); joining the store there", port, exc)
    started = time.monotonic()
    try:
        # TCPStore's own connect retries run to about twice its timeout and print a C++ stack
        # per attempt; a plain connect loop first gives one deadline and one clear message.
        _wait_until_listening(host, port, started + timeout_s)
        return TCPStore(host, port, is_master=False, timeout=timeout), False
    except (RuntimeError, ValueError, OSError) as exc:
        raise RendezvousUnreachable(
            f"[rendezvous] cannot reach the anchor's rendezvous store, peer={anchor}, within {timeout_s:g}s "
            f"({type(exc).__name__}: {_first_line(exc)}); likely cause: "
            "the torchrun on the anchor host is not running yet (start it first), --rdzv-endpoint names the "
            "wrong host or port, or a firewall drops the port; check the address on every host, or raise "
            "MCCL_RDZV_STORE_TIMEOUT (read_timeout) to wait longer", peer_addr=anchor) from exc


def _serve_on(host: str, port: int, timeout: timedelta) -> Any:
    """A store server on the anchor's own address only (it names this host), so the store is
    not offered on the host's other networks."""
    ip = _local_address(host)
    why = f"{host} is not an address of this host"
    if ip is not None:
        if listen_addr.is_loopback(ip) and not listen_addr.is_loopback(host):
            # /etc/hosts maps this host's name to 127.0.1.1, which the other hosts cannot dial.
            why = f"{host} resolves to {ip} here, which only this host reaches"
        else:
            try:
                return store_server.serve_store(ip, port, timeout)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
    _log.warning("[rendezvous] %s: serving the rendezvous store on every interface, port %d; its values are "
                 "authenticated, but give --rdzv-endpoint this host's training address to keep it off other "
                 "networks", why, port)
    from torch.distributed import TCPStore
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def _local_address(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def _wait_until_listening(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise the last error at ``deadline``.
    The anchor's torchrun may start a moment after this one, so a refusal is retried."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing accepted a connection to {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=min(left, _CONNECT_ATTEMPT_S)):
                return
        except OSError as exc:
            if time.monotonic() + _CONNECT_RETRY_S >= deadline:
                raise
            _log.debug("[rendezvous] %s:%d: %s; retrying", host, port, exc)
            time.sleep(_CONNECT_RETRY_S)


def _republish_workers_store(info: Any) -> None:
    """Rank 0 of a round tells the round where the workers' store is. torch writes it only in
    the first round rank 0's agent serves, so a host that joins a later round (a joining Mac,
    a drained one back) would wait for it until its store timeout; writing it every round is
    harmless (the same values) and lets it in."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    boot = info.bootstrap_store_info
    if boot is None:
        return
    info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr.encode())
    info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port).encode())


def _continue_children() -> None:
    """SIGCONT to this process's children (torchrun's workers: the handler runs in torchrun)."""
    import signal
    import subprocess

    me = os.getpid()
    pids: list[int] = []
    task = f"/proc/{me}/task"
    if os.path.isdir(task):
        for tid in os.listdir(task):
            try:
                with open(f"{task}/{tid}/children") as fh:
                    pids += [int(p) for p in fh.read().split()]
            except OSError:
                continue
    else:   # macOS: no /proc
        try:
            out = subprocess.run(["pgrep", "-P", str(me)], capture_output=True, text=True, timeout=5).stdout
            pids = [int(p) for p in out.split()]
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


def _remove(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.debug("[rendezvous] cannot remove %s: %s", path, exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


class AnchorStoreBackend(RendezvousBackend):
    """The rendezvous state as one compare-and-set key in the anchor's store; a store failure
    becomes RendezvousUnreachable naming the anchor.

    Replays across runs. A state is sealed under the run's key, which under a long-lived key
    (the fleet key) and a reused --rdzv-id is the same in every run, and the store's key names
    repeat: a state recorded from an earlier run's store verifies in this one. So each run has
    an *epoch*, 16 random bytes drawn by the host that writes the first state into an empty
    store, carried in every state; a host refuses a state of any other epoch once it holds one.
    A host that joins a run already under way cannot tell this run's epoch from an earlier
    run's by looking: it posts a fresh nonce (a "hello"), and takes the epoch only from a state
    that lists its nonce among the acknowledged ones. Hosts already in the run acknowledge
    the hellos they find each time they read or write the state (at least every keep-alive),
    so a state that lists the nonce was written in this run by a host of this run. A state
    nobody acknowledges within ``vouch_s`` (a replayed one, or one whose every host is gone:
    the host that began the run left before it saw the others' hellos) is abandoned: nothing
    of it is used, the waiting host empties the key (over that exact value) and the run
    begins afresh, so neither a replay nor an early leaver can stop the hosts that remain;
    ``vouch_s`` is longer than the keep-alive window, so a host of a live run acknowledges
    first. A state that says the run is closed is believed without this:
    a replayed one can only stop the run, which anyone who reaches the store can do anyway.
    The values torch keeps in the store beside the state (MASTER_ADDR/PORT, the agents'
    ranks) are sealed under a key of the epoch and kept under its own prefix (EpochStore).
    """

    def __init__(self, store: Any, run_id: str, anchor: str, key: bytes | None | str = "from-env",
                 vouch_s: float = 10.0) -> None:
        if not run_id:
            raise ConfigError("[rendezvous] the run id is empty; pass --rdzv-id (the same on every host)")
        self._store = store
        self._anchor = anchor
        self._run_id = run_id
        self._key = f"mccl/rdzv/{run_id}/state"
        self._hello_key = f"mccl/rdzv/{run_id}/hello"
        # torch unpickles the state it is handed: it is sealed under the run's key, and checked
        # before torch sees a byte of it.
        self._mac_key = run_store_key(run_id) if isinstance(key, str) else key
        self._vouch_s = vouch_s
        # Each write carries a version one above the newest this host read: a sealed state of
        # this very run written back later (a rollback) is older than one already seen.
        self._seen = 0
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self._epoch: bytes | None = None
        self._acks: list[bytes] = []
        self._posted = False
        self._next_hello = 1        # the first hello this host has not acknowledged yet
        self.saw_open = False       # whether this host read a state of this run that was not closed
        # Another host's refusal (libmccl/refusal.py) while this one waits for the run's first
        # round: "fail" (a fixed --nnodes: the round cannot form without it), "warn" (a range:
        # it may form without it), "off" (the run started: nothing a refusal says can stop it).
        self.refusals = "off"
        # + "/<epoch hex>": a refusal names the run it refused (the epoch of the state it could not
        # verify, read without the key), so one left in a long-lived anchor's store by an earlier
        # run of the same --rdzv-id is never read by a later one.
        self._refusal_root = f"mccl/rdzv/{run_id}/refusal"
        self._refusal_said = False
        self._refused = False
        # Named in refusals: the id of the job key this host read (jobkey.key_id), never the key.
        self._key_id = key_id(find_job_key()) if self._mac_key is not None else "none"
        self._call("compare_set", self._key, "", _EMPTY)  # creates the key unless a host already did

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def epoch(self) -> bytes | None:
        """This run's epoch once this host holds it (None before its first state)."""
        return self._epoch

    def get_state(self) -> tuple[bytes, Any] | None:
        if self.refusals != "off":
            self._check_refusal()
        decoded = self._decode(self._call("get", self._key))
        if decoded is None or self._epoch is None:
            return decoded
        return self._acknowledge(decoded)

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        # The store holds text, and the token is the encoded value itself: a write succeeds only
        # over the exact value this host last read.
        expected = token.decode() if isinstance(token, bytes) else _EMPTY
        genesis = self._epoch is None
        if genesis and isinstance(token, bytes):
            # Over a state this host read without holding the epoch (a closed one): vouched for first.
            decoded = self._decode(token)
            genesis = self._epoch is None
            if genesis:
                return None if decoded is None else (decoded[0], decoded[1], False)
        if genesis:
            self._epoch, self._acks = secrets.token_bytes(_NONCE_BYTES), [self._nonce]
        acks, upto = self._with_hellos(self._acks)
        desired = self._seal(self._seen + 1, acks, state)
        current = self._call("compare_set", self._key, expected, desired)
        if current != desired.encode() and genesis:
            self._epoch = None      # another host began the run first: vouched for by it
        elif current == desired.encode():
            self._next_hello = upto
        decoded = self._decode(current)
        if decoded is None:
            return None
        return decoded[0], decoded[1], current == desired.encode()

    def _seal(self, version: int, acks: list[bytes], state: bytes) -> str:
        assert self._epoch is not None
        head = _VERSION.pack(version) + self._epoch + _COUNT.pack(len(acks)) + b"".join(acks)
        return store_auth.seal(self._mac_key, self._key, head + state).decode()

    def _parse(self, value: bytes) -> tuple[int, bytes, list[bytes], bytes]:
        fixed = _VERSION.size + _NONCE_BYTES + _COUNT.size
        if len(value) >= fixed:
            version = _VERSION.unpack_from(value)[0]
            epoch = value[_VERSION.size:_VERSION.size + _NONCE_BYTES]
            n = _COUNT.unpack_from(value, _VERSION.size + _NONCE_BYTES)[0]
            end = fixed + n * _NONCE_BYTES
            if version > 0 and len(value) >= end:
                acks = [value[i:i + _NONCE_BYTES] for i in range(fixed, end, _NONCE_BYTES)]
                return version, epoch, acks, value[end:]
        raise RendezvousForged(
            f"[rendezvous] the state under {self._key!r} in the anchor's store is malformed, peer={self._anchor}: "
            "written by a host holding the job's key but another MCCL version; run one version on every host",
            peer_addr=self._anchor)

    def _open(self, raw: bytes) -> bytes:
        """The state's sealed value; a state this host's key does not verify is refused, and the
        refusal posted for the run's other hosts (they may be waiting on this one)."""
        try:
            return store_auth.open(self._mac_key, self._key, raw, self._anchor, error=RendezvousForged)
        except RendezvousForged as exc:
            if not self._refused:
                self._refused = True
                ours = self._key_id
                self._post_refusal(ours, raw)
                raise RendezvousForged(f"{exc} (this host's key id is {ours}; the run's other hosts were told)",
                                       peer_addr=self._anchor) from None
            raise

    def _post_refusal(self, ours: str, raw: bytes) -> None:
        """A plain refusal (this host cannot prove anything to a run whose key it lacks), then a
        bounded wait for a reader: this host may serve the anchor's store."""
        ref = refusal.Refusal("key", 0, refusal.this_host(), ours, 0, None, False)
        value = store_auth.unverified_value(raw) or b""
        if len(value) < _VERSION.size + _NONCE_BYTES:
            return      # not a state of any run: nobody to tell
        key = f"{self._refusal_root}/{value[_VERSION.size:_VERSION.size + _NONCE_BYTES].hex()}"
        try:
            self._store.set(key, refusal.encode(ref, None, key))
            _log.info("[rendezvous] posted its refusal (key) for the run's other hosts")
            deadline = time.monotonic() + _REFUSAL_LINGER_S
            while time.monotonic() < deadline and int(self._store.add(key + "/seen", 0)) < 1:
                time.sleep(_VOUCH_POLL_S)
        except Exception:  # noqa: BLE001 - the store failing too must not hide why we stop
            _log.debug("[rendezvous] could not post this host's refusal", exc_info=True)

    def _check_refusal(self) -> None:
        """Another host's refusal to join, read while this one waits for the first round."""
        if self._epoch is None:
            return      # no run yet whose refusal this host could tell from an earlier run's
        key = f"{self._refusal_root}/{self._epoch.hex()}"
        if not self._call("check", [key]):
            return
        try:
            ref = refusal.decode(self._call("get", key), None, False, key, key, self._anchor)
        except StoreAuthError as exc:
            if not self._refusal_said:
                self._refusal_said = True
                _log.warning("%s; ignored", str(exc))   # the text: a record would keep the store alive
            return
        ours = self._key_id
        text = (f"[rendezvous] run {self._run_id!r}: a host that says it is {ref.host} refused to join: the "
                f"run's state did not verify under its key, peer={self._anchor} (the anchor); likely cause: it "
                f"holds a different job key (its key id {ref.key_id}, ours {ours}); give every host the same key "
                "(MCCL_JOB_KEY_FILE or the fleet key) and restart the run. This record carries no MAC (its "
                "writer has no key of this run), so anyone who can reach the anchor could have written it")
        if self.refusals == "warn":
            if not self._refusal_said:
                self._refusal_said = True
                _log.warning("%s; this host keeps waiting for the run's other hosts (--nnodes is a range)", text)
            return
        self._call("add", key + "/seen", 1)
        raise RendezvousForged(text, peer_addr=self._anchor)

    def _decode(self, raw: bytes) -> tuple[bytes, Any] | None:
        if raw == _EMPTY.encode():
            return None
        value = self._open(raw)
        version, epoch, acks, state = self._parse(value)
        if self._epoch is None:
            if self._mac_key is not None and self._nonce not in acks:
                if _says_closed(state):
                    return state, raw
                return self._wait_for_vouch()
            self._epoch = epoch
        if epoch != self._epoch:
            raise RendezvousForged(
                f"[rendezvous] the state under {self._key!r} in the anchor's store belongs to another run of "
                f"{self._run_id!r} (another epoch), peer={self._anchor}: a state recorded in an earlier run under "
                "the same key and written back by someone who can reach the store (a replay), or a second run "
                "started with the same --rdzv-id; nothing of it was used. Restart the run with a new --rdzv-id "
                "(mcclctl run gives each run its own key) and keep the anchor's port on the training network",
                peer_addr=self._anchor)
        if version < self._seen:
            raise RendezvousForged(
                f"[rendezvous] the state under {self._key!r} in the anchor's store is version {version}, older than "
                f"version {self._seen} this host already read, peer={self._anchor}: an earlier state of this run "
                "written back by someone who can reach the store (a replay); the run cannot trust the store any "
                "more: restart it, and keep the anchor's port on the training network", peer_addr=self._anchor)
        self._seen, self._acks = version, acks
        self._note_open(state)
        return state, raw

    def _wait_for_vouch(self) -> tuple[bytes, Any] | None:
        """A host new to the run: post this host's nonce, then wait for a state that lists it."""
        if not self._posted:
            index = int(self._call("add", self._hello_key, 1))
            self._call("set", f"{self._hello_key}/{index}", self._nonce.hex())
            self._posted = True
        deadline = time.monotonic() + self._vouch_s
        while True:
            raw = self._call("get", self._key)
            if raw == _EMPTY.encode():
                return None     # emptied: this host may begin the run itself (set_state)
            value = self._open(raw)
            version, epoch, acks, state = self._parse(value)
            if self._nonce in acks:
                self._epoch = epoch
                self._seen, self._acks = version, acks
                self._note_open(state)
                return state, raw
            if time.monotonic() >= deadline:
                return self._abandon(raw)
            time.sleep(_VOUCH_POLL_S)

    def _abandon(self, raw: bytes) -> None:
        """No host vouched for ``raw``: empty the key over it, so this host (or another one
        waiting) begins the run afresh, and use nothing of it."""
        current = self._call("compare_set", self._key, raw.decode(), _EMPTY)
        if current == _EMPTY.encode():
            _log.warning(
                "[rendezvous] no host of run %r vouched for the state in the anchor's store within %gs, peer=%s: "
                "either every host that held it left (the run's first host, before it saw this one), or it was "
                "recorded in an earlier run under the same key and written back (a replay); nothing of it was "
                "used, and the run begins afresh from this host", self._run_id, self._vouch_s, self._anchor)
        # Whatever is there now (emptied, or a new state another waiting host wrote first) is
        # taken through the normal path: set_state from empty, or a vouch by that host.
        return None

    def _note_open(self, state: bytes) -> None:
        """Remembers that the run was open when this host read it (one unpickle, until it was)."""
        if not self.saw_open and not _says_closed(state):
            self.saw_open = True

    def _with_hellos(self, acks: list[bytes]) -> tuple[list[bytes], int]:
        """``acks`` plus the nonces of hellos posted since this host last acknowledged (at most
        _MAX_ACKS kept, newest last), and the index after the last hello read."""
        posted = int(self._call("add", self._hello_key, 0))
        upto = self._next_hello
        out = list(acks)
        while upto <= posted and upto < self._next_hello + _MAX_ACKS:
            name = f"{self._hello_key}/{upto}"
            if not self._call("check", [name]):
                break           # counted, not written yet: next time
            try:
                nonce = bytes.fromhex(self._call("get", name).decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                nonce = b""     # junk from someone without the key: nothing to acknowledge
            if len(nonce) == _NONCE_BYTES and nonce not in out:
                out.append(nonce)
            upto += 1
        return out[-_MAX_ACKS:], upto

    def _acknowledge(self, decoded: tuple[bytes, Any]) -> tuple[bytes, Any]:
        """As a host of the run: write the state back with the hellos posted since, if any."""
        state, raw = decoded
        acks, upto = self._with_hellos(self._acks)
        if upto == self._next_hello:
            return decoded
        if acks == self._acks:
            self._next_hello = upto
            return decoded
        desired = self._seal(self._seen + 1, acks, state)
        current = self._call("compare_set", self._key, raw.decode(), desired)
        if current != desired.encode():
            return decoded      # someone wrote first: acknowledged at the next read or write
        self._next_hello = upto
        self._seen, self._acks = self._seen + 1, acks
        return state, current

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
            raise RendezvousUnreachable(
                f"[rendezvous] lost the anchor's rendezvous store, peer={self._anchor} ({type(exc).__name__}: "
                f"{_first_line(exc)}); likely cause: the torchrun (or host) serving it exited or the network "
                "to it failed; the run cannot continue without it: restart it with the anchor on a host "
                "that stays up", peer_addr=self._anchor) from exc


def _says_closed(state: bytes) -> bool:
    """Whether torch's (sealed, so written by a key holder) state says the run is closed."""
    try:
        return bool(getattr(pickle.loads(state), "closed", False))
    except Exception:  # noqa: BLE001 - a state torch cannot read is not a closed one
        return False


class EpochStore(SealedStore):
    """The anchor's store as torch's rounds use it (MASTER_ADDR/PORT, the agents' ranks): values
    sealed under a key of the run's epoch, under a prefix of their own, so that nothing an
    earlier run left or recorded under the same names is read."""

    def __init__(self, inner: Any, backend: AnchorStoreBackend, run_key: bytes | None, anchor: str) -> None:
        super().__init__(inner, run_key, anchor, error=RendezvousForged)
        self._backend = backend
        self._bound: tuple[bytes, Any, bytes | None] | None = None

    def _scope(self) -> tuple[Any, bytes | None]:
        epoch = self._backend.epoch
        if epoch is None:
            raise RendezvousForged(f"[rendezvous] the run's store was used before this host read the run's state, "
                                   f"peer={self._peer}; this is a bug in libmccl/elastic/rdzv.py",
                                   peer_addr=self._peer)
        if self._bound is None or self._bound[0] != epoch:
            from torch.distributed import PrefixStore
            key = None if self._key is None else derive(self._key, "epoch", epoch)
            self._bound = (epoch, PrefixStore(f"mccl/rdzv/epoch/{epoch.hex()}", self.inner), key)
        return self._bound[1], self._bound[2]

    def _store(self) -> Any:
        return self._scope()[0]

    def _mac_key(self) -> bytes | None:
        return self._scope()[1]


class MCCLRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous with errors that name the anchor."""

    anchor: str = ""
    serves_anchor: bool = False
    anchor_store: Any = None
    anchor_backend: "AnchorStoreBackend | None" = None
    _last_world = 0  # hosts in the last round this one joined
    _left = False    # left the run after a drain (leave_if_drained)
    reform_file = ""         # MCCL_REFORM_FILE of this torchrun's workers
    join_at_step_s = 30.0
    _join_asked: float | None = None     # when the workers were asked to re-form for a waiting host
    _last_round: set = set()             # the hosts (torch's node descriptors) of the round joined last
    _round_store: Any = None             # that round's store (torchrun's agents meet there)
    _last_ranks: dict = {}               # that round's hosts -> their group ranks
    _said_gone: set = set()              # group ranks of that round named as gone (logged once)

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
        """The workers' store (rank 0's agent serves it; its address is the workers' MASTER_ADDR),
        on the address this host advertises only: torch's own listens on every interface."""
        try:
            return store_server.serve_store(master_addr, master_port, _WORKERS_STORE_TIMEOUT, multi_tenant=True)
        except OSError as exc:
            _log.warning("[rendezvous] cannot serve the workers' store on %s only (%s); torch serves it on every "
                         "interface, its values are authenticated", master_addr, exc)
            return super()._create_tcp_store_server(master_addr, master_port)

    def num_nodes_waiting(self) -> int:
        """torchrun's agent restarts its workers at once, mid-step, when this is above 0. Workers
        that use libmccl.elastic stop at their next step boundary by themselves, saved, when the
        reform file appears: for them report 0 until they have (at most join_at_step_s)."""
        waiting = super().num_nodes_waiting()
        if waiting == 0 and self._plain_workers_lost_a_host():
            return 1
        if waiting == 0 or not self.reform_file:
            self._join_asked = None
            return waiting
        if self._wait_list() & self._last_round:
            # A host of this very round is waiting: its workers failed (a peer died, a collective
            # timed out), so ours cannot finish their step either; restart them now. A stopped
            # worker (SIGSTOP, a debugger) would ignore torchrun's SIGTERM for its 30 s grace
            # before the SIGKILL: let it run to take the signal.
            _continue_children()
            return waiting
        if not os.path.exists(self.reform_file + AWARE_SUFFIX):
            _log.warning("[rendezvous] run %r: %d host(s) waiting to join; this job's script does not use "
                         "libmccl.elastic.ElasticState, so torchrun restarts it (from step 0 unless it "
                         "checkpoints itself)", self.settings.run_id, waiting)
            return waiting
        now = time.monotonic()
        if self._join_asked is None:
            self._join_asked = now
            try:
                open(self.reform_file, "a").close()
            except OSError as exc:
                _log.warning("[rendezvous] cannot create %s (%s): restarting the workers for the joining host",
                             self.reform_file, exc)
                return waiting
            _log.warning("[rendezvous] run %r: %d host(s) waiting to join; the workers save after this step "
                         "and re-form with them", self.settings.run_id, waiting)
        if now - self._join_asked > self.join_at_step_s:
            _log.warning("[rendezvous] run %r: the workers did not reach a step boundary within %gs "
                         "(MCCL_RDZV_JOIN_AT_STEP); restarting them for the joining host, they redo the steps "
                         "since their last save", self.settings.run_id, self.join_at_step_s)
            return waiting
        return 0

    def _plain_workers_lost_a_host(self) -> bool:
        """A host of the round this one joined left the run (its keep-alives stopped: its user
        came back and mccld removed the job, it was killed, its link cut) while the run is
        open, and the workers here do not use libmccl.elastic. torch keeps such a round going,
        and plain workers would wait for that host until their own timeout (in
        init_process_group: 60 s in tests/e2e/test_reclaim_fleet.py) before torchrun restarted them;
        restarting them now forms the smaller round at once. Workers with ElasticState re-form
        in place by themselves and are left alone."""
        if not self._last_round or self._state_field("closed"):
            return False
        gone = self._last_round - set(self._state_field("participants") or ())
        if not gone:
            return False
        if self.reform_file and os.path.exists(self.reform_file + AWARE_SUFFIX):
            return False
        _log.warning("[rendezvous] run %r: %d host(s) of this round left (%s; their keep-alives stopped); this job's "
                     "script does not use libmccl.elastic.ElasticState, so torchrun restarts its workers now in a "
                     "round without them (from step 0 unless it checkpoints itself)", self.settings.run_id, len(gone),
                     ", ".join(sorted(getattr(n, "addr", str(n)) for n in gone)))
        self._last_round = set()    # said once: the restart's rendezvous records the next round
        return True

    def next_rendezvous(self) -> Any:
        started = time.monotonic()
        # The workers of the last round stopped: a new round answers the request.
        self._join_asked = None
        _remove(self.reform_file)
        self._forget_workers_store()
        backend = self.anchor_backend
        if backend is not None and self._last_world == 0:
            s = self.settings
            backend.refusals = "fail" if s.min_nodes == s.max_nodes else "warn"
        try:
            info = super().next_rendezvous()
        except (RendezvousJoinTimeout, RendezvousClosed, RendezvousUnreachable):
            raise
        except RendezvousTimeoutError as exc:
            s = self.settings
            raise RendezvousJoinTimeout(
                f"[rendezvous] run {s.run_id!r}: fewer than {s.min_nodes} hosts joined within "
                f"{s.timeout.join.total_seconds():g}s ({self._others()}), peer={self.anchor} (the anchor); "
                "likely cause: torchrun was not started on the other hosts, or they were given another "
                "--rdzv-endpoint or --rdzv-id, or lower --nnodes; start them with the same arguments, or raise "
                "MCCL_RDZV_JOIN_TIMEOUT (join_timeout)", peer_addr=self.anchor) from exc
        except RendezvousClosedError as exc:
            if self._ended_before_taken_in():
                # mcclctl run recruited this host during the run's last steps: it waited for the
                # next round, and the run finished first. Nothing failed here; exiting 1 made
                # mcclctl report a job that ran every step as failed (torch's own graceful exit,
                # RendezvousGracefulExitError, ends torchrun with an AttributeError in 2.13).
                _log.warning("[rendezvous] run %r ended before this host was taken in (it waited for the next "
                             "round, the run's hosts finished or gave up first, peer=%s); nothing ran here, so "
                             "this torchrun exits 0", self.settings.run_id, self.anchor)
                raise SystemExit(0) from None
            raise RendezvousClosed(
                f"[rendezvous] run {self.settings.run_id!r} is closed, peer={self.anchor} (the anchor): a torchrun "
                "of this run finished or gave up, which ends the run for every host; start a new run with a "
                "new --rdzv-id", peer_addr=self.anchor) from exc
        if backend is not None:
            backend.refusals = "off"    # the run started: no refusal stops it
        self._last_world = info.world_size
        self._round_store = info.store
        self._last_ranks = dict(self._state_field("participants") or {})
        self._last_round = set(self._last_ranks)
        if info.rank == 0 and os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1":
            _republish_workers_store(info)
        _log.info("[rendezvous] run %r: rank %d of %d hosts, advertising %s, in %.2fs (anchor %s%s)",
                  self.settings.run_id, info.rank, info.world_size, self._this_node.addr,
                  time.monotonic() - started, self.anchor, ", served here" if self.serves_anchor else "")
        # The agents assign their workers' ranks through this store next: a host leaving in
        # that moment must not stop every torchrun (assign_store.py says how).
        store = AssignmentStore(info.store, info.world_size, self._ranks_gone, self._assignment_timeout)
        return RendezvousInfo(store, info.rank, info.world_size, info.bootstrap_store_info)

    def _ranks_gone(self) -> set[int]:
        """Group ranks of the round joined last whose hosts have left it (keep-alives stopped)."""
        with self._heartbeat_lock:
            self._state_holder.sync()
        now = self._state_field("participants") or {}
        gone = {rank for node, rank in self._last_ranks.items() if node not in now}
        if gone and gone != self._said_gone:
            self._said_gone = gone
            _log.warning("[rendezvous] run %r: host(s) of group rank %s left while torchrun's agents assigned the "
                         "workers' ranks; the workers start without them and torchrun restarts them in a round "
                         "without those hosts", self.settings.run_id, sorted(gone))
        return gone

    def _assignment_timeout(self, what: str) -> Exception:
        return RendezvousJoinTimeout(
            f"[rendezvous] run {self.settings.run_id!r}: {what}, peer={self.anchor} (the anchor); likely cause: "
            "a host of the round stopped without leaving it (its keep-alives still arrive), or the anchor's "
            "store is overloaded; start the run again, or raise MCCL_RDZV_STORE_TIMEOUT (read_timeout)",
            peer_addr=self.anchor)

    def _ended_before_taken_in(self) -> bool:
        """This torchrun never joined a round, yet found the run open at first: it closed while
        this host waited (a run closed before the host came is a reused --rdzv-id: an error)."""
        return self._last_world == 0 and self.anchor_backend is not None and self.anchor_backend.saw_open

    def _forget_workers_store(self) -> None:
        """torch keeps the workers' store address of this handler's first round: a host that
        was not rank 0 then reads it once and uses it in every later round. When that round's
        rank 0 left (its user came back and mccld removed the job), its store is gone, or it
        now runs a store nobody else uses: the workers of the next rounds waited in
        init_process_group on two different stores, timed out, and restarted into the same
        split again and again (issue 25: a host reclaimed while the first round's workers
        started). Forgetting it makes every round's rank 0 serve a store and publish it, and
        every other host read it again (private torch fields: absent on other versions)."""
        if hasattr(self, "_bootstrap_store_info"):
            self._bootstrap_store_info = None
        if hasattr(self, "_shared_tcp_store_server"):
            self._shared_tcp_store_server = None

    def shutdown(self) -> bool:
        _remove(self.reform_file)
        _remove(self.reform_file + AWARE_SUFFIX if self.reform_file else "")
        if self.leave_if_drained():
            return True     # this host left the run; closing it would end it for the others
        closed = super().shutdown()
        self._linger_for_peers()
        return closed

    def leave_if_drained(self) -> bool:
        """When mccld drained this host (its user is back: the job's MCCL_DRAIN_FILE exists) and
        the ranks here saved and left, take this host out of the run's participants now, so the
        others' next round does not wait the keep-alive window for it. mccld stops this torchrun
        with SIGTERM, after which torch shuts nothing down itself: this runs at exit."""
        drain = os.environ.get(DRAIN_ENV, "")
        if not drain or not os.path.exists(drain) or self._left:
            return False
        self._left = True
        try:
            # torch's own "leave the previous round" step of next_rendezvous (private API).
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp
            self._stop_heartbeats()
            self._op_executor.run(_RendezvousExitOp(), time.monotonic() + self.settings.timeout.close.total_seconds())
            self._check_in_at_exit_barrier()
            _log.warning("[rendezvous] run %r: this host left (drained); the others re-form without it",
                         self.settings.run_id)
            return True
        except Exception as exc:  # noqa: BLE001 - at exit: the keep-alive expiry drops us anyway
            _log.warning("[rendezvous] run %r: could not leave the run cleanly (%s); the others drop this host "
                         "when its keep-alives stop", self.settings.run_id, _first_line(exc))
            return False

    def _check_in_at_exit_barrier(self) -> None:
        """Counts this host in at the round's exit barrier, where torchrun's agents wait for one
        another when their workers end. The others' workers may finish the run in this round
        without a restart (ElasticState(keep_workers=True) re-forms in place), and their agents
        then wait for as many hosts as the round began with: this one, stopped by mccld before
        it got there, would hold them the barrier's 300 s (measured: the job's end waited until
        mcclctl recruited the host again). If this host's agent did count itself in before its
        SIGTERM, the count runs one ahead and the barrier opens as the last host but one arrives:
        that host's agent then ends a moment before the last one, which only waits for its
        workers (the anchor's store waits for everyone, _linger_for_peers)."""
        if self._round_store is None:
            return
        try:    # torch's own names (private): the agent's key and the non-waiting half of its barrier
            from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
            from torch.distributed.elastic.utils.store import _barrier_nonblocking
            _barrier_nonblocking(self._round_store, self._last_world, _TERMINAL_STATE_SYNC_ID)
        except Exception as exc:  # noqa: BLE001 - at exit: the others then wait out their barrier
            _log.warning("[rendezvous] run %r: could not count this host out at the exit barrier (%s); "
                         "the other hosts' torchruns may wait up to 300 s when the job ends",
                         self.settings.run_id, _first_line(exc))

    def _linger_for_peers(self) -> None:
        """Every host counts itself out once it has closed the run; the host serving the store
        waits (at most the close timeout) for the others of the last round, since its store
        ends with its process and a host still closing would get a broken pipe and a stack
        dump at the end of a run that went fine. A dead host costs that wait."""
        if self._last_world == 0:
            return      # in no round (it ended before this host was taken in): not one the anchor waits for
        key = f"mccl/rdzv/{self.settings.run_id}/shut_down"
        try:
            done = int(self.anchor_store.add(key, 1))
            if not self.serves_anchor:
                return
            deadline = time.monotonic() + self.settings.timeout.close.total_seconds()
            while done < self._last_world and time.monotonic() < deadline:
                time.sleep(_LINGER_POLL_S)
                done = int(self.anchor_store.add(key, 0))
            if done < self._last_world:
                _log.warning("[rendezvous] run %r: %d of the last round's %d hosts had not shut down after %gs; "
                             "stopping the anchor's store anyway", self.settings.run_id, self._last_world - done,
                             self._last_world, self.settings.timeout.close.total_seconds())
        except (RuntimeError, ValueError, OSError) as exc:  # the anchor already gone: nothing to wait for
            _log.debug("[rendezvous] could not count this host out at the anchor %s: %s", self.anchor, exc)

    def _state_field(self, name: str) -> Any:
        """A field of torch's rendezvous state (private: None if its shape changed)."""
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        value = getattr(state, name, None)
        return value if isinstance(value, (dict, set)) else None

    def _wait_list(self) -> set:
        return set(self._state_field("wait_list") or ())

    def _others(self) -> str:
        """Which other hosts had joined, from torch's state object when it has the expected shape."""
        participants = self._state_field("participants")
        if not isinstance(participants, dict):
            return "this one among them"
        others = sorted(str(getattr(n, "addr", n)) for n in participants if n != self._this_node)
        return f"this one and {len(others)} other{'s' if len(others) != 1 else ''}" + (
            f": {', '.join(others[:8])}" if others else "")


def create_handler(params: RendezvousParameters) -> MCCLRendezvousHandler:
    """Build this host's handler: reach (or serve) the anchor's store, pick the advertised address."""
    cfg = load(RendezvousConfig)
    opts = RunOptions.parse(params, cfg)
    host, port = anchor_endpoint(params.endpoint, cfg)
    store, serving = open_anchor_store(host, port, opts.is_host, opts.store_timeout_s)
    anchor = f"{host}:{port}"
    mac_key = run_store_key(params.run_id)
    # A host of the run acknowledges a newcomer at its next read or keep-alive: the newcomer
    # waits that long, and at most a keep-alive window, after which a silent host is dead too.
    vouch_s = max(opts.heartbeat_s * opts.heartbeat_misses, _MIN_KEEP_ALIVE_WINDOW_S) + 1.0
    backend = AnchorStoreBackend(store, params.run_id, anchor, mac_key, vouch_s=vouch_s)
    # torch's rounds read MASTER_ADDR/PORT and the agents their ranks from this store: sealed
    # too, under the run's epoch.
    sealed = EpochStore(store, backend, mac_key, anchor)
    local_addr = params.local_addr or listen_addr.choose_bind_address(load(EngineConfig), host)
    timeout = RendezvousTimeout(join=timedelta(seconds=opts.join_timeout_s),
                                last_call=timedelta(seconds=opts.last_call_s),
                                close=timedelta(seconds=opts.close_timeout_s),
                                heartbeat=timedelta(seconds=opts.store_timeout_s))
    keep_alive = {"keep_alive_interval": opts.heartbeat_s, "keep_alive_max_attempt": opts.heartbeat_misses}
    accepted = inspect.signature(DynamicRendezvousHandler.from_backend).parameters
    if not all(k in accepted for k in keep_alive):
        _log.warning("[rendezvous] this torch does not take a keep-alive interval; a dead host is dropped "
                     "after torch's default (15 s) instead of MCCL_RDZV_HEARTBEAT x MCCL_RDZV_HEARTBEAT_MISSES")
        keep_alive = {}
    handler = MCCLRendezvousHandler.from_backend(params.run_id, sealed, backend, params.min_nodes, params.max_nodes,
                                                 local_addr, timeout, **keep_alive)
    handler.anchor = anchor
    handler.serves_anchor = serving
    handler.anchor_store = store
    handler.anchor_backend = backend
    handler.join_at_step_s = opts.join_at_step_s
    # The workers torchrun starts inherit this environment: the file they watch for a joining host.
    handler.reform_file = os.environ.setdefault(
        REFORM_ENV, os.path.join(tempfile.gettempdir(), f"mccl-reform-{os.getuid()}-{os.getpid()}"))
    ref = weakref.ref(handler)
    atexit.register(lambda: (h := ref()) is not None and h.leave_if_drained())
    return handler


def serve_anchor(port: int, stop: threading.Event, timeout_s: float, bind: str = "") -> None:
    """Serve the rendezvous store on ``port`` until ``stop`` is set: an anchor that runs no
    training of its own, so no torchrun's end takes the store with it (every torchrun then
    passes ``--rdzv-conf is_host=0``). A run closed in it stays closed: give each run a new
    --rdzv-id. ``bind``: the one address to serve on (the training network's), else every one.
    The anchor needs no key: it keeps the values, the hosts seal and check them."""
    from torch.distributed import TCPStore

    try:
        if bind:
            store = store_server.serve_store(bind, port, timedelta(seconds=timeout_s))
        else:
            store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as exc:
        raise ConfigError(f"[rendezvous] cannot serve the rendezvous store on port {port}: {_first_line(exc)}; "
                          "likely cause: another process holds the port; free it or pick another") from exc
    try:
        _log.info("[rendezvous] serving the rendezvous store on port %d; point every torchrun at this host "
                     "with --rdzv-endpoint HOST:%d --rdzv-conf is_host=0", store.port, store.port)
        stop.wait()
    finally:
        del store


def main(argv: list[str] | None = None) -> int:
    """``python -m libmccl.elastic.rdzv [--port N]``: serve an anchor's store until SIGTERM or ^C."""
    import argparse
    import signal

    cfg = load(RendezvousConfig)
    default_port = anchor_endpoint("", cfg)[1] if cfg.anchor else DEFAULT_PORT
    ap = argparse.ArgumentParser(prog="python -m libmccl.elastic.rdzv", description=main.__doc__)
    ap.add_argument("--port", type=int, default=default_port,
                    help=f"TCP port (default: MCCL_RDZV_ANCHOR's, else {DEFAULT_PORT})")
    ap.add_argument("--bind", default="", help="serve on this address only (default: every interface)")
    ap.add_argument("--parent", type=int, default=0,
                    help="stop when the process with this pid is no longer this one's parent (mcclctl run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent:
        # An orphaned anchor would keep its port and serve a run nobody submits any more.
        def watch_parent() -> None:
            while not stop.wait(_PARENT_POLL_S):
                if os.getppid() != args.parent:
                    _log.warning("[rendezvous] the process that started this anchor (pid %d) is gone; stopping",
                                 args.parent)
                    stop.set()
        threading.Thread(target=watch_parent, name="mccl-anchor-parent", daemon=True).start()
    try:
        serve_anchor(args.port, stop, cfg.store_timeout_s, args.bind)
    except ConfigError as exc:
        _log.error("%s", exc)
        return 2
    return 0


__all__ = ["AnchorStoreBackend", "EpochStore", "MCCLRendezvousHandler", "RendezvousClosed", "RendezvousJoinTimeout",
           "RendezvousForged", "RendezvousUnreachable", "RunOptions", "anchor_endpoint", "create_handler",
           "open_anchor_store", "serve_anchor"]


if __name__ == "__main__":
    raise SystemExit(main())
