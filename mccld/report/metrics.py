"""Prometheus exporter: a Collector that renders ``DaemonStats.snapshot()`` at each scrape.

Nothing is copied into prometheus_client's own metric objects: the collector reads the
daemon's live state when Prometheus asks, so there is one source of truth and no
update cost on the daemon's hot path. Names use base units (seconds, bytes) and
``_total`` on counters, all prefixed ``mccl_``.

HTTP has no authentication, so what it says is public to whoever reaches the port. The
daemon binds it to the fleet interface's address (the one its links use) unless
``MCCL_METRICS_ADDR`` says otherwise, so a Prometheus of the fleet reaches it and the
rest of the world (a café's Wi-Fi) does not. Figures that tell when the host's user is
at it or away (seconds since the last input, harvestable seconds per night) are only
exported with ``MCCL_METRICS_PRESENCE=1``: a burglar or a nosy colleague must not learn
from an open port when a home is empty.
"""

from __future__ import annotations

import logging
import platform
import socket
import threading
import time
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily, Metric)
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector

from mccl_common import errors as _errors
from mccl_common.errors import ConfigError
from mccl_common.hostinfo import host_facts
from mccl_common.status_protocol import HARVEST_STATES

from ..net.gate import REWARN_S, Gate
from ..logutil import OnceLogger
from .stats import STATES, DaemonStats

log = logging.getLogger(__name__)

ERROR_KINDS = tuple(sorted(name for name in _errors.__all__
                           if isinstance(getattr(_errors, name), type)))

# Training-job series use "job_id": Prometheus already attaches "job" (the scrape job)
# to every series, and a clash would rename ours to "exported_job".


def _fmt_bound(b: float) -> str:
    return repr(float(b))


