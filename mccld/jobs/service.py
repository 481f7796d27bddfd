"""The jobs this daemon hosts: the attach requests of its local clients (each checked once by
mccl_common.attach_protocol before it gets here), the table of those clients and of the jobs
they joined, what each ``Job`` needs of its daemon (the ``JobHost`` seam of job.py), and the
periodic check that finds dead clients and overdue ops.

Lifecycle: built once the daemon's links and data sockets are up; ``serve`` plugs in the attach
endpoint and the fd inbox, ``start`` the checker; ``stop`` fails the running jobs with
AbortedError, frees their segments and refuses later joins; ``unplug`` drops the endpoints
before they stop; ``close`` ends the checker.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from mccl_common import PROTO_VERSION, __version__, shm
from mccl_common import attach_protocol as protocol
from mccl_common.daemon_settings import DaemonConfig
from mccl_common.errors import AbortedError, ConfigError, MCCLError, ProtocolError
from mccl_common.settings import EngineConfig

from ..net.links import LinkManager
from .job import Job
from .peers import JobPeers
from .reduce import ReducePool
from .traffic import PeerTraffic

log = logging.getLogger(__name__)

_CHECKER_JOIN_S = 2.0

# ``stat("record_error", name)``: a DaemonStats method by name, where the daemon keeps stats.
Stat = Callable[..., None]


class Attach(Protocol):
    """The attach endpoint (mccld.attach.AttachServer)."""
    def reply(self, ident: bytes, req: int, payload: dict[str, Any]) -> None: ...
    def reply_error(self, ident: bytes, req: int, exc: BaseException) -> None: ...
    def forget(self, ident: bytes) -> None: ...
    def peer_of(self, ident: bytes) -> Any: ...


class Inbox(Protocol):
    """Segment descriptors the clients handed over (mccld.fd_inbox.FdInbox)."""
    def take(self, name: str, creds: Any) -> int: ...
    def discard(self, name: str, creds: Any) -> bool: ...


class SegmentLog(Protocol):
    """The names of segments that may outlive mccld (mccld.host.runtime_dir.SegmentRecord)."""
    def add(self, name: str) -> None: ...
    def keep_only(self, names: list[str]) -> None: ...


class JobService:
    """``status`` is the daemon's answer to a ``status`` request, ``switch`` this host's switch
    (``hello`` tells the ranks), ``on_checked(busy)`` runs after each periodic check."""

    def __init__(self, host_id: str, cfg: DaemonConfig, engine_cfg: EngineConfig, pool: ReducePool,
                 links: LinkManager, peers: JobPeers, segments: SegmentLog, stat: Stat,
                 status: Callable[[], dict[str, Any]], switch: Callable[[], str],
                 on_checked: Callable[[bool], None]):
        self.host_id, self.engine_cfg, self.pool = host_id, engine_cfg, pool
        self._cfg, self._links, self._peers, self._segments = cfg, links, peers, segments
        self._stat, self._status, self._switch, self._on_checked = stat, status, switch, on_checked
        self.table: dict[str, Job] = {}
        self.clients: dict[bytes, dict[str, Any]] = {}   # ident -> {pid, memberships: {(job, rank)}}
        self.last_error = ""
        self._attach: Attach | None = None
        self._inbox: Inbox | None = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._poke = threading.Event()      # a client disconnected: check clients now
        self._checker: threading.Thread | None = None
        self._traffic = PeerTraffic(stat)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "JobService":
        self._checker = threading.Thread(target=self._check_loop, name="mccld-checker", daemon=True)
        self._checker.start()
        return self

    def serve(self, attach: Attach, inbox: Inbox) -> None:
        self._attach, self._inbox = attach, inbox

    def poke(self) -> None:
        """Check the clients now (one disconnected, a launched job changed)."""
        self._poke.set()

    def stop(self, reason: str) -> None:
        with self._lock:
            # Under the lock that joins take: a job is either in this list, and stopped below,
            # or its join sees the flag and is refused (its thread would outlive mccld).
            self._stopping.set()
            jobs = list(self.table.values())
        self._poke.set()
        for job in jobs:
            job.fail(AbortedError(f"[daemon] job {job.id}: {reason}; restart the job once mccld is back"),
                     local=True)
            job.free_segments()
        for job in jobs:
            job.close(stopping=True)    # its threads end now, not with the process (an in-process mccld)

    def unplug(self) -> None:
        self._attach = self._inbox = None
        self._peers.unplug()

    def close(self) -> None:
        if self._checker is not None:
            self._checker.join(timeout=_CHECKER_JOIN_S)
            self._checker = None

    def running(self) -> int:
        """Jobs joining or running (a harvest lease counts them)."""
        with self._lock:
            return sum(1 for j in self.table.values() if j.state in ("joining", "ready"))

    def rows(self) -> tuple[list[dict[str, Any]], int]:
        """Each job as ``status`` shows it, and how many clients are attached."""
        with self._lock:
            now = time.monotonic()
            return ([{"job": j.id, "ranks": j.local_ranks, "world": j.size, "state": j.state,
                      "hosts": len(j.hosts), "attached": sorted(j.members), "age_s": now - j.created,
                      "compression": j.compression.codec}
                     for j in self.table.values()],
                    len(self.clients))

    # -- what a Job needs (job.JobHost) ----------------------------------------------------
    def reply(self, ident: bytes, req: int, payload: dict[str, Any]) -> None:
        attach = self._attach
        if attach is not None:
            attach.reply(ident, req, payload)

    def reply_error(self, ident: bytes, req: int, exc: BaseException) -> None:
        self._stat("record_error", type(exc).__name__)
        self.last_error = f"{type(exc).__name__}: {exc}"
        attach = self._attach
        if attach is not None:
            attach.reply_error(ident, req, exc)

    def take_segment(self, ident: bytes, name: str) -> int:
        """The descriptor of segment ``name`` that the client behind ``ident`` handed over (the
        caller owns it); ProtocolError/AuthError if that client handed over none by that name."""
        inbox, attach = self._inbox, self._attach
        if inbox is None or attach is None:
            raise AbortedError(f"[daemon] mccld is stopping; segment {name} not mapped")
        return inbox.take(name, attach.peer_of(ident))

    def build_engine(self, job: Job) -> Any:
        return self._peers.build_engine(job)

    def release_data_sockets(self, job: Job, clean: bool) -> None:
        self._peers.release_data_sockets(job, clean)

    def notify_peers_failed(self, job: Job, exc: MCCLError) -> None:
        self._peers.notify_failed(job, exc)

    def on_peer_failed(self, peer_host: str, msg: dict[str, Any]) -> None:
        """A ``job_failed`` link message from ``peer_host``."""
        self._peers.verdict(self.table.get(str(msg.get("job"))), peer_host, msg)

    def record_collective(self, job: Job, op: str, nbytes: int, seconds: float) -> None:
        self._stat("record_collective", job.id, op, nbytes, seconds, job.size, len(job.hosts))
        # Poll now, while the engine exists: the checker alone misses the bytes of the
        # last collectives before a job closes (found by tests/e2e/test_grafana_daemon.py).
        self.poll_traffic(job)

    def record_reduced(self, job: Job, nbytes: int, encoded: int) -> None:
        self._stat("record_reduced", job.id, job.compression.codec, nbytes, encoded)

    def poll_traffic(self, job: Job) -> None:
        self._traffic.poll(job)

    def job_closed(self, job: Job) -> None:
        self._stat("end_job", job.id, job.size, job.failed is not None, time.monotonic() - job.created)
        with self._lock:
            if self.table.get(job.id) is job:
                del self.table[job.id]
            self._traffic.forget(job.id)
            # The record only has to name segments that may outlive us: those of live jobs.
            live = [name for j in self.table.values() for m in list(j.members.values()) for name in m.names()]
            self._segments.keep_only(live)

    # -- the attach protocol ---------------------------------------------------------------
    def handle(self, ident: bytes, msg: protocol.Request) -> dict[str, Any] | None:
        kind = msg.type
        if kind == "hello":
            self._attach_client(ident, msg.pid)
            # How this daemon's engine cuts pipelined all-reduces: a client copies its input
            # only so far ahead of the results, and must stay ahead of every piece.
            cut = {"pipeline_bytes": self.engine_cfg.pipeline_bytes,
                   "small_allreduce_bytes": self.engine_cfg.small_allreduce_bytes}
            return {"ok": True, "host_id": self.host_id, "link_addr": self._links.address,
                    "daemon_version": __version__, "proto": PROTO_VERSION, "engine_cut": cut,
                    "switch": self._switch()}
        if kind == "status":
            return {"ok": True, "status": self._status()}
        if kind == "probe":
            threading.Thread(target=self._probe, args=(ident, msg), daemon=True).start()
            return None
        job_id = msg.job
        if kind == "join":
            return self._join(ident, msg)
        job = self.table.get(job_id)
        if job is None:
            raise ProtocolError(f"[daemon] unknown job {job_id!r}; join it first")
        if kind == "register":
            job.register(msg.rank, ident, msg.segment, msg.nbytes, msg.buffer)
            with self._lock:
                self._segments.add(msg.segment)
            return {"ok": True}
        if kind == "release":
            # A buffer dropped before its register went out was only handed over: its
            # descriptor waits in the inbox, not in the job.
            inbox, attach = self._inbox, self._attach
            if inbox is not None and attach is not None and inbox.discard(msg.segment, attach.peer_of(ident)):
                return {"ok": True}
            job.release_buffer(msg.rank, ident, msg.segment)
            return {"ok": True}
        if kind == "op":
            msg.check_world(job.size)
            job.submit(ident, msg.req, msg)
            return None
        if kind == "balance":
            self._stat("record_balance", job_id, msg.rank, float(msg.speed), int(msg.share))
            return {"ok": True}
        if kind == "overlap":
            self._stat("record_overlap", job_id, msg.rank, float(msg.ratio))
            return {"ok": True}
        if kind == "leave":
            job.leave(msg.rank, ident, msg.abort)
            with self._lock:
                client = self.clients.get(ident)
                if client:
                    client["memberships"].discard((job_id, msg.rank))
                    if not client["memberships"]:
                        # One connection per communicator: its leave ends the attachment.
                        del self.clients[ident]
                        self._forget(ident)
            self._stat("set_attached", len(self.clients))
            return {"ok": True}
        raise ProtocolError(f"[daemon] unhandled request type {kind!r}")

    def _forget(self, ident: bytes) -> None:
        attach = self._attach
        if attach is not None:
            attach.forget(ident)

    def _attach_client(self, ident: bytes, pid: int) -> None:
        """Record a connection that said hello. Connections never say goodbye (a CLI's one
        request, a communicator's set-up that failed), so past the per-process cap the longest
        idle one of that process (no job joined through it) makes room."""
        cap = self._cfg.max_attached_per_process
        with self._lock:
            known = self.clients.pop(ident, None)
            mine = [i for i, c in self.clients.items() if c["pid"] == pid]
            if len(mine) >= cap:
                idle = [i for i in mine if not self.clients[i]["memberships"]]
                if not idle:
                    raise ConfigError(f"[daemon] pid {pid} already has {len(mine)} communicators attached "
                                      f"(MCCL_MAX_ATTACHED_PER_PROCESS={cap}); it leaks process groups: "
                                      "destroy the ones it no longer uses, or raise the limit")
                del self.clients[idle[0]]
                self._forget(idle[0])
            self.clients[ident] = {"pid": pid, "memberships": known["memberships"] if known else set()}
            attached = len(self.clients)
        self._stat("set_attached", attached)

    def _join(self, ident: bytes, msg: protocol.Join) -> None:
        job_id, hosts, rank = msg.job, msg.hosts, msg.rank
        if not any(h.host_id == self.host_id and rank in h.ranks for h in hosts):
            raise ProtocolError(f"[daemon] job {job_id}: rank {rank} is not placed on this host "
                                f"({self.host_id}) by the join's host list; the rank reached another "
                                "host's daemon, or two daemons share a host id")
        with self._lock:
            client = self.clients.get(ident)
            if client is None:
                raise ProtocolError("[daemon] join from a client that never said hello")
            if self._stopping.is_set():
                raise AbortedError(f"[daemon] job {job_id}: mccld is stopping, join refused; restart the "
                                   "job once mccld is back")
            job = self.table.get(job_id)
            fresh = job is None or job.state in ("failed", "closed") and not job.members
            if fresh:
                job = Job(self, job_id, msg.size, hosts, msg.timeout_s, msg.opts, msg.compression_settings)
            try:
                job.join(ident, msg.req, rank, client["pid"], msg.size, hosts, msg.opts, msg.compression_settings)
            except BaseException:
                if fresh:
                    job.close()   # its threads end now; it never was in the table
                raise
            if fresh:
                self.table[job_id] = job
            client["memberships"].add((job_id, rank))
        self._stat("set_state", "training")
        return None

    def _probe(self, ident: bytes, msg: protocol.Probe) -> None:
        started = time.monotonic()
        try:
            link = self._links.link_to(msg.addr)
        except Exception as e:  # noqa: BLE001 - every request is answered; non-MCCL errors read "internal"
            self.reply_error(ident, msg.req, e)
            return
        self.reply(ident, msg.req, {"ok": True, "host_id": link.peer_host,
                                    "seconds": time.monotonic() - started})

    # -- the periodic check ----------------------------------------------------------------
    def _check_loop(self) -> None:
        while not self._stopping.is_set():
            self._poke.wait(self._cfg.client_check_s)
            self._poke.clear()
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the checker must survive anything
                log.exception("[daemon] periodic check failed")

    def check_once(self) -> None:
        with self._lock:
            clients = list(self.clients.items())
            jobs = list(self.table.values())
        gone = False
        for ident, client in clients:
            if not shm.pid_alive(client["pid"]):
                gone = True
                log.info("client pid %d is gone; freeing its segments", client["pid"])
                with self._lock:
                    self.clients.pop(ident, None)
                    memberships = list(client["memberships"])
                for job_id, rank in memberships:
                    job = self.table.get(job_id)
                    if job is not None:
                        job.client_died(rank)
                self._forget(ident)
                self._stat("set_attached", len(self.clients))
        if gone:
            # A client killed between creating a segment and registering it left one no job
            # knows; its name carries the dead pid (found by the fault campaign: 1 in 100
            # rank SIGKILLs). macOS cannot list POSIX shm: there the start-up sweep of the
            # recorded names remains.
            shm.sweep()
        now = time.monotonic()
        for job in jobs:
            job.check_timeouts(now)
            self.poll_traffic(job)
        with self._lock:
            busy = any(j.state == "ready" for j in self.table.values())
        self._on_checked(busy)
