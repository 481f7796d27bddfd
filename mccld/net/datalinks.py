"""The daemon's pool of data sockets to its peer daemons, on which the engine
communicators of multi-host jobs run.

A data socket is a TCP connection to a peer daemon's link port that passed the fleet-key
handshake (auth.py) with the purpose "data:<id>"; both daemons know it by that id. A
peer without the key never gets one: the handshake refuses it (links.py logs that).
Sockets are dialled the first time a job needs them and reused by later jobs:

  lease   For each host pair of a job, the daemon with the lower host id proposes
          ``sockets_per_peer`` ids over the control link: idle sockets (polled first: EOF,
          an error or stray bytes mean the peer dropped it) and newly dialled ones for the
          rest. The other side claims them, waiting a little for ones still being accepted
          or still held by a closing job, and acks, naming those it no longer holds; the
          proposer replaces those and proposes again. One proposer per pair, whatever the
          job, so two jobs can never claim a socket from opposite ends.
  engine  The job's communicator is built on the leased fds; the engine dup()s them and
          runs its own Hello handshake, so comm id, ranks and options are checked per job.
  return  A clean engine shutdown (BYE read both ways) puts them back as idle; anything
          else (abort, failure, a late peer) closes them, and the peer, whose own shutdown
          then fails too, closes its end.

At set-up a job leases only the hosts its engine's whole-world algorithms use; any other
host's sockets are leased mid-job, when the engine first sends there, by the same
proposal and claim run in the background (ondemand.py); they join the job's lease.
"""

from __future__ import annotations

import collections
import logging
import secrets
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mccl_common.errors import CollectiveTimeout, MCCLError, ProtocolError

from .links import LinkManager, bound_dead_link
from .ondemand import TYPES as ON_DEMAND_TYPES, OnDemand

log = logging.getLogger(__name__)

_MAX_ROUNDS = 4               # proposals per host pair and job before giving up
_TOMBSTONES = 4096            # ids remembered as discarded (answered "missing" at once)
_IDLE_PER_PEER_FACTOR = 4     # idle sockets kept per peer: this many jobs' worth


