"""The synchronous start of a daemon-mode rank: hello to the local mccld (proving it can
read the daemon's token), publish (host id, daemon link address) in the c10d store, and
join the job. It runs before the communicator's I/O thread exists, so each request is a
plain send-and-wait on the DEALER socket, bounded by its timeout; afterwards the socket
belongs to the I/O thread.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from mccl_common import attach_protocol as protocol
from mccl_common import localtrust
from mccl_common.daemon_settings import DaemonConfig, runtime_dir_owners
from mccl_common.settings import load
from mccl_common.errors import AuthError, CollectiveTimeout, ConfigError, DaemonUnavailableError, ProtocolError

from .. import listen_addr, refusal, rendezvous

_log = logging.getLogger(__name__)
_HELLO_TIMEOUT_S = 5.0
# A rank whose mccld could not link to another host's posts why here (in the comm's sealed
# store); the others look every _REFUSAL_POLL_S while they wait for their own mccld's join.
_REFUSED_KEY = "mccld/refused"
_REFUSAL_POLL_S = 1.0
_MAX_CUT_BYTES = 1 << 40   # a piece size beyond any buffer: a reply past it is garbage
LAUNCHD_SERVICE = "system/com.mccl.mccld"   # the domain and label packaging/macos/install.sh installs
# pyzmq names a monitor's inproc endpoint after the socket's fd unless told otherwise; a
# closed socket's endpoint is released later by ZeroMQ's reaper, so a new socket that got
# the same fd number failed with "Address already in use" (seen in the fuzz replay).
_MONITOR_IDS = itertools.count()
_LOOPBACK_ADVICE = ("Likely cause: MCCL_LISTEN_ADDR or MCCL_IFACE set to loopback for that host's mccld; set "
                    "MCCL_IFACE to the training network's interface, or MCCL_LISTEN_ADDR to the host's address "
                    "on it, and restart that mccld")


def _engine_cut(cut: Any, endpoint: str) -> dict[str, int]:
    """The hello reply's ``engine_cut``, checked: byte counts, or {} from an mccld too old to say."""
    if cut is None:
        return {}
    keys = ("pipeline_bytes", "small_allreduce_bytes")
    if (not isinstance(cut, dict) or set(cut) != set(keys)
            or any(not isinstance(cut[k], int) or isinstance(cut[k], bool) or not 0 <= cut[k] <= _MAX_CUT_BYTES
                   for k in keys)):
        raise ProtocolError(f"[daemon-client] mccld at {endpoint} answered hello with engine_cut={cut!r}, not "
                            f"{' and '.join(keys)} in bytes; likely cause: an mccld of another version; restart "
                            "mccld from this installation")
    return {k: cut[k] for k in keys}


def _same_compression(members: list[dict[str, Any]], rank: int, job: str, mine: str) -> None:
    """Every rank of the job compresses alike, or none starts: a ConfigError naming both settings
    (mixed, one host would encode what another reads as float32)."""
    for r, m in enumerate(members):
        theirs = m.get("compression", "MCCL_COMPRESSION=off")
        if not isinstance(theirs, str):
            raise ConfigError(f"[daemon-client] job {job}: rank {r} published compression {theirs!r}, not text; "
                              "its libmccl speaks another release")
        if theirs != mine:
            raise ConfigError(f"[daemon-client] job {job}: rank {rank} runs with {mine}, rank {r} with "
                              f"{theirs[:200]}; every rank of a job must use the same compression settings: set "
                              "MCCL_COMPRESSION* (or Options(compression=...)) alike in every training process",
                              peer_rank=r)


