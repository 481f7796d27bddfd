"""The daemon: wires config, links, discovery, the attach endpoint, the jobs it hosts and the
host it lends together; the services themselves live in net/, jobs/, host/ and report/.

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
from pathlib import Path
from typing import Any

from mccl_common import __version__
from mccl_common.daemon_settings import DaemonConfig, attach_gid, key_paths, runtime_dir
from mccl_common.errors import ConfigError, ProtocolError
from mccl_common.fd_limit import ensure_open_files
from mccl_common.netif import choose_address, interface_of
from mccl_common.settings import EngineConfig, load

from .attach import AttachServer
from .fd_inbox import MAX_HELD, FdInbox
from .host import job_unit
from .host.launcher import LaunchServer, torchrun_command
from .host.lending import Lending
from .host.runtime_dir import SegmentRecord, lock_runtime_dir
from .jobs.peers import JobPeers
from .jobs.reduce import ReducePool
from .jobs.service import JobService
from .net.datalinks import DataLinks
from .net.fleet import FleetView, carries as fleet_message
from .net.gate import Gate
from .net.links import LinkManager
from .report.daemon_status import capacity, daemon_status

log = logging.getLogger(__name__)

_SPARE_FILES = 256     # clients, data sockets, segments beyond the inbox's and the gate's caps
_WANT_FILES = 65536    # the soft limit mccld raises itself to, when the hard limit allows


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
        if self.engine_cfg.compression != "off":
            # Each job's ranks choose it (their join carries it); said, not silently dropped.
            log.warning("[mccld] MCCL_COMPRESSION=%s in mccld's environment has no effect: each job compresses "
                        "as its training processes' MCCL_COMPRESSION (or Options) says; unset it here",
                        self.engine_cfg.compression)
        self.host_id = cfg.host_id or default_host_id()
        self.addr = ""
        self.iface = ""
        self._iface_shown = ""
        self.pool: ReducePool | None = None
        self.links: LinkManager | None = None
        self.datalinks: DataLinks | None = None
        self.jobs: JobService | None = None      # kept after stop: a late request is refused by it
        self.attach: AttachServer | None = None
        self.inbox: FdInbox | None = None
        self.stats = None
        self.fleet: FleetView | None = None
        self.launcher: LaunchServer | None = None
        self.lending = Lending(cfg, self._stat, self._announce_harvest)
        self._servers: list[Any] = []
        self.started = False
        self.runtime_dir: Path | None = None
        self.segments: SegmentRecord | None = None
        self._lock_fd: int | None = None     # flock on the runtime dir's lock file, held while we serve it

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Daemon":
        if self.started:
            return self
        cfg = self.cfg
        # Needed: the descriptors the fd inbox may hold and the unauthenticated connections it
        # admits, plus room for clients, data sockets and segments; hoped for: plenty more,
        # since the data sockets grow with jobs and peers (macOS starts processes at 256).
        ensure_open_files(MAX_HELD + cfg.max_unauth_connections + _SPARE_FILES, _WANT_FILES, "[daemon] mccld")
        key = cfg.read_key()   # the root of every job's engine secret too
        self.iface, self.addr = choose_address(cfg.iface, cfg.listen_addr, cfg.allow_wifi)
        # An address given by MCCL_LISTEN_ADDR still lies on some interface: status names it.
        self._iface_shown = self.iface or interface_of(self.addr)
        self.runtime_dir = runtime_dir(cfg, create=True)
        self._lock_fd = lock_runtime_dir(self.runtime_dir)
        try:
            self.segments = SegmentRecord(self.runtime_dir)
            self.segments.sweep()
            stats_mod = _optional("mccld.report.stats")
            self.stats = stats_mod.DaemonStats() if stats_mod else None
            self._stat("set_state", "idle")
            self.pool = ReducePool()
            self.links = LinkManager(key, cfg.fleet, self.host_id, self.addr, cfg.port, cfg.link_timeout_s,
                                     self._on_link_message, self._on_peer, gate=Gate.from_config("link", cfg))
            self.datalinks = DataLinks(self.links, self.engine_cfg.sockets_per_peer, cfg.link_timeout_s).start()
            self.links.start()
            peers = JobPeers(key, cfg.fleet, self.engine_cfg, self.links, self.datalinks)
            self.jobs = JobService(self.host_id, cfg, self.engine_cfg, self.pool, self.links, peers, self.segments,
                                   self._stat, self.status_provider, self._switch, self._checked).start()
            self.lending.start(self.runtime_dir, self.jobs.running)
            self._start_servers(key)
            self._start_launcher()
            self._start_fleet()
            # Last: the token file it writes is what clients, mcclctl and tests take for
            # "mccld is up", so every service and thread of the daemon runs by then.
            self.inbox = FdInbox(self.runtime_dir, attach_gid(cfg)).start()
            self.attach = AttachServer(self.runtime_dir, self.jobs.handle, on_disconnect=self.jobs.poke,
                                       group=attach_gid(cfg))
            self.jobs.serve(self.attach, self.inbox)
            self.attach.start()
        except BaseException:
            self.stop()
            raise
        self.started = True
        log.info("mccld %s up: host %s fleet %s on %s (%s), attach %s", __version__, self.host_id,
                 cfg.fleet, self.links.address, self.iface or "address given", self.attach.endpoint)
        return self

    def stop(self, reason: str = "mccld is stopping") -> None:
        jobs = self.jobs
        if jobs is not None:
            jobs.stop(reason)
        self.lending.stop()
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
        if jobs is not None:
            jobs.unplug()
        for part in ("attach", "inbox", "datalinks", "links"):
            if getattr(self, part) is not None:
                getattr(self, part).stop()
                setattr(self, part, None)
        if jobs is not None:
            jobs.close()
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
        """mDNS when zeroconf is there and MCCL_DISCOVERY allows it (and the switch map on what it
        finds), then gossip."""
        ports = {type(s).__name__: s.port for s in self._servers}
        self.fleet = FleetView(self.cfg, self.host_id, self.addr, self.engine_cfg.topology)
        disc = _optional("mccl_common.discovery") if self.cfg.discovery == "mdns" else None
        if disc is None and self.cfg.discovery == "off":
            log.info("mDNS off (MCCL_DISCOVERY=off): the fleet is found through MCCL_PEERS and gossip only")
        if disc is not None:
            self.fleet.start_discovery(disc, self.links, ports, self.lending.state())
        self.fleet.start_gossip(self.links, ports)

    def _start_servers(self, key: bytes) -> None:
        if self.stats is None:
            return
        if self.cfg.metrics_port:
            metrics = _optional("mccld.report.metrics")
            if metrics is not None:
                # Unauthenticated HTTP: on the fleet interface (where the links are) unless told.
                srv = metrics.MetricsServer(self.stats, self.cfg.metrics_addr or self.addr, self.cfg.metrics_port,
                                            host=self.host_id, data_links=self.datalinks.status,
                                            gate=Gate.from_config("metrics", self.cfg, authenticates=False),
                                            gates=self._gates, presence=self.cfg.metrics_presence)
                srv.start()
                self._servers.append(srv)
        if self.cfg.status_port:
            status = _optional("mccld.report.status_server")
            if status is not None:
                srv = status.StatusServer(self.status_provider, key, self.addr, self.cfg.status_port,
                                          stats=self.stats, gate=Gate.from_config("status", self.cfg),
                                          capacity=functools.partial(capacity, self.lending))
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
        harvester = self.lending.harvester
        via = job_unit.choose(self.cfg.launch_via)
        log.info("launched jobs run %s", "as systemd units of their own, outside mccld's sandbox"
                 if via == "systemd" else "as mccld's children")
        command = (functools.partial(torchrun_command, python=self.cfg.launch_python) if self.cfg.launch_python
                   else torchrun_command)
        srv = LaunchServer(submit_key, self.host_id, self.runtime_dir, self.addr, self.cfg.launch_port,
                           launch_user=self.cfg.launch_user, via=via, command=command,
                           harvest_state=(lambda: harvester.snapshot()["state"]) if harvester else None,
                           on_change=self.jobs.poke, gate=Gate.from_config("launch", self.cfg),
                           secret_files=key_paths(self.cfg))
        self.launcher = self.lending.launcher = srv.start()
        self._servers.append(srv)

    # -- what the services tell each other ---------------------------------------------------
    def _stat(self, method: str, *args) -> None:
        if self.stats is not None:
            try:
                getattr(self.stats, method)(*args)
            except ValueError:
                log.debug("stats.%s%r refused", method, args, exc_info=True)

    def _on_link_message(self, peer_host: str, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind in ("data_lease", "data_ack", "data_want", "data_refused"):
            datalinks = self.datalinks   # read once: stop() may clear it
            if datalinks is not None:
                datalinks.on_message(peer_host, msg)
        elif isinstance(kind, str) and fleet_message(kind):
            fleet = self.fleet
            if fleet is not None:
                fleet.on_link_message(peer_host, kind, msg)
        elif kind == "job_failed":
            jobs = self.jobs
            if jobs is not None:
                jobs.on_peer_failed(peer_host, msg)
        else:
            raise ProtocolError(f"[link] unknown message type {kind!r} from {peer_host}")

    def _on_peer(self, peer_host: str, peer_addr: str, up: bool) -> None:
        self._stat("set_peer_up", peer_addr, up)

    def _switch(self) -> str:
        fleet = self.fleet   # read once: stop() may clear it
        return fleet.switch() if fleet is not None else ""

    def _announce_harvest(self, state: str) -> None:
        fleet = self.fleet
        if fleet is not None:
            fleet.announce_harvest(state)

    def _checked(self, busy: bool) -> None:
        """After each periodic check of the jobs: idle data sockets, the state shown and
        announced, and the harvest lease follow."""
        datalinks = self.datalinks
        if datalinks is not None:
            datalinks.sweep()
        self._stat("set_state", "training" if busy else "idle")
        fleet = self.fleet
        if fleet is not None:
            fleet.announce_state("training" if busy else "idle")
        self.lending.recount()

    def _gates(self) -> list[Gate]:
        links = self.links  # read once: stop() may clear it
        return ([links.gate] if links is not None else []) + [s.gate for s in list(self._servers)]

    def status_provider(self) -> dict[str, Any]:
        """What only the daemon knows (docs/dev/interfaces.md §4); the status server adds stats."""
        return daemon_status(self.host_id, self.cfg.fleet, self.jobs, self.links, self.datalinks, self.fleet,
                             self.launcher, self.endpoints())

    def endpoints(self) -> dict[str, Any]:
        """The interface and ports this daemon listens on, as bound (0: that endpoint is off)."""
        links = self.links   # read once: stop() may clear it
        servers = {type(s).__name__: s for s in list(self._servers)}
        metrics = servers.get("MetricsServer")
        return {"iface": self._iface_shown, "addr": self.addr,
                "link_port": int(links.address.rsplit(":", 1)[1]) if links and links.address else 0,
                "status_port": servers["StatusServer"].port if "StatusServer" in servers else 0,
                "metrics_port": metrics.port if metrics is not None else 0,
                "metrics_addr": metrics.address.rsplit(":", 1)[0] if metrics is not None else "",
                "launch_port": self.launcher.port if self.launcher is not None else 0,
                "discovery": self.cfg.discovery}
