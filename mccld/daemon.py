"""The daemon: wires config, links, discovery, the attach endpoint and jobs together.

``Daemon(cfg).start()`` brings everything up (or raises a typed error saying what
blocked it); ``stop()`` fails the running jobs with AbortedError, frees their
segments and closes everything; both are idempotent.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from mccl_common import PROTO_VERSION, __version__, shm
from mccl_common import attach_protocol as protocol
from mccl_common import jobkey, topology
from mccl_common.daemon_settings import DaemonConfig, attach_gid, key_paths, runtime_dir
from mccl_common.errors import AbortedError, ConfigError, MCCLError, ProtocolError
from mccl_common.fd_limit import ensure_open_files
from mccl_common.hostinfo import host_facts
from mccl_common.netif import choose_address
from mccl_common.settings import EngineConfig, load

from .attach import AttachServer
from .fd_inbox import MAX_HELD, FdInbox
from .net.datalinks import DataLinks
from .net.gate import Gate
from .host.harvest import Harvester
from .jobs.job import Job
from .host.launcher import LaunchServer
from .host.reclaim import ReclaimWatch
from .host.runtime_dir import SegmentRecord, lock_runtime_dir
from .net.fleet import FleetView, carries as fleet_message
from .net.links import LinkManager
from .net.ondemand import setup_hosts
from .jobs.reduce import ReducePool

log = logging.getLogger(__name__)

_SPARE_FILES = 256     # clients, data sockets, segments beyond the inbox's and the gate's caps
_WANT_FILES = 65536    # the soft limit mccld raises itself to, when the hard limit allows


def job_switches(hosts) -> list[int]:
    """The engine's switch_of_rank for a job's hosts (one engine rank each): empty, so flat,
    unless every host's daemon knows its switch and there are two or more."""
    names = [getattr(h, "switch", "") for h in hosts]
    return topology.switch_ids(names) if all(names) else []


def default_host_id() -> str:
    name = socket.gethostname().split(".")[0] or "host"
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            mid = Path(path).read_text().strip()
        except OSError:
            continue
        if mid:
            return f"{name}-{hashlib.sha256(mid.encode()).hexdigest()[:6]}"
    return name


