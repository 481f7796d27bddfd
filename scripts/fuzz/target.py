"""The daemon under fuzzing: a private mccld subprocess, its resource figures, and the
real collective that must succeed between batches.

The daemon runs as its own process (not in the fuzzer's) so that a crash is a process
death the fuzzer sees, and its RSS, fds and threads are its own (read from /proc).
"""

from __future__ import annotations

import atexit
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .mccld_trimmed import TRIMMED_SUFFIX

ROOT = Path(__file__).resolve().parents[2]
FLEET_KEY = "fuzz-key-" + "k" * 24
FLEET = f"fuzz{os.getpid()}"       # its own: fuzzed daemons of other runs are not its peers (mDNS)
_START_S = 30.0
_SETTLE_S = 20.0            # for fds and threads to return to their baseline at the end
_COLLECTIVE_TIMEOUT_S = 20.0
_TRIMMED_MCCLD = Path(__file__).with_name("mccld_trimmed.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Resources:
    rss_kb: int
    fds: int
    threads: int
    # Where the RSS is (heap, mapped files, shared memory) and how many mappings: a grown
    # shmem figure or mapping count is a segment left mapped, which fds do not show.
    anon_kb: int = 0
    shmem_kb: int = 0
    maps: int = 0

    @classmethod
    def of(cls, pid: int) -> "Resources":
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        kb = lambda name: int(fields.get(name, "0 kB").split()[0])  # noqa: E731
        maps = Path(f"/proc/{pid}/maps").read_text().count("\n")
        return cls(kb("VmRSS"), len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"]),
                   kb("RssAnon"), kb("RssShmem"), maps)

    def as_dict(self) -> dict[str, int]:
        return {"rss_kb": self.rss_kb, "fds": self.fds, "threads": self.threads, "anon_kb": self.anon_kb,
                "shmem_kb": self.shmem_kb, "maps": self.maps}


class MemoryStore:
    """The three calls a daemon-mode rank makes on its c10d store (daemon.attach.join), in memory:
    the health check's two ranks share one, with no torch in the fuzzer."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cv:
            self._data[key] = value.encode() if isinstance(value, str) else value
            self._cv.notify_all()

    def get(self, key: str) -> bytes:
        with self._cv:
            return self._data[key]

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cv:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"keys {keys} not set within {timeout}")
                self._cv.wait(left)


@dataclass
class Daemon:
    """One mccld subprocess on loopback with its own runtime dir, host id and ports."""

    rdir: Path
    env: dict[str, str]
    status_port: int
    metrics_port: int
    proc: subprocess.Popen | None = None
    link_addr: str = ""
    host_id: str = ""
    log_path: Path | None = None
    _comm_id: int = field(default=0x10000)

    @classmethod
    def create(cls, link_timeout_s: float = 2.0) -> "Daemon":
        rdir = Path(tempfile.mkdtemp(prefix="mccl-fuzz-"))
        status_port, metrics_port = free_port(), free_port()
        # "z..." sorts after the fuzzer's fake peer hosts ("a..."), which so propose data sockets.
        host_id = f"zfuzz{os.getpid()}"
        env = {"MCCL_RUNTIME_DIR": str(rdir), "MCCL_FLEET_KEY": FLEET_KEY, "MCCL_FLEET": FLEET,
               "MCCL_LISTEN_ADDR": "127.0.0.1", "MCCL_PORT": "0", "MCCL_STATUS_PORT": str(status_port),
               "MCCL_METRICS_PORT": str(metrics_port), "MCCL_METRICS_ADDR": "127.0.0.1",
               "MCCL_HOST_ID": host_id, "MCCL_CLIENT_CHECK_INTERVAL": "0.1",
               "MCCL_LINK_TIMEOUT": str(link_timeout_s), "MCCL_SOCKETS_PER_PEER": "1"}
        return cls(rdir, env, status_port, metrics_port, host_id=host_id)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        from mccl_common import attach_protocol as protocol
        from mccld.attach import local_request
        self.log_path = self.rdir.with_suffix(".log")
        token = self.rdir / protocol.TOKEN_NAME
        if token.exists():
            token.unlink()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(_TRIMMED_MCCLD)], env={**os.environ, **self.env},
                                         stdout=log, stderr=log, cwd=ROOT)
        deadline = time.monotonic() + _START_S
        while not token.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"[fuzz] mccld did not start (exit {self.proc.poll()}); see {self.log_path}")
            time.sleep(0.05)
        status = local_request(self.rdir, {"type": "status"}, timeout_s=10.0)["status"]
        self.link_addr = status["address"]

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL; returns the exit status (negative: the signal that ended it)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.rdir, ignore_errors=True)
        self._trim_marker.unlink(missing_ok=True)

    @property
    def _trim_marker(self) -> Path:
        return Path(str(self.rdir) + TRIMMED_SUFFIX)

    def resources(self) -> Resources:
        return Resources.of(self.pid)

    def measure(self, timeout_s: float = 5.0) -> Resources:
        """The daemon's figures with glibc's cached free pages handed back first (see
        mccld_trimmed.py); untrimmed if the daemon did not answer within ``timeout_s``."""
        marker = self._trim_marker
        seen = marker.stat().st_size if marker.exists() else 0
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (marker.stat().st_size if marker.exists() else 0) <= seen:
            time.sleep(0.05)
        return self.resources()

    def steady(self, hold_s: float = 2.0, timeout_s: float = 20.0) -> Resources:
        """The daemon's figures once its fds and threads held still for ``hold_s`` (its start-up
        threads, mDNS's among them, come up a while after it answers)."""
        deadline = time.monotonic() + timeout_s
        last, since = self.resources(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.resources()
            if (now.fds, now.threads) != (last.fds, last.threads):
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= hold_s:
                break
        return self.measure()

    def settle(self, baseline: Resources, timeout_s: float = _SETTLE_S) -> Resources:
        """The daemon's figures once it lists no job and its fds and threads are back at
        ``baseline`` (or the timeout ran out): a job still closing (its engine, buffers and
        threads) is work in flight, not a leak."""
        deadline = time.monotonic() + timeout_s
        # Jobs first, then fds: asking for the job list is a connection of its own, which the
        # daemon closes a moment after answering.
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(0.2)
        while True:
            now = self.resources()
            if (now.fds <= baseline.fds and now.threads <= baseline.threads) or time.monotonic() > deadline:
                return self.measure()
            time.sleep(0.2)

    def jobs(self) -> list:
        """The jobs the daemon lists (an unanswered status counts as one, to keep waiting)."""
        from mccld.attach import local_request
        try:
            return local_request(self.rdir, {"type": "status"}, timeout_s=5.0)["status"]["jobs"]
        except Exception as e:  # noqa: BLE001 - a busy or dead daemon: settle keeps waiting, then reports
            return [f"status failed: {e}"]

    def next_comm_id(self) -> int:
        self._comm_id += 1
        return self._comm_id

    def collective(self, world: int = 2, n: int = 4096) -> str | None:
        """A real all_reduce through the daemon: ``world`` ranks of this process attach and
        reduce; None when every rank got the right sum, else what went wrong."""
        from libmccl.daemon.client import DaemonCommunicator
        os.environ["MCCL_RUNTIME_DIR"] = str(self.rdir)   # the client finds its daemon by it
        store, comm_id = MemoryStore(), self.next_comm_id()
        errors: list[str] = []

        def rank(r: int) -> None:
            comm = None
            try:
                comm = DaemonCommunicator(r, world, comm_id, store, None, None, _COLLECTIVE_TIMEOUT_S)
                a = np.full(n, r + 1, dtype=np.float32)
                comm.wait(comm.allreduce(a.ctypes.data, n, 0, 0), _COLLECTIVE_TIMEOUT_S)
                want = world * (world + 1) / 2
                if not (a == want).all():
                    errors.append(f"rank {r}: all_reduce gave {a[:4]}..., expected {want}")
            except Exception as e:  # noqa: BLE001 - reported as the health check's verdict
                errors.append(f"rank {r}: {type(e).__name__}: {e}")
            finally:
                if comm is not None:
                    comm.shutdown(5.0)

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_COLLECTIVE_TIMEOUT_S + 15)
        if any(t.is_alive() for t in threads):
            errors.append("a rank hung past the collective's timeout")
        return "; ".join(errors) or None


class Helper:
    """A child process whose pid the attach fuzzer's connections claim in hello: the daemon
    ties their jobs to it, and killing it at the end of a batch makes the daemon free them
    (the fuzzer itself must stay alive)."""

    live: "set[Helper]" = set()

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        Helper.live.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        Helper.live.discard(self)


@atexit.register
def _kill_helpers() -> None:
    for helper in list(Helper.live):
        helper.kill()


def fake_host_id(i: int) -> str:
    return f"afake{i:06d}"


def rss_growth_mb(before: Resources, after: Resources) -> float:
    return (after.rss_kb - before.rss_kb) / 1024.0


def summary_resources(before: Resources, after: Resources) -> dict[str, Any]:
    return {"before": before.as_dict(), "after": after.as_dict(),
            "rss_growth_mb": round(rss_growth_mb(before, after), 1),
            "shmem_growth_mb": round((after.shmem_kb - before.shmem_kb) / 1024.0, 1)}