class Attachment:
    def __init__(self, rdir: Path, rank: int, size: int, timeout_s: float):
        self._rdir = rdir
        self.endpoint = protocol.endpoint(rdir)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.req = 0                       # last request id used; the I/O thread continues from it
        self.host_id = self.daemon_addr = ""
        self.switch = ""                   # the daemon's switch, "" when it knows none
        self.link_addrs: list[str] = []    # every rank's daemon link address
        self.engine_cut: dict[str, int] = {}  # the daemon engine's pipeline_bytes, small_allreduce_bytes
        self.daemon_uid = -1                # the daemon's user, as the kernel reported it
        self._peer: str | None = None      # libzmq's Peer-Address of the last reply: the daemon's credentials
        self._warned_refusal = False
        self._told: BaseException | None = None   # another rank's refusal, raised by _check_refused

    def close(self) -> None:
        for s in (self.monitor, self.sock):
            if s is not None:
                s.close(0)
        self.monitor = self.sock = None

    def unavailable(self, why: str) -> DaemonUnavailableError:
        # packaging/macos installs mccld as a system daemon (LaunchDaemons), not a per-user agent.
        return DaemonUnavailableError(
            f"[daemon] no mccld answers at {self.endpoint} ({why}); start it with `mccld` "
            "(the installed service: `sudo systemctl start mccld` on Linux, "
            f"`sudo launchctl kickstart {LAUNCHD_SERVICE}` on macOS), check "
            "MCCL_RUNTIME_DIR matches the daemon's, or unset MCCL_DAEMON to run in-process")

    def connect(self) -> None:
        # mccld proves itself before the client says anything: the runtime dir is one only the
        # daemon's user controls, and the kernel says that user listens on its socket.
        try:
            self.daemon_uid = localtrust.verify_daemon(
                self._rdir, runtime_dir_owners(load(DaemonConfig), self._rdir), protocol.SOCKET_NAME)
        except DaemonUnavailableError:
            raise self.unavailable("nothing listens on its socket") from None
        try:
            token = (self._rdir / protocol.TOKEN_NAME).read_text().strip()
        except OSError as e:
            raise self.unavailable(f"cannot read its token: {e.strerror}") from None
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        # Heartbeats make a wedged (stopped) daemon look like a dead one within ~3 intervals.
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        self.monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED,
                                            addr=f"inproc://mccl-monitor-{os.getpid()}-{next(_MONITOR_IDS)}")
        s.connect(self.endpoint)
        self.sock = s
        reply = self.call({"type": "hello", "token": token, "pid": os.getpid()}, _HELLO_TIMEOUT_S,
                          unavailable="it did not answer hello")
        localtrust.check_reply_peer(self._peer, self.daemon_uid, self.endpoint)
        self.host_id, self.daemon_addr = reply["host_id"], reply["link_addr"]
        self.switch = str(reply.get("switch") or "")  # the daemon's switch (mccld/net/topology.py)
        self.engine_cut = _engine_cut(reply.get("engine_cut"), self.endpoint)

    def call(self, msg: dict[str, Any], timeout_s: float, unavailable: str | None = None,
             watch: Callable[[], None] | None = None) -> dict[str, Any]:
        """Send ``msg`` and wait for its reply; ``watch()``, if given, runs about every second
        of the wait and may raise to end it."""
        self.req += 1
        req = self.req
        self.sock.send(protocol.encode({**msg, "req": req}))
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if watch is not None and left > _REFUSAL_POLL_S:
                events = dict(poller.poll(int(_REFUSAL_POLL_S * 1000)))
                if not events:
                    watch()
                    continue
            else:
                events = dict(poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if self.monitor in events:
                ev = parse_monitor_message(self.monitor.recv_multipart())
                if ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    raise self.unavailable(f"it went away during {msg['type']}")
                continue
            if self.sock not in events:
                if unavailable:
                    raise self.unavailable(unavailable)
                raise CollectiveTimeout(f"[daemon-client] Timed out after {timeout_s:.0f}s: mccld did not "
                                        f"answer {msg['type']} (rank {self.rank}); other ranks of the job "
                                        "may not have started, or the daemon is overloaded")
            frame = self.sock.recv(copy=False)
            self._peer = frame.get("Peer-Address")
            reply = protocol.decode_reply(frame.bytes)
            if reply["req"] == -1 and not reply.get("ok"):
                raise protocol.error_from_payload(reply.get("error") or {})   # refused whatever it sent
            if reply["req"] != req:
                continue  # a late reply to an earlier request that timed out
            if not reply.get("ok"):
                raise protocol.error_from_payload(reply.get("error") or {})
            return reply

    def join(self, store: Any, job: str, opts: dict[str, Any] | None = None,
             compression: protocol.Compression = protocol.NO_COMPRESSION) -> None:
        """Members publish (host id, daemon link address, compression) in the store; the daemons
        do the rest. ``opts``: this rank's extras for its daemon (its small-op queue)."""
        me = json.dumps({"host_id": self.host_id, "link_addr": self.daemon_addr, "switch": self.switch,
                         "compression": str(compression)})
        store.set(f"mccld/member/{self.rank}", me)
        keys = [f"mccld/member/{r}" for r in range(self.size)]
        # The other ranks publish once they reached their own mccld: seconds apart under load.
        setup_s = protocol.setup_timeout(self.timeout_s)
        try:
            store.wait(keys, datetime.timedelta(seconds=setup_s))
        except Exception as e:  # torch raises DistStoreError (a RuntimeError) on timeout
            raise CollectiveTimeout(f"[daemon-client] Timed out after {setup_s:.0f}s on rank {self.rank}: "
                                    f"not every rank published its daemon ({e}); a rank did not start or cannot "
                                    "reach its mccld") from None
        members = [json.loads(store.get(k)) for k in keys]
        hosts: dict[str, dict[str, Any]] = {}
        for r, m in enumerate(members):
            h = hosts.setdefault(m["host_id"], {"host_id": m["host_id"], "link_addr": m["link_addr"],
                                                "switch": str(m.get("switch") or ""), "ranks": []})
            h["ranks"].append(r)
        ordered = sorted(hosts.values(), key=lambda h: h["ranks"][0])
        self.link_addrs = [m["link_addr"] for m in members]
        try:
            listen_addr.check_no_loopback_mix(self.link_addrs, self.rank, f"[daemon-client] job {job}",
                                              _LOOPBACK_ADVICE, of="'s mccld")
            _same_compression(members, self.rank, job, str(compression))
        except ConfigError:
            rendezvous.linger(store, "mccld", self.rank, self.size, self.timeout_s)
            raise
        try:
            reply = self.call({"type": "join", "job": job, "rank": self.rank, "size": self.size, "hosts": ordered,
                               "timeout_s": self.timeout_s, "opts": opts or {}, **compression.join_fields()},
                              setup_s + 5.0, watch=lambda: self._check_refused(store, job))
        except AuthError as exc:
            if exc is self._told:
                rendezvous.linger(store, _REFUSED_KEY, self.rank, self.size, self.timeout_s)
                raise
            # Our mccld could not link to another host's (fleet key, MCCL_FLEET, version): the
            # other ranks wait on their own mcclds until their set-up timeout unless told.
            self._post_refused(store)
            raise
        if len(hosts) > 1 and reply.get("compression", "off") != compression.codec:
            # An mccld of an older release ignores the field: the job would run exact, silently.
            raise ConfigError(f"[daemon-client] job {job}: mccld at {self.endpoint} runs it with compression "
                              f"{reply.get('compression', 'off')!r}, not {compression.codec!r} as asked; likely "
                              "cause: an mccld of an older release; restart mccld from this installation")

    def _post_refused(self, store: Any) -> None:
        """``store`` is the comm's SealedStore (rendezvous.exchange): the record is sealed under
        the comm id's key, so only a rank of this run can post one."""
        ref = refusal.Refusal("daemon_link", self.rank, self.host_id or refusal.this_host(), "none", self.size,
                              None, True)
        try:
            store.set(_REFUSED_KEY, refusal.encode_body(ref))
        except Exception:  # noqa: BLE001 - the store failing too must not hide why we stop
            return
        _log.info("[daemon-client] rank %d posted its refusal (daemon_link) for its peers", self.rank)
        rendezvous.linger(store, _REFUSED_KEY, self.rank, self.size, self.timeout_s)

    def _check_refused(self, store: Any, job: str) -> None:
        """While this rank waits for its join: another rank's refusal ends the wait with its cause.
        A record that does not verify is said once and otherwise ignored: it is not a rank's."""
        try:
            if not store.check([_REFUSED_KEY]):
                return
            body = store.get(_REFUSED_KEY)
            ref = refusal.decode_body(bytes(body), True, _REFUSED_KEY, self.endpoint)
        except Exception as exc:  # noqa: BLE001 - a forged record, or the store going away mid-read
            if not self._warned_refusal:
                self._warned_refusal = True
                _log.warning("[daemon-client] rank %d ignored the refusal record under %r: %s", self.rank,
                             _REFUSED_KEY, str(exc))
            return
        self._told = refusal.error_for(ref, self.rank, self.size, f"job {job}", "none",
                                getattr(store, "_peer", None) or "the c10d store")
        raise self._told