def _optional(module: str):
    """Observability parts and discovery are optional: a daemon without them still serves jobs.
    ``module`` is a full name (mccld.report.stats, mccl_common.discovery)."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        # WARNING, not INFO: the operator configured this endpoint (or discovery) and will not get it.
        log.warning("[daemon] %s cannot be imported (%s); running without it: install the missing "
                    "package (zeroconf / prometheus-client) or set its port to 0 to silence this", module, e)
        return None


class Daemon:
    def __init__(self, cfg: DaemonConfig, engine_cfg: EngineConfig | None = None):
        self.cfg = cfg
        self.engine_cfg = engine_cfg or load(EngineConfig)
        self.host_id = cfg.host_id or default_host_id()
        self.addr = ""
        self.iface = ""
        self.pool: ReducePool | None = None
        self.links: LinkManager | None = None
        self.datalinks: DataLinks | None = None
        self.attach: AttachServer | None = None
        self.inbox: FdInbox | None = None
        self.stats = None
        self.fleet: FleetView | None = None
        self.harvester: Harvester | None = None
        self._running_jobs = 0              # last count the harvester was told about
        self._servers: list[Any] = []
        self.launcher: LaunchServer | None = None
        self.reclaim = ReclaimWatch(cfg.reclaim_grace_s, self._record_reclaim)
        self.jobs: dict[str, Job] = {}
        self.clients: dict[bytes, dict[str, Any]] = {}   # ident -> {pid, memberships: {(job, rank)}}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._poke = threading.Event()      # a client disconnected: check clients now
        self._checker: threading.Thread | None = None
        self._traffic: dict[tuple[str, int], tuple[int, int]] = {}
        self._traffic_lock = threading.Lock()   # job threads and the checker both poll
        self.last_error = ""
        self.started = False
        self.runtime_dir: Path | None = None
        self.segments: SegmentRecord | None = None
        self._lock_fd: int | None = None     # flock on the runtime dir's lock file, held while we serve it
        self._fleet_key = b""                # read by start(); the root of every job's engine secret

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Daemon":
        if self.started:
            return self
        cfg = self.cfg
        self._stop.clear()
        # Needed: the descriptors the fd inbox may hold and the unauthenticated connections it
        # admits, plus room for clients, data sockets and segments; hoped for: plenty more,
        # since the data sockets grow with jobs and peers (macOS starts processes at 256).
        ensure_open_files(MAX_HELD + cfg.max_unauth_connections + _SPARE_FILES, _WANT_FILES, "[daemon] mccld")
        key = cfg.read_key()
        self._fleet_key = key
        self.iface, self.addr = choose_address(cfg.iface, cfg.listen_addr, cfg.allow_wifi)
        self.runtime_dir = runtime_dir(cfg, create=True)
        self._lock_fd = lock_runtime_dir(self.runtime_dir)
        try:
            self.segments = SegmentRecord(self.runtime_dir)
            self.segments.sweep()
            stats_mod = _optional("mccld.report.stats")
            self.stats = stats_mod.DaemonStats() if stats_mod else None
            self._stat("set_state", "idle")
            self.harvester = Harvester(cfg, self.runtime_dir, self._count_running_jobs, self._on_harvest).start()
            self.pool = ReducePool()
            self.links = LinkManager(key, cfg.fleet, self.host_id, self.addr, cfg.port, cfg.link_timeout_s,
                                     self._on_link_message, self._on_peer, gate=Gate.from_config("link", cfg))
            self.datalinks = DataLinks(self.links, self.engine_cfg.sockets_per_peer, cfg.link_timeout_s).start()
            self.links.start()
            self._checker = threading.Thread(target=self._check_loop, name="mccld-checker", daemon=True)
            self._checker.start()
            self._start_servers(key)
            self._start_launcher()
            self._start_fleet()
            # Last: the token file it writes is what clients, mcclctl and tests take for
            # "mccld is up", so every service and thread of the daemon runs by then.
            self.inbox = FdInbox(self.runtime_dir, attach_gid(cfg)).start()
            self.attach = AttachServer(self.runtime_dir, self._handle, on_disconnect=self._poke.set,
                                       group=attach_gid(cfg))
            self.attach.start()
        except BaseException:
            self.stop()
            raise
        self.started = True
        log.info("mccld %s up: host %s fleet %s on %s (%s), attach %s", __version__, self.host_id,
                 cfg.fleet, self.links.address, self.iface or "address given", self.attach.endpoint)
        return self

    def stop(self, reason: str = "mccld is stopping") -> None:
        with self._lock:
            # Under the lock that joins take: a job is either in this list, and stopped below,
            # or its join sees the flag and is refused (its thread would outlive mccld).
            self._stop.set()
            jobs = list(self.jobs.values())
        self._poke.set()
        for job in jobs:
            job.fail(AbortedError(f"[daemon] job {job.id}: {reason}; restart the job once mccld is back"),
                     local=True)
            job.free_segments()
        for job in jobs:
            job.close(stopping=True)    # its threads end now, not with the process (an in-process mccld)
        if self.harvester is not None:
            self.harvester.stop()
            self.harvester = None
        for srv in reversed(self._servers):
            try:
                srv.stop()
            except Exception:  # noqa: BLE001 - keep tearing down
                log.debug("stopping %r failed", srv, exc_info=True)
        self._servers.clear()
        self.launcher = None
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
        if self.attach is not None:
            self.attach.stop()
            self.attach = None
        if self.inbox is not None:
            self.inbox.stop()
            self.inbox = None
        if self.datalinks is not None:
            self.datalinks.stop()
            self.datalinks = None
        if self.links is not None:
            self.links.stop()
            self.links = None
        if self._checker is not None:
            self._checker.join(timeout=2.0)
            self._checker = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._lock_fd is not None:
            # Last: until here our socket and token were still ours to remove.
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.started:
            log.info("mccld stopped")
        self.started = False

    def abort(self, reason: str) -> None:
        """Stop at once because something is badly wrong; clients see ``reason``."""
        log.error("[daemon] aborting: %s", reason)
        self.stop(reason)

    def _start_fleet(self) -> None:
        """mDNS when zeroconf is there (and the switch map on what it finds), then gossip."""
        ports = {type(s).__name__: s.port for s in self._servers}
        self.fleet = FleetView(self.cfg, self.host_id, self.addr, self.engine_cfg.topology)
        disc = _optional("mccl_common.discovery")
        if disc is not None:
            harvester = self.harvester
            self.fleet.start_discovery(disc, self.links, ports,
                                       harvester.snapshot()["state"] if harvester is not None else None)
        self.fleet.start_gossip(self.links, ports)

    def fleet_rows(self) -> list[dict[str, Any]]:
        fleet = self.fleet   # read once: stop() may clear it
        return fleet.rows() if fleet is not None else []

    def _start_servers(self, key: bytes) -> None:
        if self.stats is None:
            return
        if self.cfg.metrics_port:
            metrics = _optional("mccld.report.metrics")
            if metrics is not None:
                # Unauthenticated HTTP: on the fleet interface (where the links are) unless told.
                srv = metrics.MetricsServer(self.stats, self.cfg.metrics_addr or self.addr, self.cfg.metrics_port,
                                            host=self.host_id, data_links=self._data_link_status,
                                            gate=Gate.from_config("metrics", self.cfg, authenticates=False),
                                            gates=self._gates, presence=self.cfg.metrics_presence)
                srv.start()
                self._servers.append(srv)
        if self.cfg.status_port:
            status = _optional("mccld.report.status_server")
            if status is not None:
                srv = status.StatusServer(self.status_provider, key, self.addr, self.cfg.status_port,
                                          stats=self.stats, gate=Gate.from_config("status", self.cfg),
                                          capacity=self.capacity_provider)
                srv.start()
                self._servers.append(srv)

    def _start_launcher(self) -> None:
        """`mcclctl run`'s endpoint, when this host holds a submit key (launching is off otherwise)."""
        if not self.cfg.launch_port:
            return
        submit_key = self.cfg.read_submit_key()
        if submit_key is None:
            log.info("no submit key (MCCL_SUBMIT_KEY_FILE): `mcclctl run` cannot start jobs on this host")
            return
        if self.cfg.launch_user == "root":
            log.warning("MCCL_LAUNCH_USER=root: jobs that `mcclctl run` starts here run as root")
        harvester = self.harvester
        srv = LaunchServer(submit_key, self.host_id, self.runtime_dir, self.addr, self.cfg.launch_port,
                           launch_user=self.cfg.launch_user,
                           harvest_state=(lambda: harvester.snapshot()["state"]) if harvester else None,
                           on_change=self._poke.set, gate=Gate.from_config("launch", self.cfg),
                           secret_files=key_paths(self.cfg))
        self.launcher = srv.start()
        self._servers.append(srv)

    # -- helpers -----------------------------------------------------------------------------
    def _stat(self, method: str, *args) -> None:
        if self.stats is not None:
            try:
                getattr(self.stats, method)(*args)
            except ValueError:
                log.debug("stats.%s%r refused", method, args, exc_info=True)

    def reply(self, ident: bytes, req: int, payload: dict[str, Any]) -> None:
        if self.attach is not None:
            self.attach.reply(ident, req, payload)

    def reply_error(self, ident: bytes, req: int, exc: BaseException) -> None:
        self._stat("record_error", type(exc).__name__)
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.attach is not None:
            self.attach.reply_error(ident, req, exc)

    def record_collective(self, job: Job, op: str, nbytes: int, seconds: float) -> None:
        self._stat("record_collective", job.id, op, nbytes, seconds, job.size, len(job.hosts))
        # Poll now, while the engine exists: the checker alone misses the bytes of the
        # last collectives before a job closes (found by tests/e2e/test_grafana_daemon.py).
        self.poll_traffic(job)

    def job_closed(self, job: Job) -> None:
        with self._lock:
            if self.jobs.get(job.id) is job:
                del self.jobs[job.id]
            for key in [k for k in self._traffic if k[0] == job.id]:
                del self._traffic[key]
            # The record only has to name segments that may outlive us: those of live jobs.
            live = [name for j in self.jobs.values() for m in list(j.members.values()) for name in m.names()]
            if self.segments is not None:
                self.segments.keep_only(live)

    # -- the attach protocol ---------------------------------------------------------------
    def take_segment(self, ident: bytes, name: str) -> int:
        """The descriptor of segment ``name`` that the client behind ``ident`` handed over (the
        caller owns it); ProtocolError/AuthError if that client handed over none by that name."""
        if self.inbox is None or self.attach is None:
            raise AbortedError(f"[daemon] mccld is stopping; segment {name} not mapped")
        return self.inbox.take(name, self.attach.peer_of(ident))

    def _handle(self, ident: bytes, msg: protocol.Request) -> dict[str, Any] | None:
        kind = msg.type
        if kind == "hello":
            self._attach_client(ident, msg.pid)
            # How this daemon's engine cuts pipelined all-reduces: a client copies its input
            # only so far ahead of the results, and must stay ahead of every piece.
            cut = {"pipeline_bytes": self.engine_cfg.pipeline_bytes,
                   "small_allreduce_bytes": self.engine_cfg.small_allreduce_bytes}
            return {"ok": True, "host_id": self.host_id, "link_addr": self.links.address,
                    "daemon_version": __version__, "proto": PROTO_VERSION, "engine_cut": cut,
                    "switch": self.fleet.switch() if self.fleet is not None else ""}
        if kind == "status":
            return {"ok": True, "status": self.status_provider()}
        if kind == "probe":
            threading.Thread(target=self._probe, args=(ident, msg), daemon=True).start()
            return None
        job_id = msg.job
        if kind == "join":
            return self._join(ident, msg)
        job = self.jobs.get(job_id)
        if job is None:
            raise ProtocolError(f"[daemon] unknown job {job_id!r}; join it first")
        if kind == "register":
            job.register(msg.rank, ident, msg.segment, msg.nbytes, msg.buffer)
            with self._lock:
                self.segments.add(msg.segment)
            return {"ok": True}
        if kind == "release":
            # A buffer dropped before its register went out was only handed over: its
            # descriptor waits in the inbox, not in the job.
            if self.inbox is not None and self.attach is not None and self.inbox.discard(
                    msg.segment, self.attach.peer_of(ident)):
                return {"ok": True}
            job.release_buffer(msg.rank, ident, msg.segment)
            return {"ok": True}
        if kind == "op":
            msg.check_world(job.size)
            job.submit(ident, msg.req, msg)
            return None
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
                        if self.attach is not None:
                            self.attach.forget(ident)
            self._stat("set_attached", len(self.clients))
            return {"ok": True}
        raise ProtocolError(f"[daemon] unhandled request type {kind!r}")

    def _attach_client(self, ident: bytes, pid: int) -> None:
        """Record a connection that said hello. Connections never say goodbye (a CLI's one
        request, a communicator's set-up that failed), so past the per-process cap the longest
        idle one of that process (no job joined through it) makes room."""
        cap = self.cfg.max_attached_per_process
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
                if self.attach is not None:
                    self.attach.forget(idle[0])
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
            if self._stop.is_set():
                raise AbortedError(f"[daemon] job {job_id}: mccld is stopping, join refused; restart the "
                                   "job once mccld is back")
            job = self.jobs.get(job_id)
            fresh = job is None or job.state in ("failed", "closed") and not job.members
            if fresh:
                job = Job(self, job_id, msg.size, hosts, msg.timeout_s, msg.opts)
            try:
                job.join(ident, msg.req, rank, client["pid"], msg.size, hosts, msg.opts)
            except BaseException:
                if fresh:
                    job.close()   # its threads end now; it never was in the table
                raise
            if fresh:
                self.jobs[job_id] = job
            client["memberships"].add((job_id, rank))
        self._stat("set_state", "training")
        return None

    def _probe(self, ident: bytes, msg: protocol.Probe) -> None:
        started = time.monotonic()
        try:
            link = self.links.link_to(msg.addr)
        except Exception as e:  # noqa: BLE001 - every request is answered; non-MCCL errors read "internal"
            self.reply_error(ident, msg.req, e)
            return
        self.reply(ident, msg.req, {"ok": True, "host_id": link.peer_host,
                                    "seconds": time.monotonic() - started})

    # -- daemon-to-daemon --------------------------------------------------------------------
    def _on_link_message(self, peer_host: str, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind in ("data_lease", "data_ack", "data_want", "data_refused"):
            datalinks = self.datalinks
            if datalinks is not None:
                datalinks.on_message(peer_host, msg)
        elif isinstance(kind, str) and fleet_message(kind):
            fleet = self.fleet   # read once: stop() may clear it
            if fleet is not None:
                fleet.on_link_message(peer_host, kind, msg)
        elif kind == "job_failed":
            job = self.jobs.get(str(msg.get("job")))
            if job is None or all(h.host_id != peer_host for h in job.hosts):
                return
            err = protocol.error_from_payload(msg.get("error") or {})
            job.fail(err, local=False)
        else:
            raise ProtocolError(f"[link] unknown message type {kind!r} from {peer_host}")

    def _on_peer(self, peer_host: str, peer_addr: str, up: bool) -> None:
        self._stat("set_peer_up", peer_addr, up)

    def build_engine(self, job: Job) -> Any:
        """The engine communicator among the job's daemons, one rank per host, built on data
        sockets leased from the pool (datalinks.py); ``release_data_sockets`` gives them back."""
        try:
            from libmccl import _core
            Communicator, Options = _core.Communicator, _core.Options
        except (ImportError, AttributeError):
            raise ConfigError("[daemon] this build's engine has no Communicator, so a job spanning hosts "
                              "cannot run in daemon mode; rebuild MCCL (`make build`)") from None
        me = job.topo.host_rank
        # Only the hosts the engine's whole-world algorithms use (ring neighbours, fold and
        # hypercube partners: O(log hosts), symmetric) are leased now. The engine asks for any
        # other host when it first sends there (p2p, all-to-all, gather, scatter, reduce),
        # and ondemand.py leases it then, in the background; a receiver never asks, its
        # sender does. Hosts, not ranks, count here: a job of 200 ranks on 25 hosts.
        peers = [(h, job.hosts[h].host_id, job.hosts[h].link_addr) for h in setup_hosts(me, len(job.hosts))]
        leased = self.datalinks.lease(job.id, peers, time.monotonic() + job.setup_timeout_s, lambda: job.failed)
        # The links are built within the job's set-up time, not its op timeout: hosts reach this
        # point seconds apart on a loaded machine (attach_protocol.SETUP_TIMEOUT_FLOOR_S), and one late
        # host held every lower rank's handshakes past a 2 s op timeout (fault campaign, 6 Dec).
        opts = self.engine_cfg.engine_options(Options(), job.timeout_s, job.setup_timeout_s)
        # The job's host list (every rank built it alike) names each host's switch.
        opts.switch_of_rank = job_switches(job.hosts)
        if opts.switch_of_rank:
            log.info("[daemon] job %s: its %d hosts on %d switches, all-reduces from %d bytes run by switch (%s)",
                     job.id, len(job.hosts), len(set(opts.switch_of_rank)), opts.hierarchy_min_bytes,
                     "ring" if opts.hierarchy_ring else "tree")
        # The link addresses only name the peers in the engine's messages: nothing is dialled.
        addrs = [host.link_addr for host in job.hosts]
        # Bound to the fleet and the job: a host of another fleet, or a stale engine of an
        # earlier job on a pooled socket, cannot prove it (libmccl/csrc/transport/handshake.h).
        secret = (None if self.engine_cfg.wire_security == "off"
                  else jobkey.derive(self._fleet_key, "engine-job", self.cfg.fleet, job.id))
        try:
            # No completion callback: the job thread waits on each op, and a callback would make
            # the engine take the GIL once per op for nothing.
            on_demand = self.datalinks.on_demand
            engine = Communicator(me, len(job.hosts), job.comm_id,
                                  {h: [s.sock.fileno() for s in socks] for h, socks in leased.items()},
                                  addrs, opts, None, secret=secret, want=functools.partial(on_demand.want, job.id))
            on_demand.attach(job.id, engine, me, [(h.host_id, h.link_addr) for h in job.hosts], job.setup_timeout_s)
            return engine
        except BaseException:
            self.datalinks.give_back(job.id, clean=False)
            raise

    def release_data_sockets(self, job: Job, clean: bool) -> None:
        """The job's engine is shut down (or never will be); ``clean``: its sockets may serve the next job."""
        if self.datalinks is not None:
            self.datalinks.give_back(job.id, clean)

    def notify_peers_failed(self, job: Job, exc: MCCLError) -> None:
        msg = {"type": "job_failed", "job": job.id, "error": protocol.error_payload(exc)}
        targets = [h.link_addr for i, h in enumerate(job.hosts) if i != job.topo.host_rank]

        def send() -> None:  # off the caller's thread: it may hold the job's lock
            for addr in targets:
                try:
                    self.links.send(addr, msg)
                except (MCCLError, AttributeError) as e:
                    log.debug("could not tell %s that job %s failed: %s", addr, job.id, e)
        threading.Thread(target=send, name="mccld-notify", daemon=True).start()

    # -- periodic checks -----------------------------------------------------------------------
    def _check_loop(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self.cfg.client_check_s)
            self._poke.clear()
            try:
                self._check_once()
            except Exception:  # noqa: BLE001 - the checker must survive anything
                log.exception("[daemon] periodic check failed")

    def _check_once(self) -> None:
        with self._lock:
            clients = list(self.clients.items())
            jobs = list(self.jobs.values())
        gone = False
        for ident, client in clients:
            if not shm.pid_alive(client["pid"]):
                gone = True
                log.info("client pid %d is gone; freeing its segments", client["pid"])
                with self._lock:
                    self.clients.pop(ident, None)
                    memberships = list(client["memberships"])
                for job_id, rank in memberships:
                    job = self.jobs.get(job_id)
                    if job is not None:
                        job.client_died(rank)
                if self.attach is not None:
                    self.attach.forget(ident)
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
        if self.datalinks is not None:
            self.datalinks.sweep()
        with self._lock:
            busy = any(j.state == "ready" for j in self.jobs.values())
        self._stat("set_state", "training" if busy else "idle")
        fleet = self.fleet   # read once: stop() may clear it
        if fleet is not None:
            fleet.announce_state("training" if busy else "idle")
        running = self._count_running_jobs()
        if running != self._running_jobs and self.harvester is not None:
            # A lease starts or ends with its jobs: re-evaluate now, not at the next poll.
            self._running_jobs = running
            self.harvester.poke()

    def _count_running_jobs(self) -> int:
        launcher = self.launcher   # read once: stop() may clear it
        with self._lock:
            attached = sum(1 for j in self.jobs.values() if j.state in ("joining", "ready"))
        return attached + (launcher.running() if launcher is not None else 0)

    def _on_harvest(self, snapshot: dict[str, Any], changed: bool) -> None:
        launcher = self.launcher   # read once: stop() may clear it
        if changed and snapshot["state"] == "draining" and launcher is not None:
            launcher.drain()
        snapshot = {**snapshot, **self.reclaim.update(snapshot, changed, launcher)}
        self._stat("set_harvest", snapshot)
        fleet = self.fleet   # read once: stop() may clear it
        if fleet is not None:
            fleet.announce_harvest(snapshot["state"])

    def poll_traffic(self, job: Job) -> None:
        engine = job.engine
        if engine is None:
            return
        try:
            per_peer = engine.stats().get("per_peer", {})
        except Exception:  # noqa: BLE001 - stats are best effort
            return
        for rank, counters in per_peer.items():
            rank = int(rank)
            sent, recv = int(counters.get("sent", 0)), int(counters.get("received", 0))
            with self._traffic_lock:
                last = self._traffic.get((job.id, rank), (0, 0))
                self._traffic[(job.id, rank)] = (sent, recv)
            if (sent, recv) != last and 0 <= rank < len(job.hosts):
                self._stat("record_peer_traffic", job.hosts[rank].link_addr,
                           max(0, sent - last[0]), max(0, recv - last[1]))

    def _gates(self) -> list[Gate]:
        links = self.links  # read once: stop() may clear it
        return ([links.gate] if links is not None else []) + [s.gate for s in list(self._servers)]

    def _data_link_status(self) -> list[dict[str, Any]]:
        pool = self.datalinks  # read once: stop() may clear it between a check and a call
        return pool.status() if pool is not None else []

    def capacity_provider(self) -> dict[str, Any]:
        """What this host offers the fleet and when (``mcclctl capacity``): host facts, the harvest
        state and its transition history."""
        harvester = self.harvester   # read once: stop() may clear it
        if harvester is None:
            raise MCCLError("[daemon] mccld is stopping; no harvest state to report")
        harvest = harvester.snapshot()
        harvest.update(self.reclaim.fields(harvest["state"]))
        return {**host_facts(), "harvest": harvest, "history": harvester.history_records()}

    def _record_reclaim(self, seconds: float, how: str) -> None:
        self._stat("record_reclaim", seconds, how)

    def status_provider(self) -> dict[str, Any]:
        """What only the daemon knows (docs/dev/interfaces.md §4); the status server adds stats."""
        with self._lock:
            jobs = [{"job": j.id, "ranks": j.local_ranks, "world": j.size, "state": j.state,
                     "hosts": len(j.hosts), "attached": sorted(j.members)}
                    for j in self.jobs.values()]
            attached = len(self.clients)
        return {
            "host": self.host_id, "fleet": self.cfg.fleet, "address": self.links.address if self.links else "",
            "version": __version__, "proto": PROTO_VERSION, "attached": attached, "jobs": jobs,
            "links": self.links.peers() if self.links else [],
            "data_links": self._data_link_status(),
            "fleet_table": self.fleet_rows(),
            "topology": self.fleet.topology_status() if self.fleet is not None else None,
            "last_error": self.last_error or None,
            "launch_port": self.launcher.port if self.launcher is not None else 0,
            "launched": self.launcher.jobs() if self.launcher is not None else [],
        }