class StatsCollector(Collector):
    """Renders one DaemonStats as Prometheus metric families, live at every scrape."""

    def __init__(self, stats: DaemonStats, host: str | None = None,
                 data_links: Callable[[], list[dict[str, Any]]] | None = None,
                 gates: Callable[[], list[Gate]] | None = None, presence: bool = False) -> None:
        self._stats = stats
        self._presence = presence      # export the user-presence figures (MCCL_METRICS_PRESENCE)
        self._host = host or socket.gethostname()
        self._data_links = data_links  # the daemon's data-socket pool, per peer host
        self._gates = gates            # the daemon's ports' unauthenticated connections

    def collect(self) -> Iterable[Metric]:
        snap = self._stats.snapshot()
        yield from self._host_metrics(snap)
        yield from self._harvest_metrics(snap.get("harvest"), self._presence)
        yield from self._reclaim_metrics(snap)
        yield from self._collective_metrics(snap)
        yield from self._peer_metrics(snap)
        yield from self._job_metrics(snap)
        if self._data_links is not None:
            yield from self._data_link_metrics(self._data_links())
        if self._gates is not None:
            yield from self._gate_metrics(self._gates())

    @staticmethod
    def _gate_metrics(gates: list[Gate]) -> Iterable[Metric]:
        open_ = GaugeMetricFamily("mccl_unauth_connections", "Connections to a port of the daemon that have "
                                  "not authenticated yet", labels=["port"])
        closed = CounterMetricFamily("mccl_unauth_connections_closed", "Unauthenticated connections the daemon "
                                     "closed: over a cap at accept, or at their handshake deadline",
                                     labels=["port", "reason"])
        for g in gates:
            open_.add_metric([g.name], g.unauthenticated())
            closed.add_metric([g.name, "over_cap"], g.refused)
            closed.add_metric([g.name, "deadline"], g.expired)
        yield from (open_, closed)

    @staticmethod
    def _data_link_metrics(pools: list[dict[str, Any]]) -> Iterable[Metric]:
        socks = GaugeMetricFamily("mccl_data_sockets", "Authenticated data sockets to a peer daemon: idle in "
                                  "the pool, or leased to a job", labels=["peer_host", "state"])
        opened = CounterMetricFamily("mccl_data_sockets_opened", "Data sockets opened with a peer daemon, "
                                     "dialled by this daemon or accepted from the peer", labels=["peer_host", "direction"])
        discarded = CounterMetricFamily("mccl_data_sockets_discarded", "Data sockets closed instead of reused: "
                                        "a job ended them unclean, or the peer closed them while idle",
                                        labels=["peer_host"])
        for pool in pools:
            peer = str(pool["host"])
            socks.add_metric([peer, "idle"], pool["idle"])
            socks.add_metric([peer, "leased"], pool["leased"])
            opened.add_metric([peer, "dialled"], pool["dialled"])
            opened.add_metric([peer, "accepted"], pool["accepted"])
            discarded.add_metric([peer], pool["discarded"])
        yield from (socks, opened, discarded)

    def _host_metrics(self, snap: dict) -> Iterable[Metric]:
        info = InfoMetricFamily("mccl_build", "MCCL build running on this host")
        info.add_metric([], {"version": snap["version"], "hostname": self._host,
                             "python": platform.python_version(), "system": platform.system()})
        yield info
        yield GaugeMetricFamily("mccl_start_time_seconds", "Daemon start time, seconds since the epoch",
                                value=snap["start_time"])
        yield GaugeMetricFamily("mccl_uptime_seconds", "Seconds since the daemon started",
                                value=snap["uptime_s"])
        state = GaugeMetricFamily("mccl_host_state", "1 for the daemon's current state, 0 for the others",
                                  labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if snap["state"] == name else 0.0)
        yield state
        yield GaugeMetricFamily("mccl_attached_processes",
                                "Training processes attached to this daemon", value=snap["attached"])
        errors = CounterMetricFamily("mccl_errors", "Errors seen by the daemon, by exception class",
                                     labels=["kind"])
        # Every known kind is exported from the start (at 0), so rate()/increase() work
        # from the first error on and "no errors" reads as 0, not as missing data.
        counts = dict.fromkeys(ERROR_KINDS, 0)
        counts.update(snap["errors"])
        for kind, n in sorted(counts.items()):
            errors.add_metric([kind], n)
        yield errors

    @staticmethod
    def _harvest_metrics(harvest: dict | None, presence: bool) -> Iterable[Metric]:
        facts = host_facts()
        yield GaugeMetricFamily("mccl_host_cpu_cores", "CPU cores of this host", value=facts["cores"])
        yield GaugeMetricFamily("mccl_host_memory_bytes", "Physical memory of this host",
                                value=facts["memory_bytes"])
        if harvest is None:   # stats without a harvest monitor (a bare DaemonStats)
            return
        state = GaugeMetricFamily("mccl_harvest_state", "1 for the host's harvest state (busy, idle, leased, "
                                  "draining), 0 for the others", labels=["state"])
        for name in HARVEST_STATES:
            state.add_metric([name], 1.0 if harvest["state"] == name else 0.0)
        yield state
        if not presence:
            return
        if harvest.get("idle_s") is not None:
            yield GaugeMetricFamily("mccl_host_idle_seconds", "Seconds since the last user input on this host",
                                    value=harvest["idle_s"])
        yield GaugeMetricFamily("mccl_harvest_nights", "Complete nights (noon to noon) of harvest history that "
                                "mccl_harvestable_seconds_per_night averages", value=harvest.get("nights") or 0)
        if harvest.get("harvestable_s_per_night") is not None:
            yield GaugeMetricFamily("mccl_harvestable_seconds_per_night", "Mean seconds per night (noon to "
                                    "noon) the host was idle or leased, over the recent nights",
                                    value=harvest["harvestable_s_per_night"])

    @staticmethod
    def _reclaim_metrics(snap: dict) -> Iterable[Metric]:
        bounds = [_fmt_bound(b) for b in snap["reclaim_buckets_s"]] + ["+Inf"]
        hist = HistogramMetricFamily("mccl_reclaim_seconds", "Seconds from the host's user coming back to the "
                                     "host free of job processes, by how the jobs went (left at a step "
                                     "boundary or ended; removed at MCCL_RECLAIM_GRACE)", labels=["how"])
        for how, h in sorted(snap["reclaims"].items()):
            hist.add_metric([how], list(zip(bounds, h["cumulative"] + [h["count"]])), h["sum_s"])
        yield hist

    def _collective_metrics(self, snap: dict) -> Iterable[Metric]:
        bounds = [_fmt_bound(b) for b in snap["duration_buckets_s"]] + ["+Inf"]
        hist = HistogramMetricFamily("mccl_collective_duration_seconds",
                                     "Duration of completed collectives, by op and message size class",
                                     labels=["op", "size_bucket"])
        for c in sorted(snap["collectives"], key=lambda c: (c["op"], c["size_bucket"])):
            buckets = list(zip(bounds, c["cumulative"] + [c["count"]]))
            hist.add_metric([c["op"], c["size_bucket"]], buckets, c["sum_s"])
        yield hist
        nbytes = CounterMetricFamily("mccl_collective_bytes", "Buffer bytes of completed collectives "
                                     "(per-rank buffer, nccl-tests convention)", labels=["op"])
        bus = CounterMetricFamily("mccl_collective_bus_bytes", "Bytes each link carried for completed "
                                  "collectives (buffer bytes x bus factor)", labels=["op"])
        busbw = GaugeMetricFamily("mccl_busbw_bytes_per_second", "Bus bandwidth over the collectives "
                                  "completed in the last 10 s", labels=["op"])
        ratio = GaugeMetricFamily("mccl_busbw_link_ratio", "Bus bandwidth as a fraction of the slowest "
                                  "live link's goodput ceiling from the last link test", labels=["op"])
        ceiling = self._slowest_ceiling_bytes(snap)
        for op, o in sorted(snap["ops"].items()):
            nbytes.add_metric([op], o["bytes"])
            bus.add_metric([op], o["bus_bytes"])
            if o["busbw_bytes_per_s"] is not None and o["bus_bytes"] > 0:
                busbw.add_metric([op], o["busbw_bytes_per_s"])
                if ceiling:
                    ratio.add_metric([op], o["busbw_bytes_per_s"] / ceiling)
        yield from (nbytes, bus, busbw, ratio)

    @staticmethod
    def _slowest_ceiling_bytes(snap: dict) -> float | None:
        # A ring runs at the pace of its slowest link, so that is the ceiling to compare
        # with; peers known to be down are excluded, peers never tested are unknown.
        ceilings = [p["ceiling_bits_per_s"] / 8.0 for p in snap["peers"].values()
                    if p["ceiling_bits_per_s"] and p["up"] is not False]
        return min(ceilings) if ceilings else None

    @staticmethod
    def _peer_metrics(snap: dict) -> Iterable[Metric]:
        sent = CounterMetricFamily("mccl_peer_sent_bytes", "Bytes sent to a peer daemon", labels=["peer"])
        recv = CounterMetricFamily("mccl_peer_received_bytes", "Bytes received from a peer daemon",
                                   labels=["peer"])
        up = GaugeMetricFamily("mccl_peer_up", "1 while the link to the peer is up", labels=["peer"])
        ceiling = GaugeMetricFamily("mccl_link_ceiling_bytes_per_second",
                                    "TCP goodput to the peer measured by the last link test", labels=["peer"])
        for peer, p in sorted(snap["peers"].items()):
            sent.add_metric([peer], p["sent_bytes"])
            recv.add_metric([peer], p["received_bytes"])
            if p["up"] is not None:
                up.add_metric([peer], 1.0 if p["up"] else 0.0)
            if p["ceiling_bits_per_s"]:
                ceiling.add_metric([peer], p["ceiling_bits_per_s"] / 8.0)
        yield from (sent, recv, up, ceiling)

    @staticmethod
    def _job_metrics(snap: dict) -> Iterable[Metric]:
        latest = GaugeMetricFamily("mccl_overlap_ratio", "Latest overlap ratio a training process "
                                   "reported: 1 - exposed comm time / total comm time",
                                   labels=["job_id", "rank"])
        mean = GaugeMetricFamily("mccl_overlap_ratio_mean", "Running mean of the overlap ratio "
                                 "reported by a training process", labels=["job_id", "rank"])
        for ov in sorted(snap["overlap"], key=lambda o: (o["job"], o["rank"])):
            labels = [ov["job"], str(ov["rank"])]
            latest.add_metric(labels, ov["latest"])
            mean.add_metric(labels, ov["mean"])
        speed = GaugeMetricFamily("mccl_rank_speed_samples_per_second", "A training rank's measured compute "
                                  "speed (SpeedBalancer; 0 before its first measurement)", labels=["job_id", "rank"])
        share = GaugeMetricFamily("mccl_rank_batch_share", "Samples of the global batch a rank computes per "
                                  "step (SpeedBalancer's plan)", labels=["job_id", "rank"])
        for b in sorted(snap.get("balance", []), key=lambda o: (o["job"], o["rank"])):
            labels = [b["job"], str(b["rank"])]
            speed.add_metric(labels, b["speed"])
            share.add_metric(labels, b["share"])
        yield from (speed, share)
        world = GaugeMetricFamily("mccl_job_world_size", "Ranks of a job active in the last 5 minutes",
                                  labels=["job_id"])
        ops = CounterMetricFamily("mccl_job_collectives", "Collectives this daemon completed for a job",
                                  labels=["job_id"])
        nbytes = CounterMetricFamily("mccl_job_bytes", "Buffer bytes of a job's completed collectives",
                                     labels=["job_id"])
        # Bytes before and after compression (MCCL_COMPRESSION, docs/compression.md): what this
        # host contributed to all-reduces across hosts, and the same as encoded for the wire; the
        # engine's own count of what it sent beside them (every op, the all-gather of results too).
        reduced = CounterMetricFamily("mccl_job_allreduce_input_bytes", "All-reduce and reduce-scatter input "
                                      "this host contributed across hosts (after its ranks' exact local sum), "
                                      "before compression", labels=["job_id", "compression"], unit="bytes")
        encoded = CounterMetricFamily("mccl_job_allreduce_encoded_bytes", "The same contributions as encoded "
                                      "for the wire (equal to the input where the op ran exact)",
                                      labels=["job_id", "compression"], unit="bytes")
        wire = CounterMetricFamily("mccl_job_wire_bytes", "Bytes a job's engine on this host sent to other "
                                   "hosts (every op, frames included)", labels=["job_id"], unit="bytes")
        for job, j in sorted(snap["jobs"].items()):
            world.add_metric([job], j["world"])
            ops.add_metric([job], j["ops"])
            nbytes.add_metric([job], j["bytes"])
            codec = j.get("compression", "off")
            reduced.add_metric([job, codec], j.get("allreduce_input_bytes", 0))
            encoded.add_metric([job, codec], j.get("allreduce_encoded_bytes", 0))
            wire.add_metric([job], j.get("wire_bytes", 0))
        yield from (latest, mean, world, ops, nbytes, reduced, encoded, wire)


