"""Data sockets leased mid-job, when a job's engine first needs a host it was not linked to
at set-up (issue 26: links on demand, through mccld).

At set-up a job's daemon leases sockets only to the hosts its engine's whole-world
algorithms use (``setup_hosts``: ring neighbours, fold partner, hypercube partners; the
relation is symmetric), so a daemon's data sockets grow as O(log hosts) for jobs that run
only all-reduce, all-gather, reduce-scatter, broadcast and barrier. Any other host is
leased the first time the engine sends to it (a p2p send, all-to-all, gather, scatter,
reduce; libmccl/csrc/transport/handed_links.h). A receiver never asks: the sender's
engine does, so one side asking is always enough and nothing waits in a cycle.

  want     The engine's ask calls ``want(job, rank)``, which only queues. The lower host id
           proposes, as at set-up (one proposer per pair, so the two ends never claim a
           socket from opposite sides); the higher one sends ``data_want`` over the
           control link and the lower one proposes.
  lease    ``data_lease`` with ``lazy: true``: K socket ids, idle ones or newly dialled.
  claim    The other side claims them on a worker of this module (never the link's reader,
           never a job's thread), hands its fds to its engine (``hand_in``) and acks; ids it
           no longer holds are named, and the proposer replaces them (at most _MAX_ROUNDS).
  ack      ``data_ack`` with ``lazy: true``: the proposer hands its fds to its engine.
           Both engines then run the job's keyed handshake on the sockets, as on set-up.
  refuse   ``data_refused``: a side that cannot (the job ended there, a host outside the
           job, too many negotiations at once, a malformed message) says why; the engine
           that asked fails the op with that error, naming the host. A negotiation past
           its deadline (the job's set-up time) fails the same way, and so does a dial.

The sockets join the job's lease: its end gives them back to the pool (clean) or closes
them (datalinks.py), and a negotiation unfinished at the job's end closes its sockets.
A message for a job this daemon does not run yet (its ranks are still arriving) waits,
bounded in number and age, until the job's engine is built.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from mccl_common.errors import AbortedError, CollectiveTimeout, MCCLError, PeerLostError, ProtocolError, from_kind, kind_of

from ..logutil import OnceLogger
from .workers import WorkerPool

if TYPE_CHECKING:
    import socket

    from .links import LinkManager

log = logging.getLogger(__name__)

WORKERS = 4                  # negotiation steps run on this many threads, started with the daemon
_MAX_QUEUED = 256            # steps waiting for a worker; past it a want or lease is refused
_MAX_ACTIVE = 64             # negotiations in flight at once, all jobs together
_MAX_EARLY = 256             # messages held for jobs whose engine is not built yet
_EARLY_AGE_S = 120.0
_ENDED = 4096                # ended job ids remembered: their messages are refused at once
_MAX_ID = 128                # characters of a job or socket id
_MAX_TEXT = 2000             # characters of a refusal's reason
_MAX_ROUNDS = 4              # proposals per pair before giving up (as at set-up)
TYPES = ("data_want", "data_refused")   # plus data_lease / data_ack with lazy: true


class PooledSocket(Protocol):
    """A data socket of the pool (datalinks.DataSocket), as a negotiation holds it."""
    id: str
    sock: "socket.socket"


class SocketPool(Protocol):
    """What a negotiation asks of the data-socket pool (datalinks.DataLinks, which owns this
    negotiator: typed here so that the two modules do not import each other)."""
    k: int

    @property
    def timeout_s(self) -> float: ...

    def take(self, job: str, peer_host: str, addr: str, n: int) -> list[Any]: ...

    def claim(self, job: str, peer_host: str, ids: list[str], wait_until: float) -> tuple[list[Any], list[str]]: ...

    def add_to_lease(self, job: str, socks: list[Any]) -> bool: ...

    def discard(self, socks: list[Any], why: str, kill: bool = False) -> None: ...


def setup_hosts(me: int, n_hosts: int) -> list[int]:
    """The hosts a job's engine links at set-up: the peers of its whole-world algorithms."""
    from libmccl import _core
    return list(_core.collective_peers(me, n_hosts)) if n_hosts > 1 else []


