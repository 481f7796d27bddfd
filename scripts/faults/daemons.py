"""One mccld per emulated host, for the campaign and the soak: started, replaced, measured.

Each daemon gets its own MCCL_RUNTIME_DIR and MCCL_HOST_ID (``h<i>``) and a fleet name and
key private to this run, as tests/e2e/test_daemon_fleet.py does; ``footprint`` reads a
daemon's RSS, fds and threads from /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 10.0


def daemon_footprint(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class HostDaemons:
    def __init__(self, fleet, root: Path, extra_env: dict[str, str] | None = None):
        self.fleet, self.root = fleet, root
        self.extra_env = extra_env or {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.generation: dict[int, int] = {}
        self.baseline: dict[int, dict[str, int]] = {}    # footprints once warmed up (set by the campaign)
        root.mkdir(parents=True, exist_ok=True)

    def env(self, h: int) -> dict[str, str]:
        return {"MCCL_IFACE": "eth0", "MCCL_RUNTIME_DIR": str(self.root / f"h{h}"), "MCCL_HOST_ID": f"h{h}",
                "MCCL_FLEET_KEY": f"campaign-key-{os.getpid()}-" + "k" * 16, "MCCL_FLEET": f"fc{os.getpid()}",
                "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0", "MCCL_CLIENT_CHECK_INTERVAL": "0.1",
                **self.extra_env}

    def pid(self, h: int) -> int:
        return self.procs[h].pid

    def log(self, h: int) -> Path:
        return self.root / f"h{h}.{self.generation.get(h, 0)}.log"

    def _spawn(self, h: int) -> None:
        self.generation[h] = self.generation.get(h, -1) + 1
        token = self.root / f"h{h}" / "token"
        token.unlink(missing_ok=True)
        with open(self.log(h), "w") as log:
            self.procs[h] = self.fleet.popen(h, [sys.executable, "-m", "mccld", "--log-level", "INFO"],
                                             env=self.env(h), stdout=subprocess.DEVNULL, stderr=log)

    def _wait_ready(self, hosts: list[int]) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        for h in hosts:
            while not (self.root / f"h{h}" / "token").exists():
                if self.procs[h].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"[campaign] mccld on h{h} did not start within {_START_TIMEOUT_S:.0f}s:\n"
                                       f"{self.log(h).read_text()[-2000:]}")
                time.sleep(0.05)

    def start_all(self) -> None:
        for h in range(self.fleet.n_hosts):
            self._spawn(h)
        self._wait_ready(list(range(self.fleet.n_hosts)))

    def replace(self, h: int) -> None:
        """SIGKILL host h's daemon (killed or stopped by a fault already) and start a new one."""
        p = self.procs[h]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(_STOP_TIMEOUT_S)
        self._spawn(h)
        self._wait_ready([h])

    def footprints(self) -> dict[int, dict[str, int]]:
        return {h: daemon_footprint(p.pid) for h, p in self.procs.items() if p.poll() is None}

    def jobs(self, h: int) -> list[dict]:
        """The jobs host h's daemon still lists (its status over the attach socket)."""
        from mccld.attach import local_request
        return local_request(self.root / f"h{h}", {"type": "status"}, timeout_s=5.0)["status"]["jobs"]

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(_STOP_TIMEOUT_S)
