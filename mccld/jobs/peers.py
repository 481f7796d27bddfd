"""What a job spanning hosts needs of the other hosts' daemons: its engine communicator, built
on data sockets leased from the pool (net/datalinks.py), their return at the job's end, and
the notice to the peer daemons that the job failed here (a ``job_failed`` link message)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from mccl_common import attach_protocol as protocol
from mccl_common import jobkey, topology
from mccl_common.errors import AbortedError, ConfigError, MCCLError
from mccl_common.settings import EngineConfig

from ..net.datalinks import DataLinks
from ..net.links import LinkManager
from ..net.ondemand import setup_hosts
from .job import Job

log = logging.getLogger(__name__)


def job_switches(hosts) -> list[int]:
    """The engine's switch_of_rank for a job's hosts (one engine rank each): empty, so flat,
    unless every host's daemon knows its switch and there are two or more."""
    names = [getattr(h, "switch", "") for h in hosts]
    return topology.switch_ids(names) if all(names) else []


class JobPeers:
    """``fleet_key`` is the root of every job's engine secret; ``links`` and ``datalinks`` are
    the daemon's, until ``unplug`` (mccld stopping) drops them."""

    def __init__(self, fleet_key: bytes, fleet: str, engine_cfg: EngineConfig, links: LinkManager,
                 datalinks: DataLinks):
        self._fleet_key, self._fleet, self._engine_cfg = fleet_key, fleet, engine_cfg
        self._links: LinkManager | None = links
        self._datalinks: DataLinks | None = datalinks

    def unplug(self) -> None:
        self._links = self._datalinks = None

    def build_engine(self, job: Job) -> Any:
        """The engine communicator among the job's daemons, one rank per host, built on data
        sockets leased from the pool; ``release_data_sockets`` gives them back."""
        try:
            from libmccl import _core
            Communicator, Options = _core.Communicator, _core.Options
        except (ImportError, AttributeError):
            raise ConfigError("[daemon] this build's engine has no Communicator, so a job spanning hosts "
                              "cannot run in daemon mode; rebuild MCCL (`make build`)") from None
        datalinks = self._datalinks
        if datalinks is None:
            raise AbortedError(f"[daemon] job {job.id}: mccld is stopping, no data sockets to build its engine "
                               "on; restart the job once mccld is back")
        me = job.topo.host_rank
        # Only the hosts the engine's whole-world algorithms use (ring neighbours, fold and
        # hypercube partners: O(log hosts), symmetric) are leased now. The engine asks for any
        # other host when it first sends there (p2p, all-to-all, gather, scatter, reduce),
        # and ondemand.py leases it then, in the background; a receiver never asks, its
        # sender does. Hosts, not ranks, count here: a job of 200 ranks on 25 hosts.
        peers = [(h, job.hosts[h].host_id, job.hosts[h].link_addr) for h in setup_hosts(me, len(job.hosts))]
        leased = datalinks.lease(job.id, peers, time.monotonic() + job.setup_timeout_s, lambda: job.failed)
        # The links are built within the job's set-up time, not its op timeout: hosts reach this
        # point seconds apart on a loaded machine (attach_protocol.SETUP_TIMEOUT_FLOOR_S), and one late
        # host held every lower rank's handshakes past a 2 s op timeout (fault campaign, 6 Dec).
        opts = self._engine_cfg.engine_options(Options(), job.timeout_s, job.setup_timeout_s)
        # The job's compression, as its ranks asked (every rank alike: job.py, the clients); the
        # cap on its residuals stays this daemon's (MCCL_COMPRESSION_FEEDBACK_MAX_BYTES).
        opts.compression = job.compression.codec
        opts.compression_min_bytes = job.compression.min_bytes
        opts.compression_feedback = job.compression.feedback
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
        secret = (None if self._engine_cfg.wire_security == "off"
                  else jobkey.derive(self._fleet_key, "engine-job", self._fleet, job.id))
        try:
            # No completion callback: the job thread waits on each op, and a callback would make
            # the engine take the GIL once per op for nothing.
            on_demand = datalinks.on_demand
            engine = Communicator(me, len(job.hosts), job.comm_id,
                                  {h: [s.sock.fileno() for s in socks] for h, socks in leased.items()},
                                  addrs, opts, None, secret=secret, want=functools.partial(on_demand.want, job.id))
            on_demand.attach(job.id, engine, me, [(h.host_id, h.link_addr) for h in job.hosts], job.setup_timeout_s)
            return engine
        except BaseException:
            datalinks.give_back(job.id, clean=False)
            raise

    def release_data_sockets(self, job: Job, clean: bool) -> None:
        """The job's engine is shut down (or never will be); ``clean``: its sockets may serve the next job."""
        datalinks = self._datalinks
        if datalinks is not None:
            datalinks.give_back(job.id, clean)

    def notify_failed(self, job: Job, exc: MCCLError) -> None:
        msg = {"type": "job_failed", "job": job.id, "error": protocol.error_payload(exc)}
        targets = [h.link_addr for i, h in enumerate(job.hosts) if i != job.topo.host_rank]
        links = self._links

        def send() -> None:  # off the caller's thread: it may hold the job's lock
            for addr in targets:
                try:
                    links.send(addr, msg)
                except (MCCLError, AttributeError) as e:
                    log.debug("could not tell %s that job %s failed: %s", addr, job.id, e)
        threading.Thread(target=send, name="mccld-notify", daemon=True).start()

    @staticmethod
    def verdict(job: Job | None, peer_host: str, msg: dict[str, Any]) -> None:
        """A peer daemon's ``job_failed``: fail ``job`` here too, if that peer runs part of it."""
        if job is None or all(h.host_id != peer_host for h in job.hosts):
            return
        job.fail(protocol.error_from_payload(msg.get("error") or {}), local=False)
