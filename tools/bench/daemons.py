"""The benchmark's own mccld on every host, for the mccl rows measured through the daemon.

``HostDaemons(launcher, run_dir).start()`` starts one mccld per (emulated or loopback)
host with its own MCCL_HOST_ID and MCCL_RUNTIME_DIR, all sharing a fleet key file made for
this run (mode 0600) and a fleet name nobody else uses; ``rank_env(h)`` is what a rank on
host h needs to attach (MCCL_DAEMON=1 and that host's runtime dir). ``stop()`` stops the
daemons (SIGTERM, then SIGKILL), removes their runtime dirs and the key, and unlinks any
shared-memory segment still named after one of the run's processes, whatever happened
before (the daemons' logs stay in ``run_dir``); it returns what it had to clean, so a leak
is reported, not hidden.

A job spanning hosts needs no discovery: every rank tells the others its daemon's link
address through torch's rendezvous store, and the daemons dial those addresses. So the
daemons run without zeroconf (mccld then logs that it has no mDNS); where zeroconf is
installed they announce themselves on their own address only (127.0.0.1 on loopback).

``python -m tools.bench.daemons [mccld args]`` is how each daemon is started: mccld's own
entry point, after asking Linux to SIGTERM it if the benchmark dies, so even a benchmark
killed with SIGKILL leaves no daemon behind (the daemon's SIGTERM handler frees its jobs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from mccl_common.errors import DaemonUnavailableError

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 60.0     # a 2-core box under load takes several seconds to import mccld
_STOP_TIMEOUT_S = 15.0
_TOKEN = "token"            # mccld writes it once its attach socket serves (mccl_common/attach_protocol.py)
_SHM_DIR = "/dev/shm"


class HostDaemons:
    """One mccld per host of ``launcher``, under ``run_dir`` (which the caller owns)."""

    def __init__(self, launcher, run_dir: str, extra_env: dict[str, str] | None = None):
        self.launcher = launcher
        self.extra_env = dict(extra_env or {})   # e.g. an lm variant's settings, for the daemons as for the ranks
        self.log_dir = os.path.join(run_dir, "daemons")
        # Runtime dirs and key live apart from the logs: the attach socket's path must stay
        # under the 107 characters of a Unix socket address, whatever --log-dir is.
        self.dir = tempfile.mkdtemp(prefix="mcclb-")     # mode 0700
        self.key_file = os.path.join(self.dir, "fleet.key")
        # Unique per run: daemons of another run (or developer) on the same LAN never link with ours.
        self.fleet = f"bench{os.getpid()}-{secrets.token_hex(2)}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.rank_pids: list[int] = []

    def runtime_dir(self, host: int) -> str:
        return os.path.join(self.dir, f"h{host}")

    def daemon_env(self, host: int) -> dict[str, str]:
        return {"MCCL_HOST_ID": f"{self.fleet}-h{host}", "MCCL_RUNTIME_DIR": self.runtime_dir(host),
                "MCCL_KEY_FILE": self.key_file, "MCCL_FLEET_KEY": "", "MCCL_FLEET": self.fleet,
                "MCCL_LISTEN_ADDR": self.launcher.addr(host), "MCCL_PORT": "0",
                "MCCL_STATUS_PORT": "0", "MCCL_METRICS_PORT": "0", **self.extra_env}

    def rank_env(self, host: int) -> dict[str, str]:
        return {"MCCL_DAEMON": "1", "MCCL_RUNTIME_DIR": self.runtime_dir(host)}

    # A launcher whose processes attach to these daemons (run_group only needs n and popen);
    # it remembers their pids, which name the segments stop() must not leave behind.
    @property
    def n(self) -> int:
        return self.launcher.n

    def popen(self, host: int, argv, env=None, **kw) -> subprocess.Popen:
        p = self.launcher.popen(host, argv, env={**(env or {}), **self.rank_env(host)}, **kw)
        self.rank_pids.append(p.pid)
        return p

    def start(self) -> "HostDaemons":
        try:
            os.makedirs(self.log_dir)
            fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            for h in range(self.launcher.n):
                path = os.path.join(self.log_dir, f"mccld-h{h}.log")
                self.logs.append(path)
                with open(path, "wb") as f:
                    self.procs.append(self.launcher.popen(
                        h, [sys.executable, "-m", "tools.bench.daemons", "--log-level", "WARNING"],
                        env=self.daemon_env(h), stdout=f, stderr=subprocess.STDOUT))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("mccld up on %d host(s), fleet %s", len(self.procs), self.fleet)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for h, p in enumerate(self.procs):
            while not os.path.exists(os.path.join(self.runtime_dir(h), _TOKEN)):
                if p.poll() is not None:
                    raise DaemonUnavailableError(
                        f"[bench] mccld on host {h} exited with {p.returncode} during start-up; likely cause: "
                        f"pyzmq or numpy missing, or the address {self.launcher.addr(h)} unusable; its log: "
                        f"{self.tail(h)}")
                if time.monotonic() > deadline:
                    raise DaemonUnavailableError(
                        f"[bench] Timed out after {_READY_TIMEOUT_S:.0f}s waiting for mccld on host {h} to serve "
                        f"its attach socket; likely cause: an overloaded machine; its log: {self.tail(h)}")
                time.sleep(0.1)

    def tail(self, host: int) -> str:
        try:
            with open(self.logs[host], errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-4:])[-800:]
        except OSError:
            return "(no log)"

    def stop(self) -> list[str]:
        """Stop every daemon and remove what the run left; returns the leftovers it had to clean
        (segments, daemons that ignored SIGTERM). Idempotent."""
        cleaned = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for h, p in enumerate(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                cleaned.append(f"mccld on host {h} (pid {p.pid}) ignored SIGTERM for {_STOP_TIMEOUT_S:.0f}s")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):   # stuck in the kernel: nothing more to do
                    p.wait(5)
        cleaned += self._unlink_segments([p.pid for p in self.procs] + self.rank_pids)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)   # the logs stay in run_dir
        for what in cleaned:
            log.warning("[bench] cleaned after the daemon run: %s", what)
        return cleaned

    @staticmethod
    def _unlink_segments(pids: list[int]) -> list[str]:
        from mccl_common.shm import PREFIX, owner_pid  # torch-, zmq- and zeroconf-free

        ours, cleaned = set(pids), []
        try:
            names = os.listdir(_SHM_DIR)
        except OSError:
            return []
        for name in names:
            if name.startswith(PREFIX) and owner_pid(name) in ours:
                try:
                    os.unlink(os.path.join(_SHM_DIR, name))
                    cleaned.append(f"shared-memory segment {name}")
                except FileNotFoundError:
                    pass
        return cleaned


def _main() -> int:
    from .worker import die_with_parent

    die_with_parent(signal.SIGTERM)  # SIGTERM, not SIGKILL: mccld frees its jobs' segments on it
    from mccld.__main__ import main

    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_main())
