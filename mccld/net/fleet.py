"""The fleet as one daemon sees it: mDNS on its own subnet (when zeroconf is there), gossip
over the authenticated links for every other subnet, and this host's switch, inferred from
RTTs to a sample of that fleet. What the daemon announces of itself (training or idle, its
harvest state) goes out through both."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from mccl_common import PROTO_VERSION, __version__
from mccl_common.daemon_settings import DaemonConfig
from mccl_common.hostinfo import cpu_cores, device_kind, memory_bytes

from .gossip import Gossip
from .links import LinkManager
from .topology import SwitchMap, fleet_peers

log = logging.getLogger(__name__)

TOPOLOGY_TYPES = ("rtt_ping", "rtt_pong", "topo_row_req", "topo_row")


def carries(kind: str) -> bool:
    """Whether a link message of this type is the fleet view's (gossip, topology)."""
    return kind.startswith("gossip_") or kind in TOPOLOGY_TYPES


class FleetView:
    def __init__(self, cfg: DaemonConfig, host_id: str, addr: str, topology: str):
        self.cfg = cfg
        self.host_id = host_id
        self.addr = addr
        self._topology = topology                # the engine's MCCL_TOPOLOGY, if any
        self.fleet = None                        # mccl_common.discovery.FleetTable (our subnet)
        self.advertiser = None
        self.gossip: Gossip | None = None
        self.switches: SwitchMap | None = None   # this host's switch (net/topology.py)
        self._announced = {"state": "idle", "harvest": ""}   # what our fleet entry says (mDNS, gossip)

    def start_discovery(self, disc: ModuleType, links: LinkManager, ports: dict[str, int],
                        harvest_state: str | None) -> None:
        """mDNS (``disc`` is mccl_common.discovery) and, on the fleet it finds, the switch map."""
        self.fleet = disc.FleetTable(self.cfg.fleet, [self.addr], on_change=self._on_mdns_change,
                                     ttl_s=self.cfg.mdns_ttl_s)
        self.fleet.start()
        port = int(links.address.rpartition(":")[2])
        self.advertiser = disc.Advertiser(self.fleet.zc, self.cfg.fleet, self.host_id, self.addr, port,
                                          self.cfg.mdns_ttl_s, status_port=ports.get("StatusServer", 0),
                                          metrics_port=ports.get("MetricsServer", 0))
        self.advertiser.start()
        self.switches = SwitchMap(self.host_id, self.addr, links, lambda: fleet_peers(self.rows(), self.host_id),
                                  self._topology, self.cfg.topology_probes, self.cfg.topology_interval_s).start()
        if harvest_state is not None:
            self.advertiser.set_harvest(harvest_state)

    def start_gossip(self, links: LinkManager, ports: dict[str, int]) -> None:
        """Fleet tables spread over the links (net/gossip.py): seeds from MCCL_PEERS, peers from
        mDNS and from gossip itself, so the fleet is one table across subnets."""
        fixed = {"proto": PROTO_VERSION, "addresses": [self.addr], "port": int(links.address.rpartition(":")[2]),
                 "status_port": ports.get("StatusServer", 0), "metrics_port": ports.get("MetricsServer", 0),
                 "cores": cpu_cores(), "memory": memory_bytes(), "device": device_kind(), "version": __version__}

        def own() -> dict[str, Any]:
            return {**fixed, **self._announced}

        def local_peers() -> list[str]:
            fleet = self.fleet   # read once: stop() may clear it
            return [f"{e['addresses'][0]}:{e['port']}" for e in (fleet.entries() if fleet else [])
                    if e.get("addresses") and e["host_id"] != self.host_id]

        self.gossip = Gossip(self.cfg.fleet, self.host_id, links, own, self.cfg.seeds(),
                             self.cfg.gossip_interval_s, self.cfg.gossip_ttl_s, local_peers,
                             self._on_fleet_change).start()

    def stop(self) -> None:
        if self.gossip is not None:
            self.gossip.stop()
            self.gossip = None
        if self.switches is not None:
            self.switches.stop()
            self.switches = None
        if self.advertiser is not None:
            self.advertiser.stop()
            self.advertiser = None
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None

    def rows(self) -> list[dict[str, Any]]:
        """The fleet as this daemon knows it: mDNS (our subnet) first, gossip (every subnet) for the rest."""
        fleet, gossip = self.fleet, self.gossip   # read once: stop() may clear them
        rows = {e["host_id"]: {**e, "source": "mdns"} for e in (fleet.entries() if fleet else [])}
        for row in gossip.rows() if gossip else []:
            rows.setdefault(row["host_id"], row)
        return [rows[h] for h in sorted(rows)]

    def on_link_message(self, peer_host: str, kind: str, msg: dict[str, Any]) -> None:
        """A link message of a kind ``carries`` says is ours."""
        if kind.startswith("gossip_"):
            gossip = self.gossip   # read once: stop() may clear it
            if gossip is not None:
                gossip.on_message(peer_host, msg)
        else:
            switches = self.switches
            if switches is not None:
                switches.on_message(peer_host, msg)

    def switch(self) -> str:
        switches = self.switches
        return switches.switch() if switches is not None else ""

    def topology_status(self) -> dict[str, Any] | None:
        switches = self.switches
        return switches.status() if switches is not None else None

    def announce_state(self, state: str) -> None:
        self._announced["state"] = state
        advertiser = self.advertiser   # read once: stop() may clear it
        if advertiser is not None:
            advertiser.set_state(state)

    def announce_harvest(self, state: str) -> None:
        self._announced["harvest"] = state
        advertiser = self.advertiser   # read once: stop() may clear it (set_harvest re-announces on change only)
        if advertiser is not None:
            advertiser.set_harvest(state)

    def _on_mdns_change(self, host_id: str, entry: dict | None) -> None:
        gossip = self.gossip   # read once: stop() may clear it
        if entry is None and gossip is not None:
            gossip.forget(host_id)
        self._on_fleet_change(host_id, entry)

    def _on_fleet_change(self, host_id: str, entry: dict | None) -> None:
        log.debug("fleet: %s %s", host_id, "left" if entry is None else "seen")
