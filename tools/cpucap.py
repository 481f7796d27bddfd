"""CPU caps for emulated hosts: one cgroup per slowed host, its processes in it.

A namespace host shares the machine's cores with every other one, so "a slower Mac" is emulated
by a CPU quota: ``cores=0.25`` lets the host's processes run 2.5 ms of every 10 ms period, on
any core (the kernel's CFS bandwidth control, cgroup v2 ``cpu.max`` or v1
``cpu.cfs_quota_us``). ``idle=True`` is the artist's-Mac case: the host's processes run at the
kernel's idle priority (``cpu.idle``, SCHED_IDLE for the group), as a macOS job demoted to
background QoS does, getting a core only when nothing else on the machine wants it.

The runner that owns the fleet creates the groups (root), puts each process it starts on a
capped host into that host's group (``ip netns exec`` execs, so the pid it gets back is the
process's own), and applies a cap that starts mid-run when a rank reports the step (a marker
file; ``ip netns exec`` mounts a fresh /sys, so ranks cannot reach the cgroup files
themselves). Tools, not product.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from mccl_common.errors import ConfigError

# A short period, so a step of a few tens of ms sees the cap as a slower CPU rather than as
# bursts at full speed and then a stall until the period ends (what 100 ms gave a 5 ms step).
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000            # the kernel's floor: a cap of at least 0.1 cores at this period


def _hierarchy() -> tuple[str, Path]:
    """("v2", root) where the unified hierarchy has the cpu controller, else ("v1", the cpu
    controller's mount); ConfigError naming what is missing otherwise."""
    root = Path("/sys/fs/cgroup")
    ctl = root / "cgroup.controllers"
    if ctl.exists() and "cpu" in ctl.read_text().split():
        return "v2", root
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if (root / name / "cpu.cfs_quota_us").exists():
            return "v1", root / name
    raise ConfigError("[cpucap] no cgroup cpu controller under /sys/fs/cgroup (neither v2 cpu.max nor v1 "
                      "cpu.cfs_quota_us); likely cause: a container without cgroup access; run on a host (root) "
                      "or use --slow (the compute stand-in) instead")


@dataclass
class Cap:
    """What one host gets: ``cores`` of CPU time per period (None: no quota), ``idle``: background
    priority; from step ``at`` on (0: from the start)."""

    cores: float | None = None
    idle: bool = False
    at: int = 0

    def to_dict(self) -> dict:
        return {"cores": self.cores, "idle": self.idle, "at": self.at}


class CpuGroup:
    """One cgroup: create, cap, add processes, remove (processes go back to the root group)."""

    def __init__(self, name: str) -> None:
        if os.geteuid() != 0:
            raise ConfigError("[cpucap] capping a host's CPU needs root (it creates a cgroup); run as root or use "
                              "--slow (the compute stand-in) instead")
        self.kind, self.root = _hierarchy()
        self.path = self.root / name
        try:
            if self.kind == "v2":
                sub = self.root / "cgroup.subtree_control"
                if "cpu" not in sub.read_text().split():
                    sub.write_text("+cpu")
            self.path.mkdir(exist_ok=True)
        except OSError as e:
            # e.g. a container whose cgroup root holds processes: v2 then refuses to enable cpu below it
            raise ConfigError(f"[cpucap] cannot create the cgroup {self.path} with the cpu controller ({e}); likely "
                              "cause: a container without its own cgroup tree; run on a host or use --slow") from e

    def set(self, cores: float | None, idle: bool) -> None:
        quota = None if cores is None else int(cores * PERIOD_US)
        if quota is not None and quota < MIN_QUOTA_US:
            raise ConfigError(f"[cpucap] a cap of {cores} cores is below the kernel's floor of "
                              f"{MIN_QUOTA_US / PERIOD_US} cores at a {PERIOD_US / 1000:g} ms period")
        if self.kind == "v2":
            (self.path / "cpu.max").write_text(f"{quota or 'max'} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota or -1))
        idle_file = self.path / "cpu.idle"
        if idle_file.exists():
            idle_file.write_text("1" if idle else "0")
        elif idle:
            raise ConfigError(f"[cpucap] this kernel has no {idle_file} (needs Linux 5.15+): background priority "
                              "cannot be emulated here")

    def add(self, pid: int) -> None:
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass    # it has already exited: nothing to cap

    def throttled_s(self) -> float:
        """CPU time the quota held back so far (cpu.stat), seconds."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def remove(self) -> None:
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except (ProcessLookupError, OSError):
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass    # a process still in it: the kernel keeps the group until it exits


class CpuCaps:
    """The caps of a fleet's hosts, by host index. ``marker(host)`` is the file a rank creates when
    it reaches the cap's step; a watcher thread applies the cap then (``start``/``close``)."""

    def __init__(self, caps: dict[int, Cap], marker_dir: str, tag: str | None = None) -> None:
        self.caps = dict(caps)
        self.marker_dir = marker_dir
        tag = tag or f"mccl-bench-{os.getpid()}"
        self.groups = {h: CpuGroup(f"{tag}-h{h}") for h in self.caps}
        self._applied: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for h, cap in self.caps.items():
            if cap.at == 0:
                self._apply(h)
            else:
                self.groups[h].set(None, False)

    def marker(self, host: int) -> str:
        return os.path.join(self.marker_dir, f"cpucap-h{host}")

    def _apply(self, host: int) -> None:
        cap = self.caps[host]
        self.groups[host].set(cap.cores, cap.idle)
        self._applied.add(host)

    def add(self, host: int, pid: int) -> None:
        if host in self.groups:
            self.groups[host].add(pid)

    def reset(self) -> None:
        """Before each variant: caps that start mid-run are lifted again, their markers removed."""
        for h, cap in self.caps.items():
            if cap.at > 0:
                self.groups[h].set(None, False)
                self._applied.discard(h)
                try:
                    os.remove(self.marker(h))
                except FileNotFoundError:
                    pass

    def start(self) -> None:
        if any(c.at > 0 for c in self.caps.values()) and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="cpucap-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            for h, cap in self.caps.items():
                if cap.at > 0 and h not in self._applied and os.path.exists(self.marker(h)):
                    self._apply(h)

    def throttled_s(self) -> dict[int, float]:
        return {h: g.throttled_s() for h, g in self.groups.items()}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for g in self.groups.values():
            g.remove()