def make_registry(stats: DaemonStats, host: str | None = None,
                  data_links: Callable[[], list[dict[str, Any]]] | None = None,
                  gates: Callable[[], list[Gate]] | None = None, presence: bool = False) -> CollectorRegistry:
    """A registry holding only this daemon's collector (no process/GC default metrics);
    ``presence``: with the user-presence figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats, host, data_links, gates, presence))
    return registry


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not worth a log line each."""


class _BoundedWSGIServer(WSGIServer):
    """A thread per connection, as prometheus_client's own server, but only for the connections
    the gate admits and for as long as its deadline: that server starts a thread for every
    connection and waits on each without a deadline, so dribbling peers pile up threads and fds."""

    def __init__(self, addr: tuple[str, int], gate: Gate):
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.gate = gate
        self._once = OnceLogger(log, rewarn_s=REWARN_S)
        super().__init__(addr, _QuietHandler)

    def get_request(self) -> tuple[socket.socket, tuple]:
        # socketserver drops a failed accept() and polls again; out of fds (EMFILE) the
        # connection stays queued, so the poll returns at once and the loop would spin: pause.
        try:
            return super().get_request()
        except OSError as e:
            self._once.warn(f"accept:{e.errno}", "[metrics] accept() failed: %s; retrying (out of file "
                            "descriptors? raise the service's LimitNOFILE / ulimit -n)", e)
            time.sleep(0.1)
            raise

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        ticket = self.gate.admit(request, client_address[0])
        if ticket is not None:
            threading.Thread(target=self._serve_one, args=(request, client_address, ticket),
                             name="mccld-metrics-conn", daemon=True).start()

    def _serve_one(self, request: socket.socket, client_address: tuple, ticket) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError as e:
            log.debug("metrics connection from peer=%s ended early: %s", client_address[0], e)
        except Exception:  # noqa: BLE001 - one bad scrape must not take the thread's caller down
            log.exception("[metrics] serving peer=%s failed", client_address[0])
        finally:
            ticket.release()  # before the close: the gate's watchdog must not shut down a reused fd
            self.shutdown_request(request)


