"""This host as lent to the fleet: its harvest state (harvest.Harvester), the jobs that hold
it (those attached here and those `mcclctl run` launched), draining them and handing the
machine back when its user returns (reclaim.ReclaimWatch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from mccl_common.daemon_settings import DaemonConfig
from mccl_common.errors import MCCLError

from .harvest import Harvester
from .launcher import LaunchServer
from .reclaim import ReclaimWatch


class Lending:
    """``stat(method, *args)`` feeds the daemon's stats; ``announce(state)`` tells the fleet each
    harvest state. ``launcher`` is the launch endpoint, once one runs."""

    def __init__(self, cfg: DaemonConfig, stat: Callable[..., None], announce: Callable[[str], None]):
        self._cfg, self._stat, self._announce = cfg, stat, announce
        self.reclaim = ReclaimWatch(cfg.reclaim_grace_s, self._record_reclaim)
        self.harvester: Harvester | None = None
        self.launcher: LaunchServer | None = None
        self._attached: Callable[[], int] = lambda: 0
        self._counted = 0              # the running jobs the harvester last heard of

    def start(self, runtime_dir: Path, attached: Callable[[], int]) -> "Lending":
        """``attached()``: the jobs joining or running through the attach endpoint."""
        self._attached = attached
        self.harvester = Harvester(self._cfg, runtime_dir, self.running_jobs, self._on_harvest).start()
        return self

    def stop(self) -> None:
        if self.harvester is not None:
            self.harvester.stop()
            self.harvester = None
        self.launcher = None

    def state(self) -> str | None:
        harvester = self.harvester   # read once: stop() may clear it
        return harvester.snapshot()["state"] if harvester is not None else None

    def running_jobs(self) -> int:
        launcher = self.launcher   # read once: stop() may clear it
        return self._attached() + (launcher.running() if launcher is not None else 0)

    def recount(self) -> None:
        """A lease starts or ends with its jobs: re-evaluate now, not at the next poll."""
        running = self.running_jobs()
        if running != self._counted and self.harvester is not None:
            self._counted = running
            self.harvester.poke()

    def harvest(self) -> dict[str, Any]:
        """The harvest state with the hand-back's fields, and the transitions recorded."""
        harvester = self.harvester   # read once: stop() may clear it
        if harvester is None:
            raise MCCLError("[daemon] mccld is stopping; no harvest state to report")
        snapshot = harvester.snapshot()
        snapshot.update(self.reclaim.fields(snapshot["state"]))
        return {"harvest": snapshot, "history": harvester.history_records()}

    def _on_harvest(self, snapshot: dict[str, Any], changed: bool) -> None:
        launcher = self.launcher   # read once: stop() may clear it
        if changed and snapshot["state"] == "draining" and launcher is not None:
            launcher.drain()
        snapshot = {**snapshot, **self.reclaim.update(snapshot, changed, launcher)}
        self._stat("set_harvest", snapshot)
        self._announce(snapshot["state"])

    def _record_reclaim(self, seconds: float, how: str) -> None:
        self._stat("record_reclaim", seconds, how)