@dataclass
class _Pair:
    """One (job, peer host) negotiation."""
    state: str                      # asked | proposing | waiting | claiming | done | failed
    deadline: float
    round: int = 0
    held: list[PooledSocket] = field(default_factory=list)


@dataclass
class _Job:
    id: str
    engine: Any
    me: int
    hosts: list[tuple[str, str]]    # (host id, link address) by engine rank
    budget_s: float
    pairs: dict[str, _Pair] = field(default_factory=dict)

    def rank_of(self, host: str) -> int:
        return next((r for r, (h, _) in enumerate(self.hosts) if h == host and r != self.me), -1)


class OnDemand:
    """The mid-job leases of one daemon's pool; ``start``/``stop`` with it."""

    def __init__(self, pool: SocketPool, links: "LinkManager"):
        self._pool = pool
        self._links = links
        self.host_id = links.host_id
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._early: collections.OrderedDict[tuple[str, str, str], tuple[dict[str, Any], float]] = \
            collections.OrderedDict()
        # _MAX_QUEUED steps wait besides the WORKERS running.
        self._steps = WorkerPool("mccld-ondemand", WORKERS, _MAX_QUEUED + WORKERS,
                                 lambda: log.exception("[datalinks] an on-demand lease step failed"))
        self._once = OnceLogger(log, rewarn_s=60.0)
        self.counts: collections.Counter = collections.Counter()   # leased, refused, failed (tests, status)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._steps.start()

    def stop(self) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            self.detach(job)
        self._steps.stop()   # queued steps are moot now

    # -- jobs --------------------------------------------------------------------------------
    def attach(self, job: str, engine: Any, me: int, hosts: list[tuple[str, str]], budget_s: float) -> None:
        """The job's engine is built: serve its wants and its peers' leases from now on. A job
        that ended while its engine was being built (a peer dropped the sockets mid set-up) is
        not taken: its detach already ran, and nothing would drop the engine (and its pipes)
        again — a fuzz run once found one kept for good."""
        with self._lock:
            if job in self._ended:
                return
            self._jobs[job] = _Job(job, engine, me, hosts, budget_s)
            early = [(key[1], msg) for key, (msg, _) in self._early.items() if key[0] == job]
            for key in [k for k in self._early if k[0] == job]:
                del self._early[key]
        for peer_host, msg in early:
            self.on_message(peer_host, msg)

    def detach(self, job: str) -> None:
        """The job ended: later messages for it are refused; unfinished negotiations close
        their sockets (their ends may carry half a handshake)."""
        with self._lock:
            j = self._jobs.pop(job, None)
            self._ended[job] = None
            while len(self._ended) > _ENDED:
                self._ended.popitem(last=False)
            for key in [k for k in self._early if k[0] == job]:
                del self._early[key]
            loose = [s for p in (j.pairs.values() if j else ()) if p.state != "done" for s in p.held]
            if j is not None:
                # Dropped here, not when the last reference to ``j`` goes: a logged error's
                # frames (a failed dial's) may keep ``j`` alive long after.
                j.engine = None
        if loose:
            self._pool.discard(loose, f"job {job} ended with their lease unfinished", kill=True)

    def want(self, job: str, rank: int) -> None:
        """The engine of ``job`` needs host ``rank`` (its ask thread; returns at once)."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None or not 0 <= rank < len(j.hosts) or rank == j.me:
                return
            peer, _addr = j.hosts[rank]
            if peer in j.pairs:
                return                      # on its way, or refused already
            propose = self.host_id < peer
            p = _Pair("proposing" if propose else "asked", time.monotonic() + j.budget_s)
            j.pairs[peer] = p
            busy = self._active() > _MAX_ACTIVE
        if busy or not self._steps.submit(self._propose if propose else self._ask, j, peer, 0):
            self._fail(j, peer, ProtocolError(
                f"[datalinks] job {job}: too many data-socket leases in flight on host {self.host_id}; "
                f"host {peer} was not linked; retry the job, or run fewer jobs at once"))

    def sweep(self) -> None:
        """Fails the negotiations past their deadline and drops stale early messages (the
        daemon's periodic check)."""
        now = time.monotonic()
        late: list[tuple[_Job, str]] = []
        with self._lock:
            for key in [k for k, (_, t) in self._early.items() if now - t > _EARLY_AGE_S]:
                del self._early[key]
            for j in self._jobs.values():
                late += [(j, h) for h, p in j.pairs.items() if p.state not in ("done", "failed") and now > p.deadline]
        for j, peer in late:
            addr = j.hosts[j.rank_of(peer)][1]
            self._fail(j, peer, CollectiveTimeout(
                f"[datalinks] Timed out in job {j.id}: no data sockets agreed with host {peer} (peer={addr}) "
                f"within {j.budget_s:.0f} s; its daemon is stuck or unreachable; check that host's mccld log",
                peer_addr=addr))

    def status(self) -> dict[str, int]:
        with self._lock:
            return {"negotiating": self._active(), "early": len(self._early), **self.counts}

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _active(self) -> int:
        return sum(p.state not in ("done", "failed") for j in self._jobs.values() for p in j.pairs.values())

    # -- messages (the control link's reader: checks and queues, never blocks) ----------------
    def on_message(self, peer_host: str, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        job = msg.get("job")
        if not (isinstance(job, str) and 0 < len(job) <= _MAX_ID):
            self._once.warn(f"bad:{peer_host}", "[datalinks] dropped a malformed %s from %s: no valid job id",
                            str(kind)[:40], peer_host)
            return
        why = _malformed(kind, msg, self._pool.k)
        if why:
            self._refuse(peer_host, job, ProtocolError(f"[datalinks] job {job}: malformed {kind} from host "
                                                       f"{peer_host}: {why}; the daemons run different MCCL versions?"),
                         answer=kind != "data_refused")
            return
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                ended = job in self._ended
                full = not ended and len(self._early) >= _MAX_EARLY
                if not ended and not full and kind != "data_refused":
                    self._early[(job, peer_host, kind)] = (msg, time.monotonic())
        # A refusal is never answered, or two daemons could refuse each other's refusals forever.
        answer = kind != "data_refused"
        if j is None:
            if (ended or full) and answer:
                self._refuse(peer_host, job, PeerLostError(
                    f"[datalinks] job {job} {'ended' if ended else 'is not running'} on host {self.host_id}"
                    f"{'' if ended else ' and too many messages wait for jobs not yet running'}; "
                    "no data sockets for it", peer_addr=self.host_id))
            return
        rank = j.rank_of(peer_host)
        if rank < 0:
            self._refuse(peer_host, job, ProtocolError(
                f"[datalinks] job {job}: host {peer_host} is not one of its hosts on {self.host_id}; "
                "the daemons disagree on the job's host list"), answer=answer)
            return
        if kind == "data_refused":
            err = from_kind(msg["kind"], f"[datalinks] host {peer_host} refused data sockets for job {job}: "
                            f"{msg['error']}", peer_addr=j.hosts[rank][1])
            self._fail(j, peer_host, err, tell=False)
            return
        propose = self.host_id < peer_host
        if (kind in ("data_want", "data_ack")) != propose:
            self._refuse(peer_host, job, ProtocolError(
                f"[datalinks] job {job}: {kind} from host {peer_host}, which is the "
                f"{'proposer' if not propose else 'acceptor'} of that pair; the daemons run different MCCL versions?"))
            return
        step = self._accepts(j, peer_host, kind, msg)
        if step is not None and not self._steps.submit(step, j, peer_host, msg):
            self._fail(j, peer_host, ProtocolError(
                f"[datalinks] job {job}: too many data-socket leases queued on host {self.host_id}; "
                f"host {peer_host} was not linked; retry the job, or run fewer jobs at once"))

    def _accepts(self, j: _Job, peer: str, kind: str, msg: dict[str, Any]) -> Callable[..., None] | None:
        """The step this message starts, or None (a duplicate: logged once)."""
        with self._lock:
            p = j.pairs.get(peer)
            if kind == "data_want":
                if p is not None:
                    log.debug("job %s: host %s wants a link we %s already", j.id, peer, p.state)
                    return None               # we want it too, or it is done: one proposal is enough
                p = j.pairs[peer] = _Pair("proposing", time.monotonic() + j.budget_s)
                return self._propose_msg
            if kind == "data_lease":
                if p is None:
                    p = j.pairs[peer] = _Pair("waiting", time.monotonic() + j.budget_s)
                if p.state in ("asked", "waiting"):
                    p.state = "claiming"
                    return self._claim
            elif p is not None and p.state == "proposing" and p.round == msg["round"]:
                p.state = "acked"
                return self._acked
        self._once.warn(f"dup:{peer}", "[datalinks] job %s: ignored a %s from host %s in state %s",
                        j.id, kind, peer, p.state if p else "none")
        return None

    # -- steps (workers) -------------------------------------------------------------------------
    def _ask(self, j: _Job, peer: str, _rnd: int) -> None:
        try:
            self._links.send(j.hosts[j.rank_of(peer)][1], {"type": "data_want", "job": j.id})
        except MCCLError as e:
            self._fail(j, peer, e)

    def _propose_msg(self, j: _Job, peer: str, _msg: dict[str, Any]) -> None:
        self._propose(j, peer, 0)

    def _propose(self, j: _Job, peer: str, rnd: int) -> None:
        addr = j.hosts[j.rank_of(peer)][1]
        with self._lock:
            p = j.pairs.get(peer)
            kept = list(p.held) if p else []
        try:
            socks = self._pool.take(j.id, peer, addr, self._pool.k - len(kept))
        except MCCLError as e:
            self._fail(j, peer, type(e)(f"[datalinks] job {j.id}: no data sockets to host {peer} for the "
                                        f"first send there: {e}", peer_addr=addr))
            return
        with self._lock:
            live = self._jobs.get(j.id) is j and p is not None and p.state == "proposing"
            if live:
                p.held, p.round = kept + socks, rnd
                live = self._pool.add_to_lease(j.id, socks)
        if not live:
            self._pool.discard(socks, f"job {j.id} ended while they were leased", kill=True)
            return
        try:
            self._links.send(addr, {"type": "data_lease", "lazy": True, "job": j.id, "round": rnd,
                                    "ids": [s.id for s in p.held]})
        except MCCLError as e:
            self._fail(j, peer, e)

    def _claim(self, j: _Job, peer: str, msg: dict[str, Any]) -> None:
        rank = j.rank_of(peer)
        with self._lock:
            p = j.pairs[peer]
        held, missing = self._pool.claim(j.id, peer, msg["ids"], min(p.deadline, time.monotonic() + self._pool.timeout_s))
        ack = {"type": "data_ack", "lazy": True, "job": j.id, "round": msg["round"], "missing": missing}
        if not missing:
            with self._lock:
                live = self._jobs.get(j.id) is j and p.state == "claiming" and self._pool.add_to_lease(j.id, held)
                if live:
                    p.held = held
            if not live:
                self._pool.discard(held, f"job {j.id} ended while they were claimed", kill=True)
                self._refuse(peer, j.id, PeerLostError(f"[datalinks] job {j.id} ended on host {self.host_id}"))
                return
            try:
                _engine(j).hand_in(rank, [s.sock.fileno() for s in held])
            except MCCLError as e:
                self._fail(j, peer, e)
                return
        with self._lock:
            if p.state == "claiming":
                p.state = "waiting" if missing else "done"
        if not missing:
            self._count("leased")
            log.debug("job %s: leased data sockets of host %s on demand (acceptor)", j.id, peer)
        self._send_host(peer, ack)

    def _acked(self, j: _Job, peer: str, msg: dict[str, Any]) -> None:
        with self._lock:
            p = j.pairs[peer]
            missing = set(msg["missing"])
            gone = [s for s in p.held if s.id in missing]
            p.held = [s for s in p.held if s.id not in missing]
            rnd = p.round + 1
            if gone:
                p.state = "proposing"
        if gone:
            self._pool.discard(gone, f"host {peer} no longer holds them")
            if rnd >= _MAX_ROUNDS:
                self._fail(j, peer, ProtocolError(
                    f"[datalinks] job {j.id}: host {peer} refused {_MAX_ROUNDS} proposals of data sockets; its pool "
                    "keeps losing them (network flapping?); check the link, then restart the job"))
            else:
                self._propose(j, peer, rnd)
            return
        try:
            _engine(j).hand_in(j.rank_of(peer), [s.sock.fileno() for s in p.held])
        except MCCLError as e:
            self._fail(j, peer, e)
            return
        with self._lock:
            p.state = "done"
        self._count("leased")
        log.debug("job %s: leased data sockets of host %s on demand (proposer)", j.id, peer)

    # -- failures ----------------------------------------------------------------------------
    def _fail(self, j: _Job, peer: str, exc: MCCLError, tell: bool = True) -> None:
        """The negotiation with ``peer`` failed: close its sockets, fail the engine's ops
        waiting for that host, and (``tell``) say why to the peer."""
        with self._lock:
            p = j.pairs.get(peer)
            if p is None or p.state in ("done", "failed"):
                return
            p.state = "failed"
            loose, p.held = p.held, []
        self._count("failed")
        self._pool.discard(loose, f"job {j.id}: {exc}", kill=True)
        self._once.warn(f"fail:{j.id}:{peer}", "%s", exc)
        rank = j.rank_of(peer)
        try:
            _engine(j).refuse_link(rank, kind_of(exc), str(exc))
        except MCCLError:
            pass   # the engine is shut down: nothing of it waits any more
        if tell:
            self._send_host(peer, {"type": "data_refused", "job": j.id, "kind": kind_of(exc), "error": str(exc)})

    def _refuse(self, peer: str, job: str, exc: MCCLError, answer: bool = True) -> None:
        """Logs once per peer why a message was not served; ``answer``: tell the peer too."""
        self._count("refused")
        self._once.warn(f"refuse:{peer}", "%s", exc)
        # Sent by a worker: the control link's reader must never block on a peer that does not read.
        if answer and not self._steps.submit(self._send_host, peer, {"type": "data_refused", "job": job,
                                                                "kind": kind_of(exc), "error": str(exc)}):
            log.debug("refusal to %s not sent: too many steps queued", peer)

    def _send_host(self, peer: str, msg: dict[str, Any]) -> None:
        try:
            self._links.send_host(peer, msg)
        except MCCLError as e:
            log.debug("could not send %s to %s: %s", msg["type"], peer, e)


def _engine(j: _Job) -> Any:
    engine = j.engine   # read once: detach() may clear it
    if engine is None:
        raise AbortedError(f"[datalinks] job {j.id} ended; its engine takes no more links")
    return engine


def _malformed(kind: Any, msg: dict[str, Any], k: int) -> str:
    """What is wrong with a message's fields ('' if nothing): checked before any use."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def ids(v: Any, n_min: int, n_max: int) -> bool:
        return (isinstance(v, list) and n_min <= len(v) <= n_max
                and all(isinstance(i, str) and 0 < len(i) <= _MAX_ID for i in v))
    if kind in ("data_lease", "data_ack") and not (is_int(msg.get("round")) and 0 <= msg["round"] < _MAX_ROUNDS):
        return f"round {msg.get('round')!r:.40} is not an integer in [0, {_MAX_ROUNDS})"
    if kind == "data_lease" and not ids(msg.get("ids"), k, k):
        return f"ids must be {k} socket ids (MCCL_SOCKETS_PER_PEER the same on every host)"
    if kind == "data_ack" and not ids(msg.get("missing"), 0, k):
        return f"missing must be at most {k} socket ids"
    if kind == "data_refused" and not (isinstance(msg.get("error"), str) and len(msg["error"]) <= _MAX_TEXT
                                       and is_int(msg.get("kind"))):
        return "a refusal needs an error text and an error kind"
    return ""