@dataclass
class DataSocket:
    id: str
    peer_host: str
    sock: socket.socket
    dialled: bool                 # we dialled it (we are the proposer for this peer)
    job: str | None = None        # the job leasing it; None while idle in the pool
    uses: int = 0                 # jobs it served

    def silent(self) -> bool:
        """An idle socket must have nothing to read: EOF, an error or stray bytes mean it is unusable."""
        p = select.poll()
        p.register(self.sock.fileno(), select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
        return not p.poll(0)


class DataLinks:
    """Owns every data socket of the daemon; ``start``/``stop``/``abort``."""

    def __init__(self, links: LinkManager, sockets_per_peer: int, timeout_s: float):
        self._links = links
        self.host_id = links.host_id
        self.k = sockets_per_peer
        self._timeout = timeout_s          # dialling one socket; waiting for one being accepted or returned
        self._cv = threading.Condition()
        self._socks: dict[str, DataSocket] = {}
        self._leases: dict[str, list[DataSocket]] = {}            # job -> its sockets
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._mail: dict[tuple[str, str, str], tuple[dict[str, Any], float]] = {}
        self._counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._prefix = secrets.token_hex(4)   # ids stay unique across restarts of this daemon
        self._next = 0
        self._running = False
        self.on_demand = OnDemand(self, links)

    @property
    def timeout_s(self) -> float:
        return self._timeout

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "DataLinks":
        with self._cv:
            self._running = True
        self._links.on_data = self._adopt_accepted
        self.on_demand.start()
        return self

    def stop(self) -> None:
        self._links.on_data = None
        with self._cv:
            self._running = False   # first: a claim waiting on the pool gives up at once
            self._cv.notify_all()
        self.on_demand.stop()
        with self._cv:
            for s in list(self._socks.values()):
                self._discard(s, "the daemon is stopping")
            self._leases.clear()
            self._mail.clear()
            self._cv.notify_all()

    def abort(self, reason: str) -> None:
        log.warning("[datalinks] dropping every data socket: %s", reason)
        self.stop()

    # -- jobs ----------------------------------------------------------------------------------
    def lease(self, job: str, peers: list[tuple[int, str, str]], deadline: float,
              failed: Callable[[], MCCLError | None]) -> dict[int, list[DataSocket]]:
        """K agreed sockets per peer host (``(host rank, host id, link address)``), keyed by host rank.

        Each pair is negotiated on its own thread (a host waits on several peers at once).
        On any error every socket obtained so far is closed and the error raised."""
        got: dict[int, list[DataSocket]] = {}
        errors: list[BaseException] = []
        abandoned = False   # set (under the lock) once the caller stopped waiting

        def one(rank: int, peer_host: str, addr: str) -> None:
            try:
                if self.host_id < peer_host:
                    socks = self._propose(job, peer_host, addr, deadline, failed)
                else:
                    socks = self._accept(job, peer_host, addr, deadline, failed)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
                return
            with self._cv:
                if not abandoned:
                    got[rank] = socks
                    return
                for s in socks:    # too late for the job: nobody would ever give these back
                    self._discard(s, f"job {job} stopped waiting for them", kill=True)

        threads = [threading.Thread(target=one, args=p, name=f"mccld-lease-{job}", daemon=True) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + self._timeout + 1.0)
        with self._cv:
            abandoned = True
            self._leases[job] = [s for socks in got.values() for s in socks]
        if errors or len(got) != len(peers):
            self.give_back(job, clean=False)
            raise errors[0] if errors else CollectiveTimeout(
                f"[datalinks] Timed out in job {job}: agreeing on data sockets did not finish")
        return got

    def give_back(self, job: str, clean: bool) -> None:
        """The job's engine is shut down: keep its sockets if they ended clean, else close them."""
        self.on_demand.detach(job)
        with self._cv:
            socks = self._leases.pop(job, [])
            for s in socks:
                if self._socks.get(s.id) is not s:
                    continue
                idle = sum(1 for o in self._socks.values() if o.peer_host == s.peer_host and o.job is None)
                if clean and self._running and idle < self.k * _IDLE_PER_PEER_FACTOR:
                    s.job = None
                else:
                    self._discard(s, f"job {job} ended {'clean' if clean else 'unclean'}", kill=not clean)
            self._cv.notify_all()
        if socks:
            log.debug("job %s: %d data socket(s) %s", job, len(socks), "back in the pool" if clean else "closed")

    def sweep(self) -> int:
        """Close idle sockets that saw EOF or stray bytes (the daemon's periodic check calls this):
        the peer drops its end after an unclean job end, and only the proposer would otherwise notice."""
        self.on_demand.sweep()
        with self._cv:
            dead = [s for s in self._socks.values() if s.job is None and not s.silent()]
            for s in dead:
                self._discard(s, "it saw EOF or stray bytes while idle")
            if dead:
                self._cv.notify_all()
            return len(dead)

    def on_message(self, peer_host: str, msg: dict[str, Any]) -> None:
        """A ``data_lease`` or ``data_ack`` from the control link's reader: filed for the job's thread
        (set-up), or the mid-job protocol's (``lazy``, ``data_want``, ``data_refused``: ondemand.py)."""
        if msg.get("lazy") is True or msg.get("type") in ON_DEMAND_TYPES:
            self.on_demand.on_message(peer_host, msg)
            return
        job = msg.get("job")
        if not isinstance(job, str) or not isinstance(msg.get("round"), int):
            raise ProtocolError(f"[datalinks] malformed {msg.get('type')} from {peer_host}: {msg}")
        now = time.monotonic()
        with self._cv:
            for key in [k for k, (_, t) in self._mail.items() if now - t > 600]:
                del self._mail[key]   # a job that never came to collect them
            self._mail[(job, peer_host, msg["type"])] = (msg, now)
            self._cv.notify_all()

    def status(self) -> list[dict[str, Any]]:
        with self._cv:
            peers = sorted({s.peer_host for s in self._socks.values()} | set(self._counts))
            out = []
            for peer in peers:
                mine = [s for s in self._socks.values() if s.peer_host == peer]
                out.append({"host": peer, "idle": sum(s.job is None for s in mine),
                            "leased": sum(s.job is not None for s in mine),
                            "ids": sorted(s.id for s in mine), "uses": sum(s.uses for s in mine),
                            **{k: self._counts[peer][k] for k in ("dialled", "accepted", "discarded")}})
            return out

    # -- negotiation ---------------------------------------------------------------------------
    def _propose(self, job: str, peer_host: str, addr: str, deadline: float,
                 failed: Callable[[], MCCLError | None]) -> list[DataSocket]:
        held: list[DataSocket] = []
        for rnd in range(_MAX_ROUNDS):
            held += self.take(job, peer_host, addr, self.k - len(held))
            self._links.send(addr, {"type": "data_lease", "job": job, "round": rnd, "ids": [s.id for s in held]})
            ack = self._wait_mail((job, peer_host, "data_ack"), rnd, deadline, failed)
            missing = set(ack.get("missing") or [])
            if not missing:
                return held
            with self._cv:
                for s in held:
                    if s.id in missing:
                        self._discard(s, f"{peer_host} no longer holds it")
            held = [s for s in held if s.id not in missing]
        raise ProtocolError(f"[datalinks] job {job}: {peer_host} refused {_MAX_ROUNDS} proposals of data sockets; "
                            "its pool keeps losing them (network flapping?); check the link, then restart the job")

    def _accept(self, job: str, peer_host: str, addr: str, deadline: float,
                failed: Callable[[], MCCLError | None]) -> list[DataSocket]:
        for _ in range(_MAX_ROUNDS):
            prop = self._wait_mail((job, peer_host, "data_lease"), None, deadline, failed)
            ids = prop.get("ids")
            if not (isinstance(ids, list) and len(ids) == self.k and all(isinstance(i, str) for i in ids)):
                raise ProtocolError(f"[datalinks] job {job}: {peer_host} proposed data sockets {ids!r}; expected "
                                    f"{self.k} ids; set MCCL_SOCKETS_PER_PEER the same on every host")
            held, missing = self._claim(job, peer_host, ids, min(deadline, time.monotonic() + self._timeout))
            self._links.send(addr, {"type": "data_ack", "job": job, "round": prop["round"], "missing": missing})
            if not missing:
                return held
        raise ProtocolError(f"[datalinks] job {job}: no usable set of data sockets from {peer_host} after "
                            f"{_MAX_ROUNDS} proposals; check the network between the hosts, then restart the job")

    def _wait_mail(self, key: tuple[str, str, str], rnd: int | None, deadline: float,
                   failed: Callable[[], MCCLError | None]) -> dict[str, Any]:
        with self._cv:
            while True:
                entry = self._mail.pop(key, None)
                if entry is not None and (rnd is None or entry[0]["round"] == rnd):
                    return entry[0]
                err = failed()
                if err is not None:
                    raise err
                left = deadline - time.monotonic()
                if left <= 0 or not self._running:
                    raise CollectiveTimeout(
                        f"[datalinks] Timed out in job {key[0]}: no {key[2]} from host {key[1]}; its ranks did not "
                        "join, or its daemon is stuck; check that host's mccld log", peer_addr=key[1])
                self._cv.wait(min(left, 0.2))

    # -- the pool (also ondemand.py's) -----------------------------------------------------------
    def take(self, job: str, peer_host: str, addr: str, n: int) -> list[DataSocket]:
        """``n`` sockets to ``peer_host`` for ``job``, idle ones first, the rest dialled; we
        must be the proposer for that host. On a failed dial those taken are closed."""
        held = self._take_idle(job, peer_host, n)
        try:
            while len(held) < n:
                held.append(self._dial(job, peer_host, addr))
        except BaseException:
            self.discard(held, f"job {job}: dialling the rest failed", kill=True)
            raise
        return held

    def claim(self, job: str, peer_host: str, ids: list[str], wait_until: float) -> tuple[list[DataSocket], list[str]]:
        """The proposed ``ids`` leased to ``job`` (waiting until ``wait_until`` for ones not yet
        accepted or still held), or none and the ids we cannot provide."""
        return self._claim(job, peer_host, ids, wait_until)

    def add_to_lease(self, job: str, socks: list[DataSocket]) -> bool:
        """Sockets leased mid-job join the job's lease, so its end gives them back with the
        rest; False (nothing added) if the job's lease was given back already."""
        with self._cv:
            lease = self._leases.get(job)
            if lease is None:
                return False
            lease.extend(socks)
            return True

    def discard(self, socks: list[DataSocket], why: str, kill: bool = False) -> None:
        with self._cv:
            for s in socks:
                self._discard(s, why, kill=kill)
            self._cv.notify_all()

    def _take_idle(self, job: str, peer_host: str, n: int) -> list[DataSocket]:
        taken: list[DataSocket] = []
        with self._cv:
            for s in list(self._socks.values()):
                if len(taken) >= n:
                    break
                if s.peer_host != peer_host or s.job is not None or not s.dialled:
                    continue
                if not s.silent():
                    self._discard(s, "it saw EOF or stray bytes while idle")
                    continue
                s.job = job
                s.uses += 1
                taken.append(s)
        return taken

    def _dial(self, job: str, peer_host: str, addr: str) -> DataSocket:
        with self._cv:
            self._next += 1
            sock_id = f"{self.host_id}.{self._prefix}.{self._next}"
        # The link's session is not kept: the engine proves the job's key on the socket itself
        # and derives fresh frame keys for every job (libmccl/csrc/transport/handshake.h).
        sock, got_host, _session = self._links.dial_data(addr, sock_id)
        if got_host != peer_host:
            sock.close()
            raise ProtocolError(f"[datalinks] job {job}: peer={addr} is host {got_host}, the job expects "
                                f"{peer_host} there; conflicting host lists or a moved address")
        bound_dead_link(sock)
        s = DataSocket(sock_id, peer_host, sock, dialled=True, job=job, uses=1)
        with self._cv:
            if not self._running:
                sock.close()
                raise ProtocolError("[datalinks] the daemon is stopping")
            self._socks[sock_id] = s
            self._counts[peer_host]["dialled"] += 1
        log.debug("dialled data socket %s to %s (%s)", sock_id, peer_host, addr)
        return s

    def _adopt_accepted(self, sock: socket.socket, peer_host: str, sock_id: str, _session: object) -> None:
        """A data socket a peer dialled to us (links.py authenticated it); idle until claimed."""
        bound_dead_link(sock)
        with self._cv:
            if not self._running or sock_id in self._socks or sock_id in self._gone:
                sock.close()
                log.warning("[datalinks] peer %s reused data socket id %r; closed the new socket (a peer daemon "
                            "restarted with the same id prefix?)", peer_host, sock_id)
                return
            self._socks[sock_id] = DataSocket(sock_id, peer_host, sock, dialled=False)
            self._counts[peer_host]["accepted"] += 1
            self._cv.notify_all()

    def _claim(self, job: str, peer_host: str, ids: list[str], wait_until: float) -> tuple[list[DataSocket], list[str]]:
        """All of ``ids`` leased to ``job``, or none and the ids we cannot provide."""
        with self._cv:
            while True:
                missing, waiting = [], False
                for sock_id in ids:
                    s = self._socks.get(sock_id)
                    if s is None:
                        # Not yet here: its accept may still be running, unless we already dropped it.
                        if sock_id in self._gone or time.monotonic() >= wait_until:
                            missing.append(sock_id)
                        else:
                            waiting = True
                    elif s.peer_host != peer_host:
                        missing.append(sock_id)
                    elif s.job is None:
                        if not s.silent():
                            self._discard(s, "it saw EOF or stray bytes while idle")
                            missing.append(sock_id)
                    elif time.monotonic() >= wait_until:
                        missing.append(sock_id)   # still held by a job that does not close
                    else:
                        waiting = True            # a closing job of ours still holds it
                if not waiting or missing:
                    break
                if not self._running:
                    missing = list(ids)      # stopping: nothing more will arrive or be given back
                    break
                self._cv.wait(max(0.01, min(0.2, wait_until - time.monotonic())))
            if missing:
                return [], missing
            held = [self._socks[i] for i in ids]
            for s in held:
                s.job = job
                s.uses += 1
            return held, []

    def _discard(self, s: DataSocket, why: str, kill: bool = False) -> None:
        """Close and forget ``s``; the caller holds the lock. ``kill``: shut the connection down
        too, which also ends it for an engine still holding a dup (a handshake then fails at once)
        and tells the peer now rather than at its next poll."""
        if self._socks.pop(s.id, None) is None:
            return
        self._gone[s.id] = None
        while len(self._gone) > _TOMBSTONES:
            self._gone.popitem(last=False)
        self._counts[s.peer_host]["discarded"] += 1
        try:
            if kill:
                s.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already reset by the peer
        try:
            s.sock.close()
        except OSError:
            pass
        log.debug("closed data socket %s to %s: %s", s.id, s.peer_host, why)
