"""An emulated fleet with one mccld per host (tools.fleet namespaces), for the fleet tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent     # rank scripts import ``support`` from here

KEY = "fleet-test-key-" + "k" * 24


def skip_unless_fleet() -> None:
    """Skip the test where this machine cannot build an emulated fleet (root, ip, tc)."""
    from mccl_common.errors import ConfigError
    from tools.fleet import check_prerequisites
    try:
        check_prerequisites()
    except ConfigError as e:
        pytest.skip(str(e))


class DaemonFleet:
    """N namespaces, each with one mccld; ``keys`` lets a host hold a wrong key. ``ranks``
    runs ``RANK_SCRIPT fn rank world`` on the hosts: a subclass names the script (a test
    file whose ``__main__`` dispatches rank programs)."""

    RANK_SCRIPT: Path | None = None

    def __init__(self, n: int, keys: list[str] | None = None, rate: str | None = None,
                 extra_env: dict[str, str] | None = None, **fleet_kw):
        """``fleet_kw``: more of tools.fleet.Fleet's arguments (switches, uplink_rate, ...)."""
        from tools.fleet import Fleet
        self.n = n
        self.extra_env = extra_env or {}
        self.fleet = Fleet(n, rate=rate, **fleet_kw)
        self.dir = Path(tempfile.mkdtemp(prefix="mccl-dfleet-"))
        self.keys = keys or [KEY] * n
        self.daemons: list[subprocess.Popen] = []

    def env(self, i: int) -> dict[str, str]:
        return {"MCCL_IFACE": "eth0", "MCCL_RUNTIME_DIR": str(self.dir / f"h{i}"), "MCCL_HOST_ID": f"h{i}",
                "MCCL_FLEET_KEY": self.keys[i], "MCCL_FLEET": "dtest", "MCCL_MDNS_TTL": "6",
                "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0", "MCCL_CLIENT_CHECK_INTERVAL": "0.1",
                **self.extra_env}

    def log(self, i: int) -> str:
        return (self.dir / f"h{i}.log").read_text()

    def __enter__(self) -> "DaemonFleet":
        self.fleet.start()
        try:
            for i in range(self.n):
                with open(self.dir / f"h{i}.log", "w") as log:
                    self.daemons.append(self.fleet.popen(i, [sys.executable, "-m", "mccld", "--log-level", "DEBUG"],
                                                         env=self.env(i), stderr=log))
            deadline = time.monotonic() + 30
            for i in range(self.n):
                while not (self.dir / f"h{i}" / "token").exists():
                    if self.daemons[i].poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"mccld on h{i} did not start:\n{self.log(i)}")
                    time.sleep(0.1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.daemons:
            if p.poll() is None:
                p.terminate()
        for p in self.daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.fleet.stop()
        for p in sorted(self.dir.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() else p.rmdir()
        self.dir.rmdir()

    def status(self, i: int) -> dict:
        from mccld.attach import local_request
        return local_request(self.dir / f"h{i}", {"type": "status"})["status"]

    def ranks(self, fn: str, placement: list[int], extra_env: dict | None = None,
              timeout_s: float = 120.0) -> dict[int, tuple[int, str]]:
        """Run rank r of ``fn`` on host placement[r]; returns {rank: (exit code, its output)}."""
        return self.finish(self.start_ranks(fn, placement, extra_env), timeout_s)

    def start_ranks(self, fn: str, placement: list[int], extra_env: dict | None = None) -> list[subprocess.Popen]:
        if self.RANK_SCRIPT is None:
            raise TypeError(f"{type(self).__name__} names no RANK_SCRIPT to run rank programs with")
        world = len(placement)
        env_common = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p),"MASTER_ADDR": self.fleet.hosts[placement[0]].addr, "MASTER_PORT": "29700",
                      "WORLD_SIZE": str(world), **(extra_env or {})}
        procs = []
        for r, h in enumerate(placement):
            env = {**self.env(h), **env_common, "RANK": str(r)}
            procs.append(self.fleet.popen(h, [sys.executable, str(self.RANK_SCRIPT), fn, str(r), str(world)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return procs

    @staticmethod
    def finish(procs: list[subprocess.Popen], timeout_s: float) -> dict[int, tuple[int, str]]:
        """Wait for every process (SIGKILL at the deadline); {index: (exit code, its output)}."""
        out = {}
        deadline = time.monotonic() + timeout_s
        try:
            for r, p in enumerate(procs):
                try:
                    text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    text, _ = p.communicate(timeout=10)
                    text += "\n<timed out>"
                out[r] = (p.returncode, text.strip())
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        return out
