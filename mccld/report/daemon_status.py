"""What mccld reports of itself over its services: the status that ``mcclctl status`` and the
attach ``status`` request show (docs/dev/interfaces.md §4; the status server adds the stats),
the capacity it offers the fleet (``mcclctl capacity``) and its data sockets (``/metrics``).
Each service is passed as it is now: ``None`` where the daemon is not (or no longer) running it."""

from __future__ import annotations

from typing import Any

from mccl_common import PROTO_VERSION, __version__
from mccl_common.hostinfo import host_facts

from ..host.launcher import LaunchServer
from ..host.lending import Lending
from ..jobs.service import JobService
from ..net.datalinks import DataLinks
from ..net.fleet import FleetView
from ..net.links import LinkManager


def data_link_status(datalinks: DataLinks | None) -> list[dict[str, Any]]:
    return datalinks.status() if datalinks is not None else []


def fleet_rows(fleet: FleetView | None) -> list[dict[str, Any]]:
    return fleet.rows() if fleet is not None else []


def daemon_status(host_id: str, fleet_name: str, jobs: JobService | None, links: LinkManager | None,
                  datalinks: DataLinks | None, fleet: FleetView | None,
                  launcher: LaunchServer | None, endpoints: dict[str, Any] | None = None) -> dict[str, Any]:
    """What only the daemon knows; the status server completes it from the stats.

    ``endpoints``: the interface and the ports this daemon listens on (0: off), so that
    ``mcclctl doctor`` checks those and not the caller's settings."""
    rows, attached = jobs.rows() if jobs is not None else ([], 0)
    return {
        "host": host_id, "fleet": fleet_name, "address": links.address if links else "",
        "version": __version__, "proto": PROTO_VERSION, "attached": attached, "jobs": rows,
        "links": links.peers() if links else [],
        "data_links": data_link_status(datalinks),
        "fleet_table": fleet_rows(fleet),
        "topology": fleet.topology_status() if fleet is not None else None,
        "last_error": (jobs.last_error if jobs is not None else "") or None,
        "launch_port": launcher.port if launcher is not None else 0,
        "launched": launcher.jobs() if launcher is not None else [],
        "endpoints": dict(endpoints or {}),
    }


def capacity(lending: Lending) -> dict[str, Any]:
    """What this host offers the fleet and when: host facts, the harvest state and its
    transition history (MCCLError while mccld stops)."""
    return {**host_facts(), **lending.harvest()}