class MetricsServer:
    """Serves ``/metrics`` over HTTP for one DaemonStats. ``port=0`` picks a free port.
    HTTP has no authentication, so a whole scrape counts as unauthenticated (``gate``)."""

    def __init__(self, stats: DaemonStats, addr: str = "127.0.0.1", port: int = 29652,
                 host: str | None = None, data_links: Callable[[], list[dict[str, Any]]] | None = None,
                 gate: Gate | None = None, gates: Callable[[], list[Gate]] | None = None,
                 presence: bool = False) -> None:
        self._registry = make_registry(stats, host, data_links, gates, presence)
        self._addr = addr
        self._port = port
        self._gate = gate or Gate.from_config("metrics")
        self._httpd: _BoundedWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1] if self._httpd else self._port

    @property
    def address(self) -> str:
        return f"{self._addr}:{self.port}"

    @property
    def gate(self) -> Gate:
        return self._gate

    def start(self) -> None:
        if self._httpd is not None:
            return
        try:
            httpd = _BoundedWSGIServer((self._addr, self._port), self._gate)
        except OSError as e:
            raise ConfigError(
                f"[metrics] cannot serve /metrics on {self._addr}:{self._port}: {e.strerror}; "
                f"another process (a second mccld?) holds the port or the address is not local; "
                f"stop it or set MCCL_METRICS_PORT / MCCL_METRICS_ADDR") from e
        httpd.set_app(make_wsgi_app(self._registry))
        self._httpd = httpd
        self._gate.start()
        self._thread = threading.Thread(target=httpd.serve_forever, name="mccld-metrics", daemon=True)
        self._thread.start()
        log.info("serving Prometheus metrics on http://%s/metrics", self.address)

    def stop(self, timeout_s: float = 5.0) -> None:
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                log.warning("metrics server thread did not stop within %.1f s", timeout_s)
        self._gate.close()
        self._httpd = self._thread = None
